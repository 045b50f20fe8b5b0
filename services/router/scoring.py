"""KV-aware scores: which prefill worker, which decode worker, and whether to disaggregate at all.

Prefill workers: the one holding the longest cached prefix of the prompt takes it, unless the overload
valve is open for it; among several such holders, and among all workers when no worker holds any of
the prompt or every holder is overloaded, the lowest estimated time to first token wins::

    work_tokens  = uncached + host_hit_cost * host_hit      (uncached = prompt - device_hit - host_hit)
    queued       = max(router's queued prefill work there, the engine's waiting_prefill_tokens)
    ttft_s       = (work_tokens + queued) / fleet_rate

``fleet_rate`` is one rate for every candidate: the median of the prefill rates they report (a default
until one does). Each worker's own measured rate is not used: it depends on what the worker happened
to run (short cached chunks are mostly step overhead), and routing by it feeds back: a worker that
looks fast gets the uncached prompts, holds more than its pool and evicts (measured with
``bench/routing.py``). The TTFT estimate alone is not the rule either: an idle cold worker beats a
holder as soon as the holder has a prompt queued, and the prefix is then recomputed and evicted in a
cascade. Stickiness is what keeps caches useful; the valve is what keeps it from piling load.

``host_hit_cost`` is what loading a host-tier token costs relative to computing it (default 0.25: Dynamo
weighs a host hit 0.75 of a device hit, the same thing seen from the other side). The queue takes the
larger of the router's own count (its requests, as estimated work, are known at once) and the engine's
(which also sees other router replicas' requests, a batch interval late).

Overload valve: a worker is overloaded when its queue exceeds both ``overload_queue_tokens`` (a floor,
so light load never splits a prefix) and ``overload_factor`` times the candidates' median queue. An
overloaded holder yields when yielding pays for the recompute it causes: its estimate is over
``valve_gain`` times the best colder worker's, whose estimate counts computing the whole prefix again.
Then the other workers compete on the estimate (reason ``overload_valve``), so a hot prefix spills onto
colder workers and every queue stays within about that factor of the median. Without the gain a holder
with one long cold prompt queued (a burst, not overload) would shed its prefixes, each copy evicting
another prefix somewhere (``bench/routing_sim.py``: 0.58 of the ideal against 0.90 at 256 workers).
Where a prompt goes that no available holder takes (nothing cached anywhere, or the valve open): among the
workers whose estimate is within ``room_tolerance`` prompt-computes of the lowest (so waiting behind a
little more queue is accepted, once, for a prefix that will be reused), the one with the most cache room
(``PrefixIndex.cache_room``: a pool with room for the prompt's blocks, else the one whose least recently
used blocks are oldest) takes it, reason ``cache_room`` when that is not the lowest estimate. Without it
new prefixes land on the shortest queue, some pools get more prefixes than they hold and evict each
other's in a cascade (``bench/routing_sim.py``). Ties (equal estimates and room, e.g. a cold start) go to
the fewest outstanding requests, then the least picked, so a cold start spreads.

Decode workers are scored in requests: ``max(router's outstanding, engine's running + waiting)`` plus the
share of the prompt it must pull (0 when it holds the whole prefix, 1 when none: a pull costs the worker
about one more request's worth of work); one without KV room for what it must pull is left out while
another has room.

Disaggregate or serve directly (when no ``--direct-decode-threshold`` overrides it): directly on the
chosen decode worker when its own cache (as its events confirm it: a predicted entry may be a pull still
under way, which the engine could not reuse yet) leaves at most
``direct_max_uncached_tokens`` to compute, or when the chosen prefill worker's queue alone would cost more
than computing the prompt on the decode worker, counting the stall of the requests running there::

    queue_wait_s = queued / prefill_rate          >   uncached_on_decode / decode_rate * (1 + decode_running)

An idle prefill worker never loses on the second rule: its queue wait is 0.

Each decision carries its reason (a metric label) and a one-line detail naming the scores (the debug log).
Pure: numbers in, choices out.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.router.prefix_index import UNKNOWN_ROOM, CacheHit, CacheRoom, CacheState, Load


class Reason(enum.StrEnum):
    """Why a worker was chosen (``pdserve_router_routing_decisions_total{role, reason}``)."""

    PREFIX_HIT = "prefix_hit"  # it holds the longest cached prefix and was not over the valve's bound
    LEAST_LOADED = "least_loaded"  # no better cache elsewhere (or its lower load outweighed one)
    CACHE_ROOM = "cache_room"  # nobody took it as a holder: it has the most cache room within the tolerance
    OVERLOAD_VALVE = "overload_valve"  # the worker holding the longest prefix was over the queue bound
    CACHE_UNKNOWN = "cache_unknown"  # nothing known cached anywhere, and some worker's cache is unknown
    NO_EVENTS = "no_events"  # no candidate publishes KV events: cache-blind
    AFFINITY = "affinity"  # a sibling choice kept its leader's worker
    LEAST_OUTSTANDING = "least_outstanding"  # --routing least-outstanding


class RouteReason(enum.StrEnum):
    """Why a request was disaggregated or served directly (``pdserve_router_route_decisions_total``)."""

    DECODE_CACHED = "decode_cached"  # direct: the decode worker's cache leaves few tokens to compute
    PREFILL_QUEUE = "prefill_queue"  # direct: the prefill route's estimate is worse than computing on decode
    THRESHOLD = "threshold"  # --direct-decode-threshold decided (either way)
    NO_PREFILL = "no_prefill"  # direct: no prefill worker can pair
    COST = "cost"  # disaggregated: the prefill route is estimated faster
    ENFORCED = "enforced"  # disaggregated: --enforce-disagg


@dataclass(frozen=True)
class ScoringConfig:
    host_hit_cost: float = 0.25
    overload_queue_tokens: int = 2048
    overload_factor: float = 2.0
    default_prefill_tokens_per_s: float = 4096.0
    direct_max_uncached_tokens: int = 32
    room_tolerance: float = 1.0  # prompt-computes of extra wait a cold prompt accepts for cache room
    valve_gain: float = 1.5  # an overloaded holder yields only when its estimate is this many times a colder one's

    def __post_init__(self) -> None:
        if not 0 <= self.host_hit_cost <= 1:
            raise ValueError(f"host_hit_cost must be in [0, 1], got {self.host_hit_cost}")
        if self.overload_queue_tokens < 0:
            raise ValueError(f"overload_queue_tokens must be >= 0, got {self.overload_queue_tokens}")
        if not self.overload_factor >= 1:
            raise ValueError(f"overload_factor must be >= 1, got {self.overload_factor}")
        if not self.default_prefill_tokens_per_s > 0:
            raise ValueError(f"default_prefill_tokens_per_s must be > 0, got {self.default_prefill_tokens_per_s}")
        if self.direct_max_uncached_tokens < 0:
            raise ValueError(f"direct_max_uncached_tokens must be >= 0, got {self.direct_max_uncached_tokens}")
        if not self.valve_gain >= 1:
            raise ValueError(f"valve_gain must be >= 1, got {self.valve_gain}")
        if not self.room_tolerance >= 0:
            raise ValueError(f"room_tolerance must be >= 0, got {self.room_tolerance}")


@dataclass(frozen=True)
class Candidate:
    """One worker as scoring sees it: its cache hit for the prompt, the router's counts, its engine's load."""

    address: str
    hit: CacheHit
    outstanding_requests: int = 0
    queued_prefill_tokens: int = 0  # the router's estimated prefill work outstanding there
    num_picks: int = 0
    load: Load | None = None
    block_size: int = 0  # 0: unknown
    room: CacheRoom = UNKNOWN_ROOM  # what caching the prompt there would evict (prefill candidates)


@dataclass(frozen=True)
class Choice:
    address: str
    reason: Reason
    score: float  # prefill: estimated TTFT in seconds; decode: load in requests
    detail: str  # every candidate's score, for the debug log


def prefill_ttft_s(c: Candidate, num_prompt_tokens: int, config: ScoringConfig, rate: float | None = None) -> float:
    """Estimated seconds to the first token on ``c``: its work and queue over ``rate`` (default: its own)."""
    rate = prefill_rate(c.load, config) if rate is None else rate
    return (work_tokens(c.hit, num_prompt_tokens, config) + queued_tokens(c)) / rate


def work_tokens(hit: CacheHit, num_prompt_tokens: int, config: ScoringConfig) -> float:
    """Prompt tokens the worker must compute, host-tier hits at their load cost."""
    uncached = max(num_prompt_tokens - hit.tokens, 0)
    return uncached + config.host_hit_cost * hit.host_tokens


def queued_tokens(c: Candidate) -> int:
    return max(c.queued_prefill_tokens, c.load.waiting_prefill_tokens if c.load else 0)


def prefill_rate(load: Load | None, config: ScoringConfig) -> float:
    rate = load.prefill_tokens_per_s if load is not None else 0.0
    return rate if rate > 0 else config.default_prefill_tokens_per_s


def fleet_rate(candidates: Sequence[Candidate], config: ScoringConfig) -> float:
    """The median of the prefill rates the candidates report (the default when none has): one rate for all."""
    rates = sorted(c.load.prefill_tokens_per_s for c in candidates
                   if c.load is not None and c.load.prefill_tokens_per_s > 0)
    return rates[len(rates) // 2] if rates else config.default_prefill_tokens_per_s


def overload_bound(candidates: Sequence[Candidate], config: ScoringConfig) -> float:
    """Queued tokens above which a worker is overloaded: the floor, or the factor times the median queue."""
    queues = sorted(queued_tokens(c) for c in candidates)
    return max(float(config.overload_queue_tokens), config.overload_factor * queues[len(queues) // 2])


def choose_prefill(candidates: Sequence[Candidate], num_prompt_tokens: int, config: ScoringConfig) -> Choice:
    """The longest prefix holder unless overloaded, else the lowest TTFT estimate (module docstring)."""
    if not candidates:
        raise ValueError("choose_prefill needs at least one candidate")
    rate = fleet_rate(candidates, config)
    scores = {c.address: prefill_ttft_s(c, num_prompt_tokens, config, rate) for c in candidates}
    bound = overload_bound(candidates, config)
    under = [c for c in candidates if queued_tokens(c) <= bound]
    most = max(c.hit.tokens for c in candidates)
    holders = [c for c in under if most > 0 and c.hit.tokens == most]
    if not holders and most > 0 and not _valve_pays(candidates, under, most, scores, config):
        holders = [c for c in candidates if c.hit.tokens == most]  # spilling would cost more than it saves
    if holders:
        pool, reason = holders, Reason.PREFIX_HIT
    elif most > 0:
        pool, reason = under or list(candidates), Reason.OVERLOAD_VALVE
    else:
        pool, reason = under or list(candidates), _blind_reason(candidates)
    best = min(pool, key=lambda c: (scores[c.address], c.outstanding_requests, c.num_picks, c.address))
    if reason is Reason.OVERLOAD_VALVE and best.hit.tokens == most:
        reason = Reason.PREFIX_HIT  # every worker over the bound: the holder keeps it on its estimate
    elif reason is not Reason.PREFIX_HIT:
        roomiest = _roomiest(pool, scores, best, num_prompt_tokens, rate, config)
        if roomiest is not best:
            best, reason = roomiest, Reason.CACHE_ROOM
    detail = f"rate={rate:.0f}/s bound={bound:.0f} " + " ".join(
        f"{c.address}:ttft_s={scores[c.address]:.4f},hit={c.hit.device_tokens}+{c.hit.host_tokens}h,"
        f"queued={queued_tokens(c)},room={c.room.free_blocks}/{c.room.evict_age_s:.1f}s,{c.hit.state}"
        for c in candidates)
    return Choice(best.address, reason, scores[best.address], detail)


def _valve_pays(candidates: Sequence[Candidate], under: Sequence[Candidate], most: int, scores: dict[str, float],
                config: ScoringConfig) -> bool:
    """Whether spilling from the overloaded holders saves enough: the best holder's estimate is over
    ``valve_gain`` times the best colder worker's, which recomputes the prefix (and evicts for it)."""
    if not under:
        return False
    holder = min(scores[c.address] for c in candidates if c.hit.tokens == most)
    return holder > config.valve_gain * min(scores[c.address] for c in under)


