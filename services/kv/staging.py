"""KV staging: a request's scattered blocks gathered into one span, so its READ is a few descriptors.

NIXL pays per descriptor (~10 us each on ``cuda_ipc``, against ~0.2 ms to copy 256 MiB), and a pool
whose blocks are not adjacent costs one descriptor per block (per layer and K/V in the per-layer
layout). So each rank may register a staging area beside its KV. The owner, handing out a ticket whose
blocks lie in many runs (``worth_staging``), gathers them into its area (one kernel per layout
buffer) before the ticket leaves, and the signed ticket names where (``staged_offsets``, one per owner
rank). A reader whose layout is the owner's but for the pool size (equal TP sizes: rank r reads rank
r) reads the span with a descriptor per (buffer, plane) -- one for a cross-layer group, as the rows
merge -- into its own area and scatters it into its blocks (``scatter``), or reads straight into its
blocks when they lie in fewer runs (``plan_rows``). Any other reader ignores the staging and reads the
owner's blocks, which stay pinned as for every ticket.

What a rank stages: for each layout buffer in order, ``[planes, n, block stride]`` bytes for its
group's blocks ``staged_start .. len(ticket ids)`` (``staged_spans``), the start skipping what a
part ticket's earlier parts and a sliding window leave out. The owner frees the span when the
ticket's readers of that rank have notified (or the request is abandoned); the reader as soon as its
scatter is done.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from services.kv.layout import KVLayoutSpec
from services.kv.planner import merged_plan
from services.kv.wire import MemoryRegion

ALIGN = 256  # bytes: every staged span starts on this boundary
#: A ticket is staged when its blocks would take at least this many times the staged READ's descriptors ...
MIN_DESCRIPTOR_GAIN = 2
#: ... and its runs are small enough that their descriptors, not the copy, set the READ's time.
MAX_MEAN_RUN_BYTES = 16 << 20


class StagingArea:
    """One rank's registered staging buffer and a first-fit allocator of byte spans in it.

    ``region`` is the buffer as peers see it (registered with the rank's agent). On a GPU its gathers and
    scatters run on a side stream (``stream``: the rank's KV digest's, so a digest queued after a scatter reads
    what it wrote), never on the engine's.
    """

    def __init__(self, buffer: torch.Tensor, region: MemoryRegion, stream: torch.cuda.Stream | None = None) -> None:
        self.buffer = buffer.view(-1).view(torch.uint8)
        self.region = region
        self.capacity = self.buffer.numel()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, length), sorted, merged
        self._used: dict[int, int] = {}  # offset -> length
        on_gpu = buffer.device.type == "cuda"
        self.stream = (stream or torch.cuda.Stream(buffer.device)) if on_gpu else None

    @property
    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)

    def alloc(self, num_bytes: int) -> int | None:
        """The offset of a free span of ``num_bytes`` (rounded up to ``ALIGN``), or None when none is free."""
        size = -(-max(num_bytes, 1) // ALIGN) * ALIGN
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                self._free[i:i + 1] = [(offset + size, length - size)] if length > size else []
                self._used[offset] = size
                return offset
        return None

    def free(self, offset: int) -> None:
        """Give a span back; its neighbours merge. Freeing a span twice (or one never taken) is a KeyError."""
        size = self._used.pop(offset)
        i = bisect.bisect(self._free, (offset, 0))
        start, end = offset, offset + size
        if i < len(self._free) and self._free[i][0] == end:
            end += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == start:
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end - start))

    def run(self, fn, *args) -> None:  # noqa: ANN001 - a gather or scatter and its arguments
        """``fn(*args)`` done on return: on the side stream and waited for, or on CPU the copy itself (for a worker
        thread: a CPU copy of a span takes milliseconds)."""
        if self.stream is None:
            fn(*args)
        else:
            self.enqueue(fn, *args)
            self.wait()

    def enqueue(self, fn, *args) -> None:  # noqa: ANN001
        """``fn(*args)`` queued on the side stream (a GPU's only), not waited for: ``wait`` does."""
        with torch.cuda.stream(self.stream):
            fn(*args)

    async def settled(self) -> None:
        """Until everything queued on the side stream so far is done, the event loop serving others meanwhile."""
        if self.stream is not None:
            done = torch.cuda.Event()
            done.record(self.stream)
            while not done.query():
                await asyncio.sleep(0)

    def wait(self) -> None:
        """Until everything queued on the side stream is done (nothing to wait for on CPU)."""
        if self.stream is not None:
            self.stream.synchronize()


@dataclass(frozen=True)
class Span:
    """One layout buffer's share of a staged ticket: ``[planes, num_blocks, stride]`` bytes at ``offset``."""

    buffer_index: int
    group_id: int
    planes: int
    stride: int
    num_blocks: int
    offset: int

    @property
    def num_bytes(self) -> int:
        return self.planes * self.num_blocks * self.stride


def staged_start(layout: KVLayoutSpec, group_id: int, part_start_token: int, window_end: int) -> int:
    """The group's first staged block: past a part ticket's earlier parts, and the first its sliding window needs."""
    group = layout.groups[group_id]
    return max(group.first_needed_block(window_end), part_start_token // group.block_size)


@functools.lru_cache(maxsize=256)
def staged_spans(layout: KVLayoutSpec, counts: tuple[int, ...]) -> tuple[tuple[Span, ...], int]:
    """Where each buffer's blocks go in a rank's staged span (``counts[g]`` blocks of group g), and its bytes."""
    spans, offset = [], 0
    for b in layout.buffers():
        span = Span(b.index, b.group_id, b.num_planes, b.block_stride_bytes, counts[b.group_id], offset)
        spans.append(span)
        offset += span.num_bytes
    return tuple(spans), offset


def count_runs(ids: np.ndarray) -> int:
    """How many runs of consecutive block ids ``ids`` falls into (0 for none)."""
    return int(np.count_nonzero(np.diff(ids) != 1)) + 1 if len(ids) else 0


def worth_staging(layout: KVLayoutSpec, ids: Sequence[np.ndarray]) -> bool:
    """Whether READs of these blocks (per group, the staged ones) take enough more descriptors than their staged
    span, each small enough, for a gather to pay (a few long runs read as fast as one)."""
    direct = staged = total = 0
    for b in layout.buffers():
        runs = count_runs(ids[b.group_id])
        direct += runs * b.num_planes
        staged += b.num_planes if runs else 0
        total += len(ids[b.group_id]) * b.num_planes * b.block_stride_bytes
    return bool(direct) and direct >= MIN_DESCRIPTOR_GAIN * staged and total <= MAX_MEAN_RUN_BYTES * direct


def _element_view(t: torch.Tensor, rows: int, row_bytes: int) -> torch.Tensor:
    """Bytes as ``[rows, row_bytes]`` of the widest integer that divides a row, so a copy moves words, not bytes."""
    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % width == 0 and t.data_ptr() % width == 0:
            return t.view(dtype).view(rows, row_bytes // width)
    return t.view(rows, row_bytes)


def _views(layout: KVLayoutSpec, buffers: Sequence[torch.Tensor], area: StagingArea, offset: int, s: Span
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer's pool as ``[planes * blocks, stride]`` rows, and its share of the span at ``offset`` likewise."""
    pool = _element_view(buffers[s.buffer_index].view(-1).view(torch.uint8), s.planes * layout.num_blocks, s.stride)
    start = offset + s.offset
    return pool, _element_view(area.buffer[start:start + s.num_bytes], s.planes * s.num_blocks, s.stride)


def _rows(s: Span, ids: np.ndarray, pool_blocks: int) -> np.ndarray:
    """The pool rows of a span's rows, in order: plane p of block ``ids[i]`` is row ``p * n + i`` of the span."""
    planes = np.arange(s.planes, dtype=np.int64)[:, None]
    return (planes * pool_blocks + np.asarray(ids, dtype=np.int64)[None, :]).ravel()


def _index(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """Row numbers on the copy's device; on a GPU through pinned memory, so the upload is queued on the stream."""
    index = torch.from_numpy(rows)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index


def gather(layout: KVLayoutSpec, buffers: Sequence[torch.Tensor], area: StagingArea, offset: int,
           ids: Sequence[np.ndarray]) -> None:
    """Copy each group's blocks ``ids[g]`` (in order) from the KV buffers into the span at ``offset``: one
    ``index_select`` of whole rows per layout buffer, on the current stream. (On an H200 it beat a Triton row copy:
    2.3 against 2.6 ms for 4 GiB, and half the host time; bench/RESULTS.md.)"""
    spans, _ = staged_spans(layout, tuple(len(i) for i in ids))
    for s in spans:
        if s.num_blocks:
            pool, span = _views(layout, buffers, area, offset, s)
            pool_rows = _rows(s, ids[s.group_id], layout.num_blocks)
            torch.index_select(pool, 0, _index(pool_rows, pool.device), out=span)


def scatter(layout: KVLayoutSpec, buffers: Sequence[torch.Tensor], area: StagingArea, offset: int,
            ids: Sequence[np.ndarray]) -> None:
    """The inverse of ``gather``: the span at ``offset`` into each group's blocks ``ids[g]``."""
    spans, _ = staged_spans(layout, tuple(len(i) for i in ids))
    for s in spans:
        if s.num_blocks:
            pool, span = _views(layout, buffers, area, offset, s)
            pool_rows = _rows(s, ids[s.group_id], layout.num_blocks)
            pool.index_copy_(0, _index(pool_rows, pool.device), span)


@functools.lru_cache(maxsize=64)
def same_layout(owner: KVLayoutSpec, reader: KVLayoutSpec) -> bool:
    """Whether a staged span of ``owner`` is the reader's bytes block for block (all but the pool size equal)."""
    return dataclasses.replace(reader, num_blocks=owner.num_blocks) == owner


@dataclass(frozen=True)
class StagedRead:
    """One reading rank's READ of its owner rank's staged span: rows, and the scatter it needs after."""

    local_rows: np.ndarray
    remote_rows: np.ndarray
    num_bytes: int
    #: Set when the READ lands in this rank's own staging area: (its offset there, block ids per group).
    scatter: tuple[int, list[np.ndarray]] | None = None


def plan_rows(owner: KVLayoutSpec, owner_region: MemoryRegion, owner_offset: int, counts: tuple[int, ...],
              skip: Sequence[int], local_ids: Sequence[np.ndarray], local_num_blocks: int,
              local_regions: Sequence[MemoryRegion], area: StagingArea | None) -> StagedRead:
    """The READ of one owner rank's staged span (``counts[g]`` staged blocks per group, of which the first
    ``skip[g]`` are not read: the reader holds them or its window has left them) into blocks ``local_ids[g]`` (the
    rest). Straight into the blocks when that takes no more descriptors than the staged span's rows, or there is
    no room in ``area``; else into ``area``, to be scattered."""
    spans, _ = staged_spans(owner, counts)
    wanted = [counts[g] - skip[g] for g in range(len(counts))]
    direct_rows = sum(count_runs(local_ids[s.group_id]) * s.planes for s in spans)
    staged_rows = sum(s.planes for s in spans if wanted[s.group_id])
    local_offset = None
    if area is not None and direct_rows > staged_rows:
        local_offset = area.alloc(sum(s.planes * wanted[s.group_id] * s.stride for s in spans))
    # Runs as the planner's columns: source offsets in the owner's area (its buffer 0); destinations in this rank's
    # KV buffers, or in its area (buffer index len(local_regions)).
    cols: list[list[np.ndarray]] = [[], [], [], []]  # src offset, dst buffer, dst offset, length
    done = 0
    for s in spans:
        ids = np.asarray(local_ids[s.group_id], dtype=np.int64)
        if not len(ids):
            continue
        first_staged = owner_offset + s.offset + skip[s.group_id] * s.stride
        planes = np.arange(s.planes, dtype=np.int64)
        if local_offset is None:  # a run of consecutive local blocks per (plane, run)
            breaks = np.flatnonzero(np.diff(ids) != 1) + 1
            firsts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(ids)]])
            src = first_staged + (planes[:, None] * s.num_blocks + firsts) * s.stride
            dst = (planes[:, None] * local_num_blocks + ids[firsts]) * s.stride
            length = np.broadcast_to((ends - firsts) * s.stride, src.shape)
            buffer = s.buffer_index
        else:  # the wanted blocks of each plane, one after another in this rank's area
            n = len(ids) * s.stride
            src = first_staged + planes * s.num_blocks * s.stride
            dst = local_offset + done + planes * n
            length = np.full(s.planes, n)
            buffer, done = len(local_regions), done + s.planes * n
        for col, values in zip(cols, (src, np.full(src.shape, buffer), dst, length), strict=True):
            col.append(np.ravel(values))
    src_off, dst_buf, dst_off, length = (np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols)
    plan = merged_plan(0, [np.zeros(len(length), np.int64), src_off, dst_buf, dst_off, length])
    local_table = [(r.address, r.device_id) for r in local_regions]
    if area is not None:
        local_table.append((area.region.address, area.region.device_id))
    remote_rows, local_rows = plan.address_rows([(owner_region.address, owner_region.device_id)], local_table)
    scatter = None if local_offset is None else (local_offset, list(local_ids))
    return StagedRead(local_rows, remote_rows, plan.total_bytes, scatter)


def staged_blocks(owner: KVLayoutSpec, num_tokens: int, part_start_token: int, window_end: int,
                  starts: Mapping[int, int], local_ids: Sequence[np.ndarray]
                  ) -> tuple[tuple[int, ...], list[int], list[np.ndarray]] | None:
    """A reader's share of a staged ticket, per group: the blocks staged, how many of them it skips (it reads from
    token ``starts[g]``: its cached prefix, its window), and its own blocks for the rest; None when it needs a
    block before the staged ones."""
    counts, skip, wanted = [], [], []
    for g in owner.groups:
        first = staged_start(owner, g.group_id, part_start_token, window_end)
        used = -(-num_tokens // g.block_size)
        begin = used if starts[g.group_id] >= num_tokens else starts[g.group_id] // g.block_size
        if begin < first:
            return None
        counts.append(used - first)
        skip.append(begin - first)
        wanted.append(local_ids[g.group_id][begin:used])
    return tuple(counts), skip, wanted


def span_inside(owner: KVLayoutSpec, counts: tuple[int, ...], offset: int, region: MemoryRegion) -> bool:
    """Whether a ticket's staged span of ``counts`` blocks per group at ``offset`` lies in the owner's area."""
    return offset + staged_spans(owner, counts)[1] <= region.length


class StagingRank(Protocol):
    """What ``unstage`` and ``release_spans`` need of a reading rank (``services.kv.rank.LocalKVRank``)."""

    staging: StagingArea | None

    async def scatter(self, offset: int, block_ids: Sequence[np.ndarray]) -> None: ...


async def unstage(reads: Sequence[tuple[StagingRank, StagedRead]]) -> float:
    """Scatter what each rank's READ put into its staging area into its blocks (every rank at once; a GPU's is
    queued on the digest's stream, and ``release_spans`` waits for it); the seconds it took here."""
    started = time.perf_counter()
    scatters = [rank.scatter(*plan.scatter) for rank, plan in reads if plan.scatter is not None]
    if len(scatters) == 1:
        await scatters[0]
    elif scatters:
        await asyncio.gather(*scatters)
    return time.perf_counter() - started


def release_spans(reads: Sequence[tuple[StagingRank, StagedRead]]) -> None:
    """Free the ranks' staging spans a pull took, once their scatters are done (or the pull failed)."""
    for rank, plan in reads:
        if plan.scatter is not None and rank.staging is not None:
            rank.staging.wait()
            rank.staging.free(plan.scatter[0])
