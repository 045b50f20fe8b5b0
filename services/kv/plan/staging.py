"""KV staging plans: a request's scattered blocks gathered into one span, so its READ is a few descriptors.

NIXL pays per descriptor (~10 us each on ``cuda_ipc``, against ~0.2 ms to copy 256 MiB), and a pool whose blocks
are not adjacent costs one descriptor per block (per layer and K/V in the per-layer layout). So each rank may
register a staging area beside its KV (``services.kv.ranks.staging_area``). The owner, handing out a ticket whose
blocks lie in many runs (``worth_staging``), gathers them into its area before the ticket leaves, and the signed
ticket names where (``staged_offsets``, one per owner rank). A reader whose layout is the owner's but for the pool
size (``same_layout``: equal TP sizes, rank r reads rank r) reads the span with a descriptor per (buffer, plane)
-- one for a cross-layer group, as the rows merge -- into its own area and scatters it into its blocks, or reads
straight into its blocks when they lie in fewer runs (``plan_rows``). Any other reader ignores the staging and
reads the owner's blocks, which stay pinned as for every ticket.

A pair whose KV dtypes differ by FP8 quantization (``services.kv.spec.kv_convert``) always goes through staging,
and one side converts there (``SpanDtype``: the span's FP8 dtype and scales): the owner's span is laid out as its
layout in the reader's dtype (``same_layout(..., dtype=)``), and a reader that dequantizes always reads into its
area (``plan_rows(into_area=True)``).

What a rank stages: for each layout buffer in order, ``[planes, n, block stride]`` bytes for its group's blocks
``staged_start .. len(ticket ids)`` (``staged_spans``), the start skipping what a part ticket's earlier parts and
a sliding window leave out. This module is the arithmetic only (no torch).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from services.kv.plan.planner import merged_plan
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.wire import MemoryRegion

ALIGN = 256  # bytes: every staged span starts on this boundary


#: A ticket is staged when its blocks would take at least this many times the staged READ's descriptors ...
MIN_DESCRIPTOR_GAIN = 2


#: ... and its runs are small enough that their descriptors, not the copy, set the READ's time.
MAX_MEAN_RUN_BYTES = 16 << 20


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


@functools.lru_cache(maxsize=64)
def same_layout(owner: KVLayoutSpec, reader: KVLayoutSpec, dtype: str | None = None) -> bool:
    """Whether a staged span of ``owner`` is the reader's bytes block for block (all but the pool size equal);
    ``dtype``: the span's dtype when a converting pair's side changes it (both layouts are compared in it)."""
    if dtype is not None:
        owner, reader = (dataclasses.replace(x, dtype=dtype) for x in (owner, reader))
    return dataclasses.replace(reader, num_blocks=owner.num_blocks) == owner


@dataclass(frozen=True)
class SpanDtype:
    """What a converting pair's staged span holds: ``dtype`` (FP8) bytes, each layer's K and V divided by its
    ``scales`` (layer -> (k_scale, v_scale)); the blocks on the converting side hold the values."""

    dtype: str
    scales: Mapping[int, tuple[float, float]] = dataclasses.field(hash=False)


@dataclass(frozen=True)
class StagedRead:
    """One reading rank's READ of its owner rank's staged span: rows, and the scatter it needs after."""

    local_rows: np.ndarray
    remote_rows: np.ndarray
    num_bytes: int
    #: Set when the READ lands in this rank's own staging area: (its offset there, block ids per group).
    scatter: tuple[int, list[np.ndarray]] | None = None
    #: A dequantizing reader's: the span's dtype and scales, converted in the scatter.
    convert: SpanDtype | None = None


class SpanArea(Protocol):
    """What ``plan_rows`` needs of the reader's staging area (``services.kv.ranks.staging_area.StagingArea``)."""

    region: MemoryRegion

    def alloc(self, num_bytes: int) -> int | None: ...


def plan_rows(owner: KVLayoutSpec, owner_region: MemoryRegion, owner_offset: int, counts: tuple[int, ...],
              skip: Sequence[int], local_ids: Sequence[np.ndarray], local_num_blocks: int,
              local_regions: Sequence[MemoryRegion], area: SpanArea | None, convert: SpanDtype | None = None
              ) -> StagedRead | None:
    """The READ of one owner rank's staged span (``counts[g]`` staged blocks per group, of which the first
    ``skip[g]`` are not read: the reader holds them or its window has left them) into blocks ``local_ids[g]`` (the
    rest). Straight into the blocks when that takes no more descriptors than the staged span's rows, or there is
    no room in ``area``; else into ``area``, to be scattered. ``convert`` (a dequantizing reader's): always into
    ``area``, None when it has no room."""
    spans, _ = staged_spans(owner, counts)
    wanted = [counts[g] - skip[g] for g in range(len(counts))]
    direct_rows = sum(count_runs(local_ids[s.group_id]) * s.planes for s in spans)
    staged_rows = sum(s.planes for s in spans if wanted[s.group_id])
    local_offset = None
    if area is not None and (direct_rows > staged_rows or convert is not None):
        local_offset = area.alloc(sum(s.planes * wanted[s.group_id] * s.stride for s in spans))
    if convert is not None and local_offset is None:
        return None
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
    return StagedRead(local_rows, remote_rows, plan.total_bytes, scatter, convert)


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