def _roomiest(pool: Sequence[Candidate], scores: dict[str, float], best: Candidate, num_prompt_tokens: int,
              rate: float, config: ScoringConfig) -> Candidate:
    """Among the workers within the tolerance of ``best``'s estimate, the one with the most cache room
    (``best`` itself unless another has strictly more)."""
    slack = config.room_tolerance * work_tokens(best.hit, num_prompt_tokens, config) / rate
    near = [c for c in pool if scores[c.address] <= scores[best.address] + slack]
    roomiest = max(near, key=lambda c: c.room.rank)
    return best if roomiest.room.rank <= best.room.rank else roomiest


def decode_load(c: Candidate, num_prompt_tokens: int) -> float:
    """Requests' worth of work: what runs there plus the share of the prompt it must pull."""
    engine = c.load.num_running + c.load.num_waiting if c.load else 0
    pull_share = max(num_prompt_tokens - c.hit.tokens, 0) / max(num_prompt_tokens, 1)
    return max(c.outstanding_requests, engine) + pull_share


def has_room(c: Candidate, num_prompt_tokens: int) -> bool:
    """Whether the worker reports KV room for the blocks it must pull or compute (unknown: yes)."""
    if c.load is None or not c.load.kv_blocks_total or c.block_size < 1:
        return True
    return c.load.kv_blocks_free >= math.ceil(max(num_prompt_tokens - c.hit.tokens, 0) / c.block_size)


