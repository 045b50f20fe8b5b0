"""Which prefill and which decode worker take a request: a pure policy over the known workers.

The table holds every worker discovery knows of, with what its ``Info`` last said and the work the
router has outstanding on it. A request gets the least-loaded decode worker that has a compatible
prefill partner, and the least-loaded such partner; prefill load is counted in prompt tokens
(its cost grows with them), decode load in requests. Compatible means what
``services.kv.spec.pair_support.pair_refusal`` allows, the same rule the KV handshake applies: equal
compatibility hashes, block sizes that divide one another, and TP sizes that can shard every KV
group's heads. Short prompts, and requests with no compatible prefill worker up, go straight to a
decode worker, which prefills them itself (with ``enforce_disagg`` the request flow refuses the
latter, and the serving status without a pair is unavailable, not degraded).
:meth:`PairingPolicy.unpaired_reason` says why a worker has no partner, for ``/health`` and the logs.

With a pair probe table (``pair_probes.py``; the router's default), a compatible pair is used only once
its probe succeeded for the two workers' current epochs: pending pairs wait, failed ones are refused
with the probe's reason.

KV-aware routing (with a prefix index, the router's default): the prefill worker is the one with the
lowest estimated time to first token given what its caches hold, the decode worker the least loaded
counting what it must pull, and unless ``direct_decode_threshold`` is set the request is served directly
on the decode worker when that is cheaper (``scoring.py``). The prompt's blocks are then recorded as
predicted on both workers (``prefix_index.py``). Without an index: least outstanding work, as above.

Counts change only through :meth:`acquire` and the two ``finish_*`` calls, so a caller that
finishes what it acquired (in a ``finally``) can never leave a count behind. No I/O, no clock:
discovery and the request flow drive it (the flow passes the time), tests drive it directly.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from services.contract.prefix_keys import cache_salt_for
from services.kv.spec.pair_support import PairSide, pair_refusal
from services.router.pair_probes import PairKey, PairProbe, PairProbeTable, PairState
from services.router.prefix_index import UNKNOWN_ROOM, PrefixIndex, PromptKeys, full_attention_groups
from services.router.scoring import (
    Candidate,
    Reason,
    RouteReason,
    ScoringConfig,
    choose_decode,
    choose_prefill,
    direct_reason,
    work_tokens,
)


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class ServingStatus(enum.StrEnum):
    """What the router can do now: disaggregate (ok), serve through decode workers alone (degraded), nothing."""

    OK = "ok"
    DEGRADED = "degraded"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class WorkerIdentity:
    """What a worker's ``Info`` says about it, as far as pairing is concerned."""

    engine_id: str
    role: str
    compat_hash: str
    model_name: str = ""
    tp_size: int = 1
    block_size: int | None = None
    max_model_len: int | None = None
    draining: bool = False
    epoch: int = 0
    # The fields the hash was computed from (KV heads per group, dtype, ...): they explain a refusal.
    compat_fields: Mapping[str, str] = field(default_factory=dict, hash=False)
    roles: tuple[str, ...] = ()  # the roles it can serve (both: it can switch in place); () from an older worker
    switching_to: str = ""  # while its role switch drains: the role it is switching to

    @property
    def switchable(self) -> bool:
        return len(self.roles) > 1

    def pair_side(self) -> PairSide:
        return PairSide(self.compat_hash, self.compat_fields, self.tp_size, self.block_size)


@dataclass
class WorkerState:
    """One worker as the router sees it; ``identity`` is None until it first answered."""

    address: str
    role: Role
    identity: WorkerIdentity | None = None
    healthy: bool = False
    last_error: str | None = None
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    queued_prefill_tokens: int = 0  # estimated prefill work (uncached prompt tokens) outstanding (prefill side)
    # Requests counted here whose Generate has not been sent yet (their prefill runs): a role switch waits for
    # them, since the worker's own drain cannot see a request that has not reached it.
    unsent_generates: int = 0
    # Breaks ties between equally loaded workers, so sequential requests rotate.
    num_picks: int = 0
    switching: bool = False  # this router is switching its role: no new work for any role until it is done

    @property
    def available(self) -> bool:
        """May take new work: answered its last health check and is neither draining nor switching roles."""
        return self.healthy and self.identity is not None and not self.identity.draining and not self.switching


