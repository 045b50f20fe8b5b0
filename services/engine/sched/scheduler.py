"""Continuous batching: which requests run this step, and how many tokens each.

One token budget per step, spent on running requests first (a decode needs 1 token, an
unfinished prefill its next chunk), then on waiting requests in arrival order. No torch here;
the model runner reads the ``ScheduledChunk`` values and the requests' block tables.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.engine.kv_cache.manager import KVCacheManager
from services.engine.request import Request, RequestStatus
from services.engine.sched.pulls import Pulls
from services.engine.sched.scheduler_output import (
    PLACEHOLDER_TOKEN,
    PrefixCacheStats,
    ScheduledChunk,
    SchedulerOutput,
    check_sample,
)

if TYPE_CHECKING:
    from services.engine.offload import HostKVTier


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batch-shape limits, fixed for the engine's lifetime (runtime facts live in the Scheduler)."""

    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget per step
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # cap on one request's tokens per step

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not isinstance(threshold, int) or isinstance(threshold, bool)
                                      or threshold < 1):
            raise ValueError(f"long_prefill_token_threshold must be None or >= 1, got {threshold!r}")
        if not self.enable_chunked_prefill:
            if threshold is not None:
                raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill")
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                    f">= max_model_len ({self.max_model_len}), or long prompts could never be scheduled")

    @property
    def max_step_tokens(self) -> int:
        """Most tokens one request computes in one step (a sliding KV group holds its window plus these)."""
        if self.long_prefill_token_threshold is None:
            return self.max_num_batched_tokens
        return min(self.max_num_batched_tokens, self.long_prefill_token_threshold)


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix caching and preemption by recompute.

    Requests live in six containers; a request's status says which (``_requests`` holds every
    live one besides)::

        status                      container          how it gets there -> how it leaves
        WAITING                     _waiting           add_request; a failed pull or host load (in
                                                       arrival order) -> admitted: RUNNING
        PREEMPTED                   _waiting (front)   preempted -> admitted again: RUNNING
        WAITING_FOR_KV              pulls              pulls.allocate -> pulls.complete (RUNNING)
                                                       or pulls.fail (WAITING)
        LOADING_KV                  _loading           host-tier hit at admission -> the copy's
                                                       end: RUNNING, or WAITING if it failed
        RUNNING                     _running           admitted -> preempted, or finished
        FINISHED_* (held)           _held only         finished with hold_kv_on_finish -> release_held
        FINISHED_* (otherwise)      none               blocks freed at once

    ``_requests`` (every live request) is the sixth; a held request is no longer in it, so its id
    may not be reused until ``release_held``. Ids only: ``_arrival`` (FCFS order), ``_host_load_failed``
    (never loaded again) and ``_finished_ids`` (reported by the next ``schedule``).
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 host_tier: HostKVTier | None = None) -> None:
        if not kv_manager.can_ever_fit(config.max_model_len, config.max_step_tokens):
            raise ValueError(f"the KV pool cannot hold one request of max_model_len={config.max_model_len} "
                             "tokens; lower max_model_len or add blocks")
        self.config = config
        self.kv = kv_manager
        self.host_tier = host_tier
        self.prefix_stats = PrefixCacheStats()
        self._requests: dict[str, Request] = {}  # every live (unfinished) request
        self._arrival: dict[str, int] = {}  # request id -> arrival sequence number
        self._next_arrival = 0
        self._waiting: deque[Request] = deque()  # WAITING and PREEMPTED, front first
        self._running: list[Request] = []  # sorted by arrival: the newest is last
        self.pulls = Pulls(self, kv_manager, host_tier)  # WAITING_FOR_KV, and quarantined pulls' blocks
        self._loading: dict[str, tuple[Request, int]] = {}  # loading from the host tier, up to that many tokens
        self._host_load_failed: set[str] = set()  # computed instead, never loaded again
        self._held: dict[str, Request] = {}  # finished, blocks kept for a pull
        self._finished_ids: list[str] = []

    # ---- introspection -----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.pulls)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_prefill_tokens_pending(self) -> int:
        """Prompt tokens admitted here but not computed yet: waiting requests whole (a preempted one
        recomputes its output too), running ones' rest of the prompt. KV being pulled or loaded is not."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self._waiting)
        return waiting + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """A live request, or a finished one whose blocks are still held."""
        return self._requests.get(request_id) or self._held.get(request_id)

    # ---- admission ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue."""
        self.check_new(request)
        self._register(request)
        self._waiting.append(request)

    def _register(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._arrival[request.request_id] = self._next_arrival
        self._next_arrival += 1

    # ---- the request book of the pulls (``pulls.RequestBook``), and of the scheduler itself --------------

    def check_new(self, request: Request) -> None:
        """Raise ValueError for a request that is not new, or could never run here."""
        rid = request.request_id
        if rid in self._requests or rid in self._held:
            raise ValueError(f"duplicate request id {rid!r}")
        if (request.status is not RequestStatus.WAITING or request.num_computed_tokens
                or request.block_ids or request.output_token_ids):
            raise ValueError(f"request {rid!r} is not new (status {request.status.value}, "
                             f"{request.num_computed_tokens} computed tokens)")
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if not self.kv.can_ever_fit(request.num_tokens, self.config.max_step_tokens):
            raise ValueError(f"request {rid!r}: prompt of {request.num_tokens} tokens does not fit "
                             "in the whole KV pool")
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {request.num_tokens} tokens leaves no room "
                             f"below max_model_len={self.config.max_model_len}")

    def has_free_seat(self) -> bool:
        # Requests pulling or loading KV have a seat reserved: they run when their blocks are filled.
        return len(self._running) + len(self.pulls) + len(self._loading) < self.config.max_num_seqs

    def register_pulled(self, request: Request, num_device_hit: int) -> None:
        """A pull's blocks are reserved: the request is live, its device lookup counted (the host tier is not
        asked for a prompt whose KV is pulled)."""
        self._register(request)
        self._count_lookup(request, num_device_hit, None)

    def start_running(self, request: Request) -> None:
        """Into the batch, kept in arrival order (preemption takes the newest)."""
        request.status = RequestStatus.RUNNING
        bisect.insort(self._running, request, key=self._arrival_of)

    def requeue(self, request: Request) -> None:
        """Back to WAITING (its KV failed to arrive, or to load), among the waiting ones in arrival order."""
        request.status = RequestStatus.WAITING
        arrival = self._arrival_of(request)
        position = next((i for i, r in enumerate(self._waiting) if self._arrival_of(r) > arrival),
                        len(self._waiting))
        self._waiting.insert(position, request)

    def retire(self, request: Request) -> None:
        """Out of every container and the host tier's pending stores, reported by the next ``schedule``; the
        caller decides its blocks and its finished status."""
        self._remove(request)
        self._forget_offload(request.request_id)
        self._finished_ids.append(request.request_id)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Spend one step's token budget: running requests first, then waiting ones in order.

        A step that had to preempt admits nobody new: the freed blocks go to the survivors.
        """
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        self.take_finished_loads()
        budget = self._schedule_running(self.config.max_num_batched_tokens, chunks, preempted)
        if not preempted:
            self._schedule_waiting(budget, chunks)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(chunks=tuple(chunks), preempted_request_ids=tuple(preempted),
                               finished_request_ids=finished,
                               num_batched_tokens=sum(c.num_tokens for c in chunks))

    def _schedule_running(self, budget: int, chunks: list[ScheduledChunk], preempted: list[str]) -> int:
        # Oldest first. The preemption victim is always the last entry, which is either the
        # request being scheduled or one not reached yet: nothing scheduled here is taken back.
        i = 0
        while i < len(self._running) and budget > 0:
            request = self._running[i]
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                i += 1  # its last token is in a step in flight: it finishes when that step resolves
                continue
            num_tokens = self._num_tokens_to_schedule(request, request.num_computed_tokens, budget)
            num_tokens = request.leave_final_chunk(num_tokens)
            if not num_tokens:
                i += 1
                continue
            if not self._allocate_or_preempt(request, num_tokens, preempted):
                break  # the request preempted itself; it was the last one
            chunks.append(_chunk(request, num_tokens))
            budget -= num_tokens
            i += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_tokens: int, preempted: list[str]) -> bool:
        """Get blocks for ``request``, preempting the newest running requests until they fit.

        The allocation first gives back the request's sliding-window blocks its next query cannot
        see, and counts them as free: only blocks really needed decide a preemption.
        """
        while self.kv.allocate_slots(request, num_tokens) is None:
            victim = self._running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free the blocks and requeue at the front; the tokens so far are recomputed later."""
        self.kv.free(request)
        self._forget_offload(request.request_id)
        _drop_placeholders(request)  # a token of a step in flight: recomputed with the rest
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._waiting.appendleft(request)

    def _schedule_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> None:
        # Head of line: a request that cannot start now blocks the ones behind it (FCFS).
        while self._waiting and budget > 0 and self.has_free_seat():
            request = self._waiting[0]
            computed, num_hit = self.kv.get_computed_blocks(request)
            if self.host_tier is not None and request.request_id not in self._host_load_failed:
                host_tables, num_host_hit = self.host_tier.lookup(request)
                if num_host_hit > num_hit:
                    if not self._start_load(request, computed, num_hit, host_tables, num_host_hit):
                        return
                    continue
            num_tokens = self._num_tokens_to_schedule(request, num_hit, budget)
            if not num_tokens or self.kv.allocate_slots(request, num_tokens, computed) is None:
                return
            self._waiting.popleft()
            self._count_lookup(request, num_hit, 0)
            self._admit(request, num_hit)
            chunks.append(_chunk(request, num_tokens))
            budget -= num_tokens

    def _count_lookup(self, request: Request, num_device_hit: int, num_host_hit: int | None) -> None:
        """Count an admitted request's prefix lookup (``num_host_hit``: tokens past the device hit;
        None: the host tier was not asked, as for a prompt whose KV is pulled)."""
        stats = self.prefix_stats
        stats.device_hits += bool(num_device_hit)
        stats.device_misses += not num_device_hit
        stats.device_hit_tokens += num_device_hit
        if self.host_tier is not None and num_host_hit is not None:
            stats.host_hits += bool(num_host_hit)
            stats.host_misses += not num_host_hit
            stats.host_hit_tokens += num_host_hit
        if request.num_preemptions == 0 and num_host_hit is not None:
            request.num_host_cached_tokens = num_host_hit

    def _start_load(self, request: Request, computed: list[list[int]], num_hit: int,
                    host_tables: list[list[int]], num_host_hit: int) -> bool:
        """Take the head waiting request into LOADING_KV: blocks for its host hit, and the copy started.

        The tokens past the device hit get blocks as for a pull (``external_kv``: a sliding group
        keeps the window the hit's end needs); False, changing nothing, when they do not fit now.
        """
        if self.kv.allocate_slots(request, num_host_hit - num_hit, computed, external_kv=True) is None:
            return False
        self._waiting.popleft()
        self._count_lookup(request, num_hit, num_host_hit - num_hit)
        request.num_computed_tokens = num_hit
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_host_hit
        request.status = RequestStatus.LOADING_KV
        self._loading[request.request_id] = (request, num_host_hit)
        self.host_tier.start_load(request, host_tables, num_hit, num_host_hit)
        return True

    def take_finished_loads(self) -> None:
        """Requests whose host-tier load finished run from its end; a failed load computes instead."""
        if self.host_tier is None:
            return
        for result in self.host_tier.poll():
            request, num_tokens = self._loading.pop(result.request_id)
            if result.ok:
                request.num_computed_tokens = num_tokens
                self.kv.cache_full_blocks(request, num_tokens)
                self.start_running(request)
            else:
                self.kv.free(request)
                self._host_load_failed.add(request.request_id)
                request.num_computed_tokens = request.num_cached_tokens = request.num_host_cached_tokens = 0
                self.requeue(request)

    def _forget_offload(self, request_id: str) -> None:
        if self.host_tier is not None:
            self.host_tier.forget(request_id)

    def _admit(self, request: Request, num_hit: int) -> None:
        request.num_computed_tokens = num_hit
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit
        self.start_running(request)

    def _arrival_of(self, request: Request) -> int:
        return self._arrival[request.request_id]

    def _num_tokens_to_schedule(self, request: Request, start: int, budget: int) -> int:
        """Tokens to run from ``start`` this step: what is left, cut by the budget and the caps.

        0 means "not this step" (no chunking allowed and the rest does not fit).
        """
        remaining = request.num_tokens - start
        num_tokens = min(remaining, budget, self.config.max_model_len - start)
        if self.config.long_prefill_token_threshold is not None:
            num_tokens = min(num_tokens, self.config.long_prefill_token_threshold)
        if num_tokens < remaining and not self.config.enable_chunked_prefill:
            return 0
        return max(num_tokens, 0)

    # ---- results -----------------------------------------------------------------------------

    def advance(self, output: SchedulerOutput) -> None:
        """Count a launched step's chunks as computed before their results are known.

        A chunk that samples appends ``PLACEHOLDER_TOKEN``, so the next step can be scheduled (its
        chunk is that token, which the model runner takes from the device) while this one runs;
        ``resolve`` puts the real token in its place. Requests finished, aborted or preempted
        since ``schedule`` are skipped.
        """
        for c in output.chunks:
            if self._is_current(c):
                c.request.num_computed_tokens += c.num_tokens
                if c.samples:
                    c.request.output_token_ids.append(PLACEHOLDER_TOKEN)

    def resolve(self, output: SchedulerOutput, sampled: Mapping[str, tuple[int, float | None]]) -> list[Request]:
        """An advanced step's results: its sampled tokens replace the placeholders, its full blocks are
        published. Returns the requests that got a token (the engine checks their stop conditions)."""
        live = [c for c in output.chunks if self._is_advanced(c)]
        for c in live:
            if c.samples:
                check_sample(c.request.request_id, sampled.get(c.request.request_id))
        updated = []
        for c in live:
            request = c.request
            if c.samples:
                token_id, logprob = sampled[request.request_id]
                request.output_token_ids[-1] = token_id
                if logprob is not None:
                    request.output_logprobs.append(logprob)
                updated.append(request)
            self.kv.cache_full_blocks(request, request.num_computed_tokens)
            if self.host_tier is not None:
                self.host_tier.note_computed(request)
        if self.host_tier is not None:
            self.host_tier.flush()
        return updated

    def _is_current(self, chunk: ScheduledChunk) -> bool:
        request = chunk.request
        return (self._requests.get(request.request_id) is request
                and request.status is RequestStatus.RUNNING
                and request.num_computed_tokens == chunk.start)

    def _is_advanced(self, chunk: ScheduledChunk) -> bool:
        """``advance`` counted this chunk and nothing has happened to its request since."""
        request = chunk.request
        return (self._requests.get(request.request_id) is request
                and request.status is RequestStatus.RUNNING
                and request.num_computed_tokens == chunk.start + chunk.num_tokens
                and (not chunk.samples or request.output_token_ids[-1] == PLACEHOLDER_TOKEN))

    def drop_stale_chunks(self, output: SchedulerOutput) -> SchedulerOutput:
        """The output without chunks whose requests finished or were aborted since ``schedule``."""
        chunks = tuple(c for c in output.chunks if self._is_current(c))
        if len(chunks) == len(output.chunks):
            return output
        return dataclasses.replace(output, chunks=chunks, num_batched_tokens=sum(c.num_tokens for c in chunks))

    # ---- finishing ---------------------------------------------------------------------------

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Retire a live request: free its blocks, or hold them if it asked (and ran to the end)."""
        if not status.finished:
            raise ValueError(f"{status.value} is not a finished status")
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown request id {request_id!r}")
        hold = (request.hold_kv_on_finish and status is not RequestStatus.FINISHED_ABORTED
                and request.status is RequestStatus.RUNNING)
        self.retire(request)
        if hold:
            if self.host_tier is not None and request.num_host_cached_tokens:
                request.host_prefix = self.host_tier.pin_prefix(request, request.num_cached_tokens)
            self.kv.hold(request, request.host_prefix[1] if request.host_prefix else 0)
            self._held[request_id] = request
        else:
            self.kv.free(request)
        request.status = status

    def _remove(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_KV:
            self.pulls.drop(request.request_id)
        elif request.status is RequestStatus.LOADING_KV:
            del self._loading[request.request_id]  # the copy keeps its own block references
        else:
            self._waiting.remove(request)
        del self._requests[request.request_id]
        del self._arrival[request.request_id]
        self._host_load_failed.discard(request.request_id)

    def abort_request(self, request_id: str) -> bool:
        """Abort a live request in any state, freeing its blocks; False if it is not live.

        A finished request whose blocks are held is not live: ``release_held`` frees those.
        """
        if request_id not in self._requests:
            return False
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return True

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished request kept for a pull, and those its part tickets pinned
        (``pin_computed``); False if none are held."""
        parts = self.kv.release(kv_parts_key(request_id))
        request = self._held.pop(request_id, None)
        if request is None:
            return parts
        self.kv.release(request_id)
        if request.host_prefix is not None:
            self.host_tier.unpin(request_id)
        request.block_ids, request.state_slot = [], None
        return True

    def pin_computed(self, request_id: str, start: int, end: int, window_end: int) -> list[list[int]] | None:
        """Pin a running request's blocks of tokens ``start .. end`` (block boundaries in every group) for a
        part ticket, under ``kv_parts_key`` until ``release_held``; its tables from token 0 to ``end``
        (placeholders included). A sliding group pins only the blocks the window of a ``window_end``-token
        prompt reads. None (nothing pinned) when the request is not running with those tokens computed (it
        finished, or was preempted and recomputes them)."""
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING or request.num_computed_tokens < end:
            return None
        tables, pins = [], []
        for spec, table in zip(self.kv.groups, request.block_ids, strict=True):
            if start % spec.block_size or end % spec.block_size:
                raise ValueError(f"a part of tokens {start}..{end} is not on {spec.label}'s block boundaries")
            last = end // spec.block_size
            pins.append(table[max(start // spec.block_size, spec.first_needed_block(window_end)):last])
            tables.append(list(table[:last]))
        self.kv.pin(kv_parts_key(request_id), pins)
        return tables


def kv_parts_key(request_id: str) -> str:
    """The key a request's part-ticket pins are held under (never a request id: ids have no NUL)."""
    return f"{request_id}\0kv-parts"


def _chunk(request: Request, num_tokens: int) -> ScheduledChunk:
    start = request.num_computed_tokens
    return ScheduledChunk(request, start, num_tokens, samples=start + num_tokens == request.num_tokens)


def _drop_placeholders(request: Request) -> None:
    while request.output_token_ids and request.output_token_ids[-1] == PLACEHOLDER_TOKEN:
        request.output_token_ids.pop()