def choose_decode(candidates: Sequence[Candidate], num_prompt_tokens: int) -> Choice:
    """The decode worker with the least load, counting what it must pull; only ones with KV room while any has."""
    if not candidates:
        raise ValueError("choose_decode needs at least one candidate")
    scores = {c.address: decode_load(c, num_prompt_tokens) for c in candidates}
    roomy = [c for c in candidates if has_room(c, num_prompt_tokens)] or list(candidates)
    best = min(roomy, key=lambda c: (scores[c.address], -c.hit.tokens, c.num_picks, c.address))
    most = max(c.hit.tokens for c in candidates)
    if most > 0:
        reason = Reason.PREFIX_HIT if best.hit.tokens == most else Reason.LEAST_LOADED
    else:
        reason = _blind_reason(candidates)
    detail = " ".join(f"{c.address}:load={scores[c.address]:.3f},hit={c.hit.tokens},{c.hit.state}"
                      for c in candidates)
    return Choice(best.address, reason, scores[best.address], detail)


def direct_reason(decode: Candidate, prefill: Candidate, num_prompt_tokens: int,
                  config: ScoringConfig) -> RouteReason | None:
    """Why the request should be served directly on ``decode`` rather than through ``prefill``; None:
    disaggregate (module docstring)."""
    own = CacheHit(decode.hit.confirmed_tokens, decode.hit.host_tokens, decode.hit.state, decode.hit.confirmed_tokens)
    uncached = work_tokens(own, num_prompt_tokens, config)
    if own.tokens > 0 and uncached <= config.direct_max_uncached_tokens:
        return RouteReason.DECODE_CACHED
    running = max(decode.load.num_running if decode.load else 0, decode.outstanding_requests)
    direct_s = uncached / prefill_rate(decode.load, config) * (1 + running)
    queue_wait_s = queued_tokens(prefill) / prefill_rate(prefill.load, config)
    return RouteReason.PREFILL_QUEUE if queue_wait_s > direct_s else None


def _blind_reason(candidates: Sequence[Candidate]) -> Reason:
    if all(c.hit.state is CacheState.UNSUPPORTED for c in candidates):
        return Reason.NO_EVENTS
    if any(c.hit.state is not CacheState.SYNCED for c in candidates):
        return Reason.CACHE_UNKNOWN
    return Reason.LEAST_LOADED