@dataclass
class Assignment:
    """The workers one request holds; ``prefill`` is None for a request sent straight to decode."""

    decode: str
    prefill: str | None
    num_prompt_tokens: int
    reader_tp_size: int = 1
    reader_block_size: int = 0  # the decode engine's KV block size (sets the ticket's digest unit); 0: unknown
    # the decode engine's compat hash: a prefill worker whose KV dtype it converts (kv_convert) stages for it
    reader_compat_hash: str = ""
    prefill_work_tokens: int = 0  # the prompt tokens the prefill worker is estimated to compute
    # (role, Reason) per worker chosen, and why the request is disaggregated or direct: metric labels.
    decisions: tuple[tuple[str, str], ...] = ()
    route_reason: str = ""
    detail: str = ""  # the scores behind the choice, for the debug log
    # The states counted on: a worker that leaves and comes back is a new state, never uncounted.
    _decode_state: WorkerState | None = field(default=None, repr=False)
    _generate_unsent: bool = field(default=False, repr=False)  # counted in _decode_state.unsent_generates
    _prefill_state: WorkerState | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self._decode_state is None and self._prefill_state is None


@functools.lru_cache(maxsize=4096)
def refusal(prefill: WorkerIdentity, decode: WorkerIdentity) -> str | None:
    """Why the decode worker could not pull KV from the prefill worker; None when it can.

    Cached: every request asks about every pair, and identities change only when a worker restarts
    or starts draining (a new identity, so a new key).
    """
    return pair_refusal(prefill.pair_side(), decode.pair_side())


def compatible(prefill: WorkerIdentity, decode: WorkerIdentity) -> bool:
    """Whether the decode worker's handshake with the prefill worker can succeed."""
    return refusal(prefill, decode) is None


