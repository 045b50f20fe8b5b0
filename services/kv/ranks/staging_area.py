"""A rank's staging area and the copies in and out of it: :class:`StagingArea` (the registered buffer, its
span allocator, a side CUDA stream), ``gather``/``scatter`` between a pool and a span (one kernel per layout
buffer), and the reader's ``unstage``/``release_spans``. What goes where is planned in
``services.kv.plan.staging``. The owner frees a span when the ticket's readers of that rank have notified (or the
request is abandoned); the reader as soon as its scatter is done.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from services.kv.plan.staging import (
    ALIGN,
    Span,
    SpanDtype,
    StagedRead,
    staged_spans,
)
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.wire import MemoryRegion


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


class StagingRank(Protocol):
    """What ``unstage`` and ``release_spans`` need of a reading rank (``services.kv.ranks.kv_rank.LocalKVRank``)."""

    staging: StagingArea | None

    async def scatter(self, offset: int, block_ids: Sequence[np.ndarray], convert: SpanDtype | None = None
                      ) -> None: ...


async def unstage(reads: Sequence[tuple[StagingRank, StagedRead]]) -> float:
    """Scatter what each rank's READ put into its staging area into its blocks (every rank at once; a GPU's is
    queued on the digest's stream, and ``release_spans`` waits for it); the seconds it took here."""
    started = time.perf_counter()
    scatters = [rank.scatter(*plan.scatter, **({"convert": plan.convert} if plan.convert else {}))
                for rank, plan in reads if plan.scatter is not None]
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
