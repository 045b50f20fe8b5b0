"""The host KV tier: full device blocks copied to a larger pool in host memory, loaded back on a hit.

The host pool has the device layout, only more blocks, so a host block is byte-for-byte a device
block (copies are plain block runs; a peer reads host blocks with the same planner). Blocks are
grouped in *spans* of ``factor`` consecutive host blocks, one span holding ``factor * block_size``
tokens of one KV group; spans are what is hashed, stored, evicted and looked up::

    factor 4, block size 16: span s = host blocks 4s .. 4s+3 = tokens 64s .. 64s+63

The span bookkeeping reuses the device prefix cache: ``spans`` is a ``KVCacheManager`` whose
groups have the span as block size and whose pools count spans, so a host lookup follows the
device lookup's rules (full attention: every span from token 0; a sliding window: only the spans
the first computed query can see) and eviction is its LRU over spans nobody references. It reads
the device manager's ``block_hashes``, so a request's span hashes (its chain at block size
``factor * block_size``) are computed once, whether a store or a lookup asks first. Its pools
report to the device manager's KV event log as ``KVTier.HOST`` (a span published: STORED, evicted:
REMOVED, with the span's tokens as block size).

Every block reference below is taken and dropped on the engine's thread; copies run on the
copier's thread (``copier.py``). What keeps a block from being freed or overwritten under a copy:

- store: the span is allocated (reference 1, invisible to lookups until the copy ends) and each
  device block it reads gets one more reference, so a request that finishes, is preempted or
  slides its window meanwhile only drops its own reference; the block stays used until the copy
  ends, and only then is the span published under its hash and the device references dropped.
- load: each host span read gets a reference (not evictable) and each device block written gets
  one too, so a request aborted mid-load frees its table and the blocks come back after the copy.

Sliding-window groups store a span only while all of its device blocks are still held (a span
whose first blocks slid out of the window is skipped, never stored half), and a load fills only
the blocks the first computed query can see; the blocks of the table before them stay
unpublished (``first_complete_pulled_block``), exactly as after a KV pull.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from services.engine.kv_cache.buffers import KVCache
from services.engine.kv_cache.events import KVTier
from services.engine.kv_cache.manager import KVCacheManager
from services.engine.offload.copier import BlockCopier, PlaneCopy, block_planes, block_runs
from services.engine.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _SpanStore:
    group: int
    span: int
    block_hash: bytes
    device_blocks: list[int]


@dataclass
class _Job:
    kind: str  # "store" | "load"
    num_bytes: int = 0  # what the copy moves (set by ``_submit``)
    stores: list[_SpanStore] = field(default_factory=list)
    request_id: str | None = None  # load: the request waiting for it
    host_spans: list[list[int]] = field(default_factory=list)  # load: per group, referenced spans
    device_blocks: list[list[int]] = field(default_factory=list)  # load: per group, referenced blocks


@dataclass(frozen=True)
class HostTierStats:
    num_spans: int
    spans_used: int  # referenced: being stored, loaded or pinned
    spans_cached: int  # holding a prefix, used or not
    store_queue_depth: int  # spans whose store is queued or copying
    loads_in_flight: int
    bytes_stored: int
    bytes_loaded: int
    stores_skipped: int  # spans not stored: every host span was in use


@dataclass(frozen=True)
class LoadResult:
    request_id: str
    ok: bool


class HostKVTier:
    def __init__(self, device_cache: KVCache, device_kv: KVCacheManager, num_spans: int, factor: int,
                 on_done: Callable[[], None] | None = None) -> None:
        if factor < 1:
            raise ValueError(f"the offload block factor must be >= 1, got {factor}")
        if num_spans < 1:
            raise ValueError(f"the host KV tier needs at least one span, got {num_spans}")
        if not device_kv.enable_prefix_caching:
            raise ValueError("the host KV tier needs prefix caching: it finds blocks by their hashes")
        spec = device_cache.spec
        self.factor = factor
        self.num_spans = num_spans
        # One span more than the pool: the id a sliding group's placeholder entries name (never used).
        self.layout = dataclasses.replace(spec, num_blocks=(num_spans + 1) * factor)
        pin = device_cache.device.type == "cuda"  # DMA to and from pinned memory needs no staging copy
        dtype = device_cache.buffers[0].dtype
        self.buffers = [torch.empty(b.num_bytes // spec.element_size, dtype=dtype, pin_memory=pin)
                        for b in self.layout.buffers()]
        span_groups = tuple(dataclasses.replace(g, block_size=g.block_size * factor) for g in spec.groups)
        self.spans = KVCacheManager(span_groups, [num_spans] * len(span_groups), enable_prefix_caching=True,
                                    cache_salt=device_kv.cache_salt, free_out_of_window=device_kv.free_out_of_window,
                                    block_hashes=device_kv.block_hashes, events=device_kv.events,
                                    tier=KVTier.HOST)
        self.device_kv = device_kv
        self._planes = list(zip(block_planes(spec, device_cache.buffers), block_planes(self.layout, self.buffers),
                                [b.group_id for b in spec.buffers()], strict=True))
        self._block_bytes = [spec.block_bytes(g.group_id) for g in spec.groups]
        self._copier = BlockCopier(device_cache.device, on_done)
        self._job_ids = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._loading: dict[str, int] = {}  # request id -> its load job
        self._num_spans_seen: dict[str, list[int]] = {}  # request id -> spans per group already considered
        self._pinned: dict[str, list[list[int]]] = {}  # request id -> spans per group a peer reads
        self._storing: list[set[bytes]] = [set() for _ in spec.groups]  # hashes queued or copying
        self._pending: list[_SpanStore] = []  # found this step, submitted by flush()
        self._bytes_stored = self._bytes_loaded = self._stores_skipped = 0

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def set_wakeup(self, on_done: Callable[[], None] | None) -> None:
        """Called on the copier's thread after each job (the engine thread polls on wake-up)."""
        self._copier.on_done = on_done

    def close(self) -> None:
        self._copier.close()

    # ---- store -------------------------------------------------------------------------------
    def note_computed(self, request: Request) -> None:
        """Queue a store of every span the request has newly computed in full (sent by ``flush``)."""
        if not request.block_ids:
            return
        seen = self._num_spans_seen.setdefault(request.request_id, [0] * len(self.spans.managers))
        hashes = self.spans.block_hashes.of(request)
        for g, m in enumerate(self.spans.managers):
            span_tokens, table = m.block_size, request.block_ids[g]
            block_size = self.device_kv.groups[g].block_size
            num_full = min(request.num_computed_tokens, request.num_tokens, len(table) * block_size) // span_tokens
            for i in range(seen[g], num_full):
                self._queue_store(g, hashes.at(span_tokens, i), table[i * self.factor:(i + 1) * self.factor])
            seen[g] = max(seen[g], num_full)

    def _queue_store(self, group: int, block_hash: bytes, blocks: list[int]) -> None:
        if self.device_kv.placeholder_block_id(group) in blocks:
            return  # a sliding group's span whose first blocks already left the window: never stored half
        pool = self.spans.pool(group)
        stored = pool.lookup(block_hash)
        if stored is not None:  # already here: as recently used as if it had just been stored
            pool.refresh(stored)
            return
        if block_hash in self._storing[group]:
            return
        span = pool.allocate(1)  # evicts the least recently freed span when none is fresh
        if span is None:
            self._stores_skipped += 1
            return
        self.device_kv.pool(group).touch(blocks)
        self._storing[group].add(block_hash)
        self._pending.append(_SpanStore(group, span[0], block_hash, list(blocks)))

    def flush(self) -> None:
        """Submit the spans queued since the last flush as one copy job."""
        if not self._pending:
            return
        src: dict[int, list[int]] = {}
        dst: dict[int, list[int]] = {}
        for st in self._pending:
            src.setdefault(st.group, []).extend(st.device_blocks)
            dst.setdefault(st.group, []).extend(range(st.span * self.factor, (st.span + 1) * self.factor))
        self._submit(_Job("store", stores=self._pending), src, dst, to_host=True)
        self._pending = []

    # ---- lookup and load ---------------------------------------------------------------------
    def lookup(self, request: Request) -> tuple[list[list[int]], int]:
        """Host spans per group holding the request's longest cached prefix, and its length in tokens."""
        return self.spans.get_computed_blocks(request)

    def start_load(self, request: Request, host_tables: Sequence[Sequence[int]], first_token: int,
                   last_token: int) -> None:
        """Copy tokens ``first_token .. last_token`` (block boundaries) into the request's device blocks.

        The request's tables were allocated for them (``allocate_slots(..., external_kv=True)``).
        Device entries that are placeholders, or whose span the host hit does not include (blocks
        of a sliding group before the first computed query's window), are not copied.
        """
        if request.request_id in self._loading:
            raise ValueError(f"request {request.request_id} is already loading")
        src: dict[int, list[int]] = {}
        dst: dict[int, list[int]] = {}
        spans: list[list[int]] = []
        for g, (dev_table, host_table) in enumerate(zip(request.block_ids, host_tables, strict=True)):
            bs = self.device_kv.groups[g].block_size
            dev_placeholder, host_placeholder = self.device_kv.placeholder_block_id(g), self.num_spans
            used: set[int] = set()
            for k in range(first_token // bs, last_token // bs):
                span = host_table[k // self.factor]
                if dev_table[k] == dev_placeholder or span == host_placeholder:
                    continue
                src.setdefault(g, []).append(span * self.factor + k % self.factor)
                dst.setdefault(g, []).append(dev_table[k])
                used.add(span)
            spans.append(sorted(used))
            self.spans.pool(g).touch(spans[-1])
            self.device_kv.pool(g).touch(dst.get(g, []))
        job = _Job("load", request_id=request.request_id, host_spans=spans,
                   device_blocks=[dst.get(g, []) for g in range(len(spans))])
        self._loading[request.request_id] = self._submit(job, src, dst, to_host=False)

    def _submit(self, job: _Job, src: dict[int, list[int]], dst: dict[int, list[int]], to_host: bool) -> int:
        job.num_bytes = sum(len(ids) * self._block_bytes[g] for g, ids in src.items())
        runs = {g: block_runs(src[g], dst[g]) for g in src}
        copies: list[PlaneCopy] = [
            (host, device, runs[g]) if not to_host else (device, host, runs[g])
            for device, host, g in self._planes if g in runs
        ]
        job_id = next(self._job_ids)
        self._jobs[job_id] = job
        self._copier.submit(job_id, copies)
        return job_id

    # ---- a peer reading the host tier --------------------------------------------------------
    def pin_prefix(self, request: Request, max_tokens: int) -> tuple[list[list[int]], int] | None:
        """Pin the host spans of the request's longest stored prefix (at most ``max_tokens``) for a peer.

        Returns (host block ids per group from token 0, tokens covered), or None when no span
        is stored. A span a sliding group's hit skips is named by the placeholder span's blocks
        (never read: the peer starts at the window). ``unpin`` lets them go.
        """
        if request.request_id in self._pinned:
            raise ValueError(f"request {request.request_id} already has host spans pinned")
        tables, num_tokens = self.spans.get_computed_blocks(request)
        step = self.spans.hit_granularity
        num_tokens = min(num_tokens, max_tokens - max_tokens % step)
        if num_tokens <= 0:
            return None
        pinned, block_ids = [], []
        for g, table in enumerate(tables):
            spans = table[:num_tokens // self.spans.groups[g].block_size]
            real = [s for s in spans if s != self.num_spans]
            self.spans.pool(g).touch(real)
            pinned.append(real)
            block_ids.append([s * self.factor + j for s in spans for j in range(self.factor)])
        self._pinned[request.request_id] = pinned
        return block_ids, num_tokens

    def unpin(self, request_id: str) -> None:
        for g, spans in enumerate(self._pinned.pop(request_id, [])):
            self.spans.pool(g).free(spans)

    # ---- completion --------------------------------------------------------------------------
    @property
    def has_completions(self) -> bool:
        """Whether ``poll`` has finished jobs to take in (the engine thread steps to do it)."""
        return self._copier.has_finished

    def poll(self) -> list[LoadResult]:
        """Take in finished copies: publish stored spans, drop every reference the copies held.

        Returns the loads of live requests that finished (``ok`` False: the copy failed, the request
        must compute those tokens instead).
        """
        results = []
        for job_id, error in self._copier.poll():
            job = self._jobs.pop(job_id)
            if job.kind == "store":
                self._finish_store(job, ok=error is None)
                continue
            for g, (spans, blocks) in enumerate(zip(job.host_spans, job.device_blocks, strict=True)):
                self.spans.pool(g).free(spans)
                self.device_kv.pool(g).free(blocks)
            if error is None:
                self._bytes_loaded += job.num_bytes
            if self._loading.get(job.request_id) == job_id:
                del self._loading[job.request_id]
                results.append(LoadResult(job.request_id, error is None))
        return results

    def _finish_store(self, job: _Job, ok: bool) -> None:
        if ok:  # published in prefix order (KV events report them so)
            for st in job.stores:
                self.spans.pool(st.group).cache_block(st.span, st.block_hash)
        for st in reversed(job.stores):  # tail spans freed first: they are evicted first
            pool = self.spans.pool(st.group)
            pool.free([st.span])
            self._storing[st.group].discard(st.block_hash)
            self.device_kv.pool(st.group).free(st.device_blocks)
        if ok:
            self._bytes_stored += job.num_bytes

    def forget(self, request_id: str) -> None:
        """The request left (finished, aborted, preempted): stop following it. Copies in flight
        keep their own references and finish; a load's result is then dropped."""
        self._num_spans_seen.pop(request_id, None)
        self._loading.pop(request_id, None)

    def stats(self) -> HostTierStats:
        pools = [m.pool for m in self.spans.managers]
        return HostTierStats(
            num_spans=self.num_spans * len(pools),
            spans_used=sum(p.num_used_blocks for p in pools),
            spans_cached=sum(p.num_cached_blocks for p in pools),
            store_queue_depth=sum(len(j.stores) for j in self._jobs.values()) + len(self._pending),
            loads_in_flight=sum(1 for j in self._jobs.values() if j.kind == "load"),
            bytes_stored=self._bytes_stored, bytes_loaded=self._bytes_loaded, stores_skipped=self._stores_skipped,
        )


def num_spans_for(device_layout_block_bytes: int, factor: int, num_bytes: int) -> int:
    """Spans a host budget of ``num_bytes`` holds (one span: ``factor`` blocks of every group)."""
    return num_bytes // (device_layout_block_bytes * factor)