class PairingPolicy:
    """The worker table and the pairing rule."""

    def __init__(self, direct_decode_threshold: int | None = 0, enforce_disagg: bool = False,
                 probes: PairProbeTable | None = None, index: PrefixIndex | None = None,
                 scoring: ScoringConfig | None = None) -> None:
        """Prompts with fewer than ``direct_decode_threshold`` tokens skip the prefill worker; None: the
        cost-based decision with an index, never without one.
        ``enforce_disagg``: decode workers may not prefill, so without a pair nothing can be served.
        ``probes``: use a compatible pair only once its probe succeeded (None: every compatible pair).
        ``index``: route KV-aware over it, scored by ``scoring`` (None: least outstanding work)."""
        if direct_decode_threshold is not None and direct_decode_threshold < 0:
            raise ValueError(f"direct_decode_threshold must be >= 0, got {direct_decode_threshold}")
        self.direct_decode_threshold = 0 if enforce_disagg else direct_decode_threshold
        self.enforce_disagg = enforce_disagg
        self.probes = probes
        self.index = index
        self.scoring = scoring or ScoringConfig()
        self._workers: dict[tuple[Role, str], WorkerState] = {}
        # Called with (role, address) whenever a worker is marked unhealthy (failover.py's DecodeWatch).
        self.down_listeners: list[Callable[[Role, str], None]] = []

    # ---- membership (driven by discovery) --------------------------------------------------------

    def set_addresses(self, role: Role, addresses: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make ``addresses`` the workers of ``role``; return (added, removed). New ones start unhealthy."""
        wanted = list(dict.fromkeys(addresses))
        current = [address for (r, address) in self._workers if r == role]
        added = [a for a in wanted if (role, a) not in self._workers]
        removed = [a for a in current if a not in wanted]
        for address in added:
            self._workers[(role, address)] = WorkerState(address, role)
        for address in removed:
            del self._workers[(role, address)]
        return added, removed

    def get(self, role: Role, address: str) -> WorkerState | None:
        return self._workers.get((role, address))

    def workers(self, role: Role | None = None) -> list[WorkerState]:
        return [w for (r, _), w in self._workers.items() if role is None or r == role]

    def prompt_key_specs(self) -> set[tuple[int, bytes]]:
        """Every (block size, salt) a prompt is keyed by when the available workers are scored and predicted."""
        specs: set[tuple[int, bytes]] = set()
        for worker in self._workers.values():
            if worker.available and worker.identity is not None and worker.identity.block_size:
                salt = cache_salt_for(worker.identity.compat_hash)
                sizes = self.index.block_sizes(worker.address) | {worker.identity.block_size}
                specs.update((size, salt) for size in sizes)
        return specs

    def mark_healthy(self, role: Role, address: str, identity: WorkerIdentity) -> None:
        worker = self._workers.get((role, address))
        if worker is not None:
            worker.identity, worker.healthy, worker.last_error = identity, True, None

    def mark_unhealthy(self, role: Role, address: str, reason: str) -> None:
        """Take a worker out of rotation until its next successful health check."""
        worker = self._workers.get((role, address))
        if worker is not None:
            worker.healthy, worker.last_error = False, reason
            for listener in self.down_listeners:
                listener(role, address)

    # ---- what is up ------------------------------------------------------------------------------

    def _available(self, role: Role) -> list[WorkerState]:
        return [w for w in self.workers(role) if w.available]

    def _pairs_with(self, prefill: WorkerState, decode: WorkerState) -> bool:
        """Compatible, and (with probes) probed for both workers' current epochs."""
        if prefill.identity is None or decode.identity is None or not compatible(prefill.identity, decode.identity):
            return False
        return self.probes is None or self.probes.usable(prefill.address, decode.address,
                                                         (prefill.identity.epoch, decode.identity.epoch))

    def _partners(self, decode: WorkerState) -> list[WorkerState]:
        """Available prefill workers the (available) decode worker can pull from."""
        return [p for p in self._available(Role.PREFILL) if self._pairs_with(p, decode)]

    def partners(self, worker: WorkerState) -> list[WorkerState]:
        """Available workers of the other role this (available) worker can pair with, either role."""
        if worker.role == Role.DECODE:
            return self._partners(worker)
        return [d for d in self._available(Role.DECODE) if self._pairs_with(worker, d)]

    def compatible_pairs(self) -> list[PairKey]:
        """Every compatible (prefill, decode) pair of available workers, with their epochs: what the pair
        probes cover."""
        return [(p.address, d.address, p.identity.epoch, d.identity.epoch)
                for d in self._available(Role.DECODE) for p in self._available(Role.PREFILL)
                if p.identity and d.identity and compatible(p.identity, d.identity)]

    def _failed_probe(self, prefill: str, decode: str) -> PairProbe | None:
        """The pair's probe entry if its probe failed; None when probed, pending, or not probing."""
        entry = self.probes.get(prefill, decode) if self.probes is not None else None
        return entry if entry is not None and entry.state is PairState.FAILED else None

    def _probe_refusal(self, prefill: WorkerState, decode: WorkerState) -> str | None:
        """Why a compatible pair is not used because of its probe, if it is not."""
        entry = self._failed_probe(prefill.address, decode.address)
        return f"KV probe failed: {entry.reason}" if entry is not None else None

    def unpaired_reason(self, worker: WorkerState) -> str | None:
        """Why an available worker pairs with none of the available workers of the other role.

        None when it has a partner, or when no worker of the other role is available to judge by
        (health already says so); otherwise the reason against each candidate, named by role and
        address.
        """
        if not worker.available or worker.identity is None:
            return None
        other = Role.DECODE if worker.role == Role.PREFILL else Role.PREFILL
        reasons = []
        for candidate in self._available(other):
            if candidate.identity is None:
                continue
            prefill, decode = (worker, candidate) if other == Role.DECODE else (candidate, worker)
            reason = refusal(prefill.identity, decode.identity) or self._probe_refusal(prefill, decode)
            if reason is None:  # paired, or its probe is pending
                return None
            reasons.append(f"{other} {candidate.address}: {reason}")
        return "; ".join(reasons) or None

    def no_pair_reason(self) -> str:
        """Why no pair can take a request now (when ``has_healthy_pair`` is False), for ``/health`` and
        the strict router's 503."""
        if not self._available(Role.PREFILL):
            return "no healthy prefill worker"
        pairs = self.compatible_pairs()
        if not pairs or self.probes is None:
            return "no healthy prefill worker can pair with a healthy decode worker (see each worker's unpaired_reason)"
        failed = sum(1 for p, d, _, _ in pairs if self._failed_probe(p, d) is not None)
        if failed == len(pairs):
            return "every compatible pair of healthy workers failed its KV probe (see pairs and each worker's " \
                   "unpaired_reason)"
        if not failed:
            return "the KV probe of every compatible pair of healthy workers is still pending (see pairs)"
        return "no compatible pair of healthy workers has passed its KV probe: some are pending, the others failed " \
               "(see pairs)"

    def has_healthy_pair(self) -> bool:
        return any(self._partners(d) for d in self._available(Role.DECODE))

    def has_healthy_decode(self) -> bool:
        return bool(self._available(Role.DECODE))

    def serving_status(self, decode_only: bool = False) -> ServingStatus:
        """OK with a compatible healthy pair (a decode-only router: a healthy decode worker); DEGRADED when
        decode workers are up but none has a prefill partner, so every prompt is prefilled on decode
        (UNAVAILABLE instead under ``enforce_disagg``, where such requests are refused)."""
        if not self.has_healthy_decode():
            return ServingStatus.UNAVAILABLE
        if decode_only or self.has_healthy_pair():
            return ServingStatus.OK
        return ServingStatus.UNAVAILABLE if self.enforce_disagg else ServingStatus.DEGRADED

    def worker_state(self, worker: WorkerState) -> str:
        """One word for ``/health``: healthy, unpaired (healthy, but no live worker of the other role can
        pair with it), switching (its role, in place), draining, unhealthy (its last probe failed) or unknown
        (never answered yet)."""
        if worker.available:
            return "unpaired" if self.unpaired_reason(worker) else "healthy"
        if worker.healthy and (worker.switching or (worker.identity is not None and worker.identity.switching_to)):
            return "switching"
        if worker.healthy:
            return "draining"
        return "unhealthy" if worker.last_error else "unknown"

    def max_model_len(self) -> int | None:
        """The smallest context length any available worker reports (a request must fit both sides)."""
        limits = [w.identity.max_model_len for w in self.workers() if w.available and w.identity.max_model_len]
        return min(limits, default=None)

    # ---- pairing ---------------------------------------------------------------------------------

    def acquire(self, num_prompt_tokens: int, affinity: tuple[str | None, str] | None = None,
                prompt: PromptKeys | None = None, now_s: float = 0.0) -> Assignment | None:
        """Pick workers for a request and count it on them; None when no decode worker is up.

        ``affinity`` (prefill, decode): the pair to prefer while both are available and still pair (a
        sibling choice of the same prompt: their prefix caches hold its blocks). ``prompt``: its keys, for
        KV-aware routing (with an index); ``now_s``: the monotonic time, for predicted entries.
        """
        decodes = self._available(Role.DECODE)
        if not decodes:
            return None
        if self.index is not None and prompt is not None:
            return self._acquire_kv(decodes, prompt, affinity, now_s)
        threshold = self.direct_decode_threshold or 0
        prefill: WorkerState | None = None
        if num_prompt_tokens >= threshold:
            paired = [d for d in decodes if self._partners(d)]
            if paired:
                decodes = paired
        decode = min(decodes, key=lambda w: (w.outstanding_requests, w.num_picks, w.address))
        if affinity is not None:
            decode = next((d for d in decodes if d.address == affinity[1]), decode)
        if num_prompt_tokens >= threshold:
            partners = self._partners(decode)
            if partners:
                prefill = min(partners, key=lambda w: (w.outstanding_tokens, w.outstanding_requests,
                                                        w.num_picks, w.address))
                if affinity is not None:
                    prefill = next((p for p in partners if p.address == affinity[0]), prefill)
        if prefill is None:
            route = RouteReason.THRESHOLD if num_prompt_tokens < threshold else RouteReason.NO_PREFILL
        else:
            route = RouteReason.ENFORCED if self.enforce_disagg else RouteReason.THRESHOLD
        reasons = [(Role.DECODE, Reason.LEAST_OUTSTANDING)]
        if prefill is not None:
            reasons.append((Role.PREFILL, Reason.LEAST_OUTSTANDING))
        return self._count(num_prompt_tokens, decode, prefill, num_prompt_tokens, reasons, route, "")

    def _acquire_kv(self, decodes: list[WorkerState], prompt: PromptKeys,
                    affinity: tuple[str | None, str] | None, now_s: float) -> Assignment:
        """KV-aware: prefill by TTFT estimate, decode by load and what it must pull, then direct or not."""
        n, config, threshold = len(prompt), self.scoring, self.direct_decode_threshold
        paired = [d for d in decodes if self._partners(d)]
        reasons: list[tuple[Role, Reason]] = []
        details: list[str] = []
        prefill: Candidate | None = None
        if threshold is not None and n < threshold:
            route = RouteReason.THRESHOLD
        elif not paired:
            route = RouteReason.NO_PREFILL
        else:
            prefills = list({p.address: p for d in paired for p in self._partners(d)}.values())
            prefill, why, detail = self._pick(prefills, Role.PREFILL, prompt, affinity, now_s)
            reasons.append((Role.PREFILL, why))
            details.append(f"prefill[{detail}]")
            chosen = self._workers[(Role.PREFILL, prefill.address)]
            decodes = [d for d in paired if self._pairs_with(chosen, d)]
            route = RouteReason.ENFORCED if self.enforce_disagg else RouteReason.THRESHOLD
        decode, why, detail = self._pick(decodes, Role.DECODE, prompt, affinity, now_s)
        reasons.append((Role.DECODE, why))
        details.append(f"decode[{detail}]")
        if prefill is not None and threshold is None and not self.enforce_disagg:
            direct = direct_reason(decode, prefill, n, config)
            route = direct or RouteReason.COST
            if direct is not None:
                prefill, reasons = None, reasons[1:]
        work = round(work_tokens(prefill.hit, n, config)) if prefill is not None else 0
        decode_state = self._workers[(Role.DECODE, decode.address)]
        prefill_state = self._workers[(Role.PREFILL, prefill.address)] if prefill is not None else None
        for state in (decode_state, prefill_state):
            if state is not None and state.identity is not None and state.identity.block_size:
                identity = state.identity
                self.index.predict(state.address, identity.epoch, cache_salt_for(identity.compat_hash),
                                   identity.block_size, prompt, now_s)
        return self._count(n, decode_state, prefill_state, work, reasons, route, " ".join(details))

    def _pick(self, workers: list[WorkerState], role: Role, prompt: PromptKeys,
              affinity: tuple[str | None, str] | None, now_s: float) -> tuple[Candidate, Reason, str]:
        """The scored choice among ``workers`` of ``role`` (an available affinity worker wins): candidate,
        reason, the scores."""
        candidates = [self._candidate(w, prompt, now_s) for w in workers]
        wanted = affinity and (affinity[0] if role == Role.PREFILL else affinity[1])
        kept = next((c for c in candidates if c.address == wanted), None)
        if kept is not None:
            return kept, Reason.AFFINITY, f"{kept.address}:affinity"
        if role == Role.PREFILL:
            choice = choose_prefill(candidates, len(prompt), self.scoring)
        else:
            choice = choose_decode(candidates, len(prompt))
        best = next(c for c in candidates if c.address == choice.address)
        return best, choice.reason, choice.detail

    def _candidate(self, worker: WorkerState, prompt: PromptKeys, now_s: float) -> Candidate:
        identity = worker.identity
        assert identity is not None and self.index is not None  # available workers have answered
        hit = self.index.lookup(worker.address, identity.epoch, cache_salt_for(identity.compat_hash), prompt,
                                _full_groups(identity.compat_fields.get("kv_groups")), now_s)
        room = UNKNOWN_ROOM
        if worker.role == Role.PREFILL and identity.block_size:
            needed = -(-max(len(prompt) - hit.tokens, 0) // identity.block_size)
            room = self.index.cache_room(worker.address, identity.epoch, needed, now_s)
        return Candidate(worker.address, hit, worker.outstanding_requests, worker.queued_prefill_tokens,
                         worker.num_picks, self.index.load(worker.address, identity.epoch), identity.block_size or 0,
                         room)

    def _count(self, num_prompt_tokens: int, decode: WorkerState, prefill: WorkerState | None, work: int,
               reasons: list[tuple[Role, Reason]], route: RouteReason, detail: str) -> Assignment:
        """Count the request on its workers and describe the assignment."""
        for worker in (decode, prefill):
            if worker is not None:
                worker.outstanding_requests += 1
                worker.outstanding_tokens += num_prompt_tokens
                worker.num_picks += 1
        if prefill is not None:
            prefill.queued_prefill_tokens += work
        decode.unsent_generates += 1
        return Assignment(
            decode=decode.address,
            prefill=prefill.address if prefill else None,
            num_prompt_tokens=num_prompt_tokens,
            reader_tp_size=(decode.identity.tp_size if decode.identity else 0) or 1,
            reader_block_size=(decode.identity.block_size if decode.identity else 0) or 0,
            reader_compat_hash=decode.identity.compat_hash if decode.identity else "",
            prefill_work_tokens=work if prefill is not None else 0,
            decisions=tuple((role.value, reason.value) for role, reason in reasons),
            route_reason=route.value,
            detail=detail,
            _decode_state=decode,
            _prefill_state=prefill,
            _generate_unsent=True,
        )

    def move_decode(self, assignment: Assignment, allow_same: bool = False) -> str | None:
        """Another available decode worker for a request its decode worker gave back (a role switch's
        migration) or lost (a failover): counted there instead; its address, or None when there is none (nothing
        changes). ``allow_same``: the request's own worker will do too, if it is available again (restarted)."""
        decodes = [d for d in self._available(Role.DECODE) if allow_same or d.address != assignment.decode]
        if not decodes:
            return None
        decode = min(decodes, key=lambda w: (w.outstanding_requests, w.num_picks, w.address))
        self.finish_decode(assignment)
        decode.outstanding_requests += 1
        decode.outstanding_tokens += assignment.num_prompt_tokens
        decode.num_picks += 1
        decode.unsent_generates += 1
        assignment.decode, assignment._decode_state, assignment._generate_unsent = decode.address, decode, True
        return decode.address

    def generate_sent(self, assignment: Assignment) -> None:
        """The request's Generate is on its way to its decode worker (whose drain now sees it). Idempotent."""
        if assignment._generate_unsent and assignment._decode_state is not None:
            assignment._decode_state.unsent_generates -= 1
        assignment._generate_unsent = False

    def finish_prefill(self, assignment: Assignment) -> None:
        """The prefill worker is done with the request (answered, failed or was abandoned). Idempotent."""
        if assignment._prefill_state is not None:
            assignment._prefill_state.queued_prefill_tokens -= assignment.prefill_work_tokens
        _uncount(assignment._prefill_state, assignment.num_prompt_tokens)
        assignment._prefill_state = None

    def finish_decode(self, assignment: Assignment) -> None:
        """The decode worker is done with the request. Idempotent."""
        self.generate_sent(assignment)
        _uncount(assignment._decode_state, assignment.num_prompt_tokens)
        assignment._decode_state = None

    def finish(self, assignment: Assignment) -> None:
        self.finish_prefill(assignment)
        self.finish_decode(assignment)


@functools.lru_cache(maxsize=64)
def _full_groups(kv_groups: str | None) -> frozenset[int] | None:
    """The full-attention groups of a worker's ``kv_groups`` compat field (None: count every group)."""
    return full_attention_groups({"kv_groups": kv_groups}) if kv_groups is not None else None


def _uncount(worker: WorkerState | None, num_tokens: int) -> None:
    if worker is not None:
        worker.outstanding_requests -= 1
        worker.outstanding_tokens -= num_tokens
