"""Where the workers are and whether they answer: endpoints from flags and DNS, health from ``Info``.

Static endpoints come from ``--prefill``/``--decode``. A DNS name (``name:port``) stands for every
address it resolves to, the way a Kubernetes headless Service lists its pods; it is re-resolved
every ``dns_refresh_s``, and a failed lookup keeps the previous answer rather than dropping every
worker behind the name. Each ``health_interval_s`` every known worker is asked for its ``Info``
with a short timeout: one that answers (with the role it was listed under) is put in rotation,
one that does not is taken out until it answers again. A worker no source lists any more leaves the table at once
but keeps its channel until the requests the router sent it are done (a pod being deleted finishes
them; its SIGTERM drain waits for them on its side). The request flow also takes out a worker
whose RPC failed; the next health check decides when it comes back. A healthy worker that no
healthy worker of the other role can pair with (different model, TP that cannot shard the KV
heads, ...) is logged once, with the reasons, each time that changes.

Role switching: a worker that reports another role than the one it is listed under is refused, unless it can
switch roles (``Info.roles``): then it switched, under this router (``move``, from ``role_switch.py``) or
another, or it was restarted in its launch role, and the table lists it under the role it serves now.

Pair probes: after each health round, every compatible pair of available workers that is new, whose
either side's epoch changed, or whose probe failed ``pair_probe_retry_s`` ago, is probed (the decode
worker's ``Probe`` RPC: one real KV transfer from the prefill worker). Each probe is a task of its own,
bounded by ``pair_probe_timeout_s``: a slow probe never holds up health checks, and requests never wait
for one. Results go to the policy's probe table (``pair_probes.py``), which decides what is usable.

KV events: with KV-aware routing, after each health round every listed worker has a subscriber task
(``kv_subscriber.py``) keeping the prefix index fresh; a worker discovery drops loses its task and its
index entries in the same round.

The probes and the resolver are injected, so the state machine is tested without sockets or workers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from services.common.addresses import join_host_port, split_host_port
from services.router.pair_probes import PairProbe, ProbeOutcome
from services.router.pairing import PairingPolicy, Role, WorkerIdentity, WorkerState

log = logging.getLogger(__name__)

Probe = Callable[[Role, str], Awaitable[WorkerIdentity]]
Resolver = Callable[[str], Awaitable[list[str]]]
OnRemoved = Callable[[str], Awaitable[None]]
#: (prefill address, decode address, timeout in seconds): the decode worker's probe of that prefill worker.
PairProber = Callable[[str, str, float], Awaitable[ProbeOutcome]]


class Subscriptions(Protocol):
    """What discovery drives of the KV event subscribers (``kv_subscriber.KVSubscriptions``)."""

    def sync(self, workers: Iterable[tuple[Role, str]]) -> None: ...

    async def close(self) -> None: ...


_NO_ANSWER = "no answer within"  # a health probe that timed out (not refused, not an error)
#: How long past its own timeout a pair prober is waited for before its probe counts as failed.
PROBE_GRACE_S = 1.0


@dataclass(frozen=True)
class EndpointSource:
    """The endpoints of one role: fixed ``host:port`` addresses and DNS ``name:port`` entries."""

    role: Role
    static: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for entry in (*self.static, *self.dns):
            split_host_port(entry)  # raises ValueError naming the bad entry


async def resolve(entry: str) -> list[str]:
    """Every address ``name:port`` resolves to, as sorted ``ip:port`` targets (socket.gaierror if none)."""
    host, port = split_host_port(entry)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(sockaddr[0], port) for *_, sockaddr in infos})


class Discovery:
    """Keeps the pairing table's worker list and health current."""

    def __init__(
        self,
        policy: PairingPolicy,
        sources: Iterable[EndpointSource],
        probe: Probe,
        *,
        dns_refresh_s: float = 10.0,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 1.0,
        resolver: Resolver = resolve,
        on_removed: OnRemoved | None = None,
        clock: Callable[[], float] = time.monotonic,
        pair_prober: PairProber | None = None,
        pair_probe_timeout_s: float = 30.0,
        kv_subscriptions: Subscriptions | None = None,
        busy_timeouts_down: int = 3,
    ) -> None:
        """``on_removed`` is awaited for an address no role lists any more (to close its channel), once the
        router has no request outstanding on it.
        ``pair_prober`` probes the pairs of the policy's probe table (none without either).
        ``kv_subscriptions``: kept to the listed workers after each health round.
        ``busy_timeouts_down``: probe timeouts in a row that take out a healthy worker with requests outstanding
        (one busy with a long prefill answers late, not never); an idle one, an error or a refused connection
        takes a worker out at the first probe."""
        self._policy = policy
        self._sources = tuple(sources)
        self._probe = probe
        self._dns_refresh_s = dns_refresh_s
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._resolver = resolver
        self._on_removed = on_removed
        self._clock = clock
        self._resolved: dict[str, list[str]] = {}
        self._next_dns_at: float | None = None
        self._unpaired: dict[tuple[Role, str], str] = {}
        self._pair_prober = pair_prober
        self._pair_probe_timeout_s = pair_probe_timeout_s
        self._probe_tasks: set[asyncio.Task[None]] = set()
        self._unprobed_decodes: set[str] = set()  # decode workers logged as predating Probe
        self._kv_subscriptions = kv_subscriptions
        self._busy_timeouts_down = busy_timeouts_down
        self._late_probes: dict[tuple[Role, str], int] = {}  # busy workers' probe timeouts in a row
        # Dropped workers whose channel stays open while the router has requests outstanding on them.
        self._leaving: dict[str, list[WorkerState]] = {}
        self._listed: dict[Role, list[str]] = {role: [] for role in Role}  # the sources' addresses, by role
        self._role_of: dict[str, Role] = {}  # workers that switched roles: the role they serve now

    # ---- endpoints -------------------------------------------------------------------------------

    async def refresh_endpoints(self) -> None:
        """Re-resolve DNS entries and make the table list exactly the current endpoints."""
        listed: dict[Role, list[str]] = {role: [] for role in Role}
        for source in self._sources:
            listed[source.role] += source.static
            for entry in source.dns:
                listed[source.role] += await self._resolve(entry)
        self._listed = listed
        self._apply_listing()
        await self._close_left()
        self._next_dns_at = self._clock() + self._dns_refresh_s

    def _apply_listing(self) -> None:
        """Make the table's workers of each role the listed ones, each under the role it serves now: a worker
        that switched roles (``move``) leaves its listed role's entries for the other's."""
        by_role: dict[Role, list[str]] = {role: [] for role in Role}
        for role, addresses in self._listed.items():
            for address in addresses:
                by_role[self._role_of.get(address, role)].append(address)
        for role, addresses in by_role.items():
            before = {w.address: w for w in self._policy.workers(role)}
            added, gone = self._policy.set_addresses(role, addresses)
            if added or gone:
                log.info("%s workers: +%s -%s", role, added, gone)
            for address in gone:
                self._leaving.setdefault(address, []).append(before[address])

    def move(self, address: str, role: Role) -> None:
        """The worker at ``address`` serves ``role`` now (it switched in place): list it there from now on, as a
        new, not yet healthy entry (the next health check, or the caller, marks it)."""
        self._role_of[address] = role
        self._apply_listing()

    async def _close_left(self) -> None:
        """Close the channel of each worker no role lists any more once the router has nothing outstanding on
        it: a worker that leaves the DNS answers (its pod is being deleted: scaled down, rolled) first
        finishes what it was sent; one listed again keeps its channel."""
        listed = {w.address for w in self._policy.workers()}
        for address in sorted(self._leaving):
            states = self._leaving[address]
            if address in listed:
                del self._leaving[address]
            elif not any(state.outstanding_requests for state in states):
                del self._leaving[address]
                if self._on_removed is not None:
                    await self._on_removed(address)

    async def _resolve(self, entry: str) -> list[str]:
        try:
            self._resolved[entry] = await self._resolver(entry)
        except OSError as exc:  # socket.gaierror and friends
            log.warning("DNS lookup of %s failed (%s); keeping %s", entry, exc, self._resolved.get(entry, []))
        return self._resolved.get(entry, [])

    # ---- health ----------------------------------------------------------------------------------

    async def check_health(self) -> None:
        """Probe every known worker at once; mark each healthy or not by its answer."""
        workers = self._policy.workers()
        results = await asyncio.gather(*(self._check(w.role, w.address) for w in workers))
        moved = []
        for worker, (identity, error) in zip(workers, results, strict=True):
            was_healthy = worker.healthy
            if identity is not None and identity.role != worker.role:
                if identity.switchable and identity.role in tuple(Role):
                    moved.append((worker, identity))  # it switched roles (under another router, or restarted)
                    continue
                identity, error = None, f"listed as {worker.role} but reports role {identity.role!r}"
            if identity is None and self._only_late(worker, error):
                continue
            self._late_probes.pop((worker.role, worker.address), None)
            if identity is not None:
                self._policy.mark_healthy(worker.role, worker.address, identity)
                if not was_healthy:
                    log.info("%s worker %s is up (engine %s)", worker.role, worker.address, identity.engine_id)
            else:
                self._policy.mark_unhealthy(worker.role, worker.address, error)
                if was_healthy:
                    log.warning("%s worker %s is down: %s", worker.role, worker.address, error)
        for worker, identity in moved:
            log.info("%s worker %s serves the %s role now (engine %s, epoch %d)", worker.role, worker.address,
                     identity.role, identity.engine_id, identity.epoch)
            self.move(worker.address, Role(identity.role))
            self._policy.mark_healthy(Role(identity.role), worker.address, identity)
        self._log_unpaired()
        self.probe_pairs()
        if self._kv_subscriptions is not None:
            self._kv_subscriptions.sync((w.role, w.address) for w in self._policy.workers())

    def _only_late(self, worker: WorkerState, error: str) -> bool:
        """Whether a failed probe leaves the worker in: it timed out, the worker is healthy and busy, and fewer
        than ``busy_timeouts_down`` probes in a row did."""
        if not (worker.healthy and worker.outstanding_requests and error.startswith(_NO_ANSWER)):
            return False
        key = (worker.role, worker.address)
        late = self._late_probes[key] = self._late_probes.get(key, 0) + 1
        if late >= self._busy_timeouts_down:
            return False
        log.info("%s worker %s answered no probe within %g s (%d requests outstanding): kept in (%d of %d)",
                 worker.role, worker.address, self._health_timeout_s, worker.outstanding_requests, late,
                 self._busy_timeouts_down)
        return True

    def _log_unpaired(self) -> None:
        """Warn when a worker becomes unpairable (or its reasons change); note when it pairs again."""
        now: dict[tuple[Role, str], str] = {}
        for worker in self._policy.workers():
            reason = self._policy.unpaired_reason(worker)
            if reason is not None:
                now[(worker.role, worker.address)] = reason
        for (role, address), reason in now.items():
            if self._unpaired.get((role, address)) != reason:
                log.warning("%s worker %s cannot pair with any healthy worker: %s", role, address, reason)
        for role, address in sorted(self._unpaired.keys() - now.keys()):
            worker = self._policy.get(role, address)
            if worker is not None and self._policy.partners(worker):
                log.info("%s worker %s can pair again", role, address)
        self._unpaired = now

    async def _check(self, role: Role, address: str) -> tuple[WorkerIdentity | None, str]:
        try:
            identity = await asyncio.wait_for(self._probe(role, address), self._health_timeout_s)
        except TimeoutError:
            return None, f"{_NO_ANSWER} {self._health_timeout_s:g} s"
        except Exception as exc:  # any failure of the probe means "not healthy", never a crash of the loop
            return None, f"{type(exc).__name__}: {exc}"
        return identity, ""  # another role than listed: check_health decides (a switchable worker moves)

    # ---- pair probes -----------------------------------------------------------------------------

    def probe_pairs(self) -> None:
        """Bring the probe table up to the current pairs and start a probe for each one that is due."""
        table = self._policy.probes
        if table is None or self._pair_prober is None:
            return
        table.sync(self._policy.compatible_pairs())
        for entry in table.due(self._clock()):
            table.start(entry)
            task = asyncio.create_task(self._run_pair_probe(entry),
                                       name=f"pdserve-pair-probe-{entry.prefill}-{entry.decode}")
            self._probe_tasks.add(task)
            task.add_done_callback(self._probe_tasks.discard)

    async def _run_pair_probe(self, entry: PairProbe) -> None:
        """One probe, bounded; its outcome recorded (a crash of the prober is a failed probe)."""
        timeout_s = self._pair_probe_timeout_s
        try:
            # The prober's own deadline is timeout_s (its answer says more); this one guards against one that
            # ignores it.
            outcome = await asyncio.wait_for(self._pair_prober(entry.prefill, entry.decode, timeout_s),
                                             timeout_s + PROBE_GRACE_S)
        except TimeoutError:
            outcome = ProbeOutcome(False, f"no answer within {timeout_s:g} s")
        except Exception as exc:  # any failure is the pair's failed probe, never a crash of discovery
            outcome = ProbeOutcome(False, f"{type(exc).__name__}: {exc}")
        table = self._policy.probes
        if table is None or not table.record(entry, outcome, self._clock()):
            return
        pair = f"prefill {entry.prefill} -> decode {entry.decode}"
        if outcome.unprobed:
            if entry.decode not in self._unprobed_decodes:
                self._unprobed_decodes.add(entry.decode)
                log.warning("decode worker %s predates the Probe RPC: its pairs are used without a KV probe",
                            entry.decode)
        elif outcome.ok:
            log.info("KV probe %s: ok (prefill engine %s epoch %d, %.3f s)", pair, outcome.prefill_engine_id,
                     outcome.prefill_epoch, outcome.seconds)
        else:
            log.warning("KV probe %s failed, pair not used; again in %g s: %s", pair, table.retry_after_s,
                        outcome.reason)

    async def wait_for_probes(self, timeout_s: float | None = None) -> bool:
        """Wait until no probe is under way (at most ``timeout_s``); whether none is."""
        tasks = set(self._probe_tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return all(task.done() for task in tasks)

    async def close(self) -> None:
        """Cancel the probes and KV event subscriptions under way (the app is shutting down)."""
        if self._kv_subscriptions is not None:
            await self._kv_subscriptions.close()
        tasks = set(self._probe_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- the loop --------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """One round: endpoints when due (always the first time), then health (which starts due pair probes)."""
        if self._next_dns_at is None or self._clock() >= self._next_dns_at:
            await self.refresh_endpoints()
        else:
            await self._close_left()
        await self.check_health()

    async def run(self) -> None:
        """After the first round (the caller's), refresh every interval until cancelled.

        A failing round is logged and the next one tried.
        """
        while True:
            await asyncio.sleep(self._health_interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("discovery round failed")
