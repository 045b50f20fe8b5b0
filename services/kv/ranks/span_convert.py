"""Staging copies that change the KV dtype, and the digest of a staged span: a converting pair's copies.

A pair whose KV dtypes differ only by FP8 quantization (``services.kv.spec.kv_convert``) moves e4m3 bytes, so one
side converts in its staging area: an unquantized owner quantizes while it gathers (``quantize_gather``: the
engine's rounding, ``saturate(x / scale)`` in float32, cast once), an unquantized reader dequantizes while it
scatters (``dequantize_scatter``: ``float32(fp8) * scale``, rounded once to its dtype, as an FP8 engine's
attention reads its cache). The span's bytes are laid out as ``staging.staged_spans`` lays out the FP8 layout's
(``span.dtype``), so a reader of that layout reads them as its own blocks.

The digest of a converting ticket covers the FP8 bytes, wherever they are: ``span_digests`` reads a span as a KV
pool of its own (each group's staged blocks numbered from 0 in a layout of that many blocks), and the digest,
keyed by token, layer and head, is the one the same bytes would have in blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from services.kv.digest.runner import digest_job
from services.kv.digest.scheme import DigestJob
from services.kv.plan.staging import Span, SpanDtype, staged_spans
from services.kv.ranks.staging_area import StagingArea, _index, _rows
from services.kv.spec.layout import KVBufferSpec, KVLayoutSpec, LayoutKind

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float8_e4m3fn": torch.float8_e4m3fn}
#: Integer views of the same width, for the row copies (CPU torch has no float8 index_copy_).
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
FP8_MAX = 448.0  # e4m3's largest finite value: what the engine's write saturates to


def scale_grid(layout: KVLayoutSpec, buffer: KVBufferSpec, scales: SpanDtype) -> torch.Tensor:
    """float32 ``[planes or 1, 1, segments, 1]``: the scale of each (plane, segment) of a buffer's block rows,
    which broadcast over ``[planes, blocks, segments, elements]``. A per-layer buffer's planes are K and V (an MLA
    layer's one plane, K's scale); a cross-layer or heads-outer row is ``[layers, K/V, page]``."""
    kv_planes = layout.num_kv_planes(buffer.group_id)
    pairs = [scales.scales.get(layer, (1.0, 1.0)) for layer in buffer.layer_ids]
    if layout.kind is LayoutKind.PER_LAYER:
        values = [pairs[0][kv] for kv in range(kv_planes)]
        return torch.tensor(values, dtype=torch.float32).view(kv_planes, 1, 1, 1)
    values = [pair[kv] for pair in pairs for kv in range(kv_planes)]
    return torch.tensor(values, dtype=torch.float32).view(1, 1, len(values), 1)


def _pool(layout: KVLayoutSpec, buffers: Sequence[torch.Tensor], s: Span) -> torch.Tensor:
    """A buffer's pool as ``[planes * blocks, elements per block row]`` in its own element width (as integers)."""
    words = _WORDS[layout.element_size]
    return buffers[s.buffer_index].view(-1).view(words).view(s.planes * layout.num_blocks, -1)


def _span_bytes(area: StagingArea, offset: int, s: Span) -> torch.Tensor:
    start = offset + s.offset
    return area.buffer[start:start + s.num_bytes]


def quantize_gather(layout: KVLayoutSpec, buffers: Sequence[torch.Tensor], area: StagingArea, offset: int,
                    ids: Sequence[np.ndarray], span: SpanDtype) -> None:
    """Each group's blocks ``ids[g]`` of the (unquantized) pool, quantized with ``span.scales``, into the span at
    ``offset`` laid out as the FP8 layout's (``staged_spans`` of ``layout`` in ``span.dtype``)."""
    fp8 = dataclasses.replace(layout, dtype=span.dtype)
    src_spans = staged_spans(layout, tuple(len(i) for i in ids))[0]
    dst_spans = staged_spans(fp8, tuple(len(i) for i in ids))[0]
    for src, dst, b in zip(src_spans, dst_spans, fp8.buffers(), strict=True):
        if not src.num_blocks:
            continue
        pool = _pool(layout, buffers, src)
        rows = pool.index_select(0, _index(_rows(src, ids[src.group_id], layout.num_blocks), pool.device))
        grid = scale_grid(fp8, b, span).to(pool.device)
        values = rows.view(TORCH_DTYPES[layout.dtype]).float().view(src.planes, src.num_blocks, grid.shape[2], -1)
        quantized = (values / grid).clamp(-FP8_MAX, FP8_MAX).to(TORCH_DTYPES[span.dtype])
        _span_bytes(area, offset, dst).copy_(quantized.view(-1).view(torch.uint8))


def dequantize_scatter(layout: KVLayoutSpec, buffers: Sequence[torch.Tensor], area: StagingArea, offset: int,
                       ids: Sequence[np.ndarray], span: SpanDtype) -> None:
    """The inverse: the FP8 span at ``offset`` (``staged_spans`` of ``layout`` in ``span.dtype``), dequantized
    with ``span.scales``, into each group's blocks ``ids[g]`` of the (unquantized) pool."""
    fp8 = dataclasses.replace(layout, dtype=span.dtype)
    src_spans = staged_spans(fp8, tuple(len(i) for i in ids))[0]
    dst_spans = staged_spans(layout, tuple(len(i) for i in ids))[0]
    own = TORCH_DTYPES[layout.dtype]
    for src, dst, b in zip(src_spans, dst_spans, fp8.buffers(), strict=True):
        if not src.num_blocks:
            continue
        pool = _pool(layout, buffers, dst)
        grid = scale_grid(fp8, b, span).to(pool.device)
        stored = _span_bytes(area, offset, src).view(TORCH_DTYPES[span.dtype])
        values = (stored.float().view(src.planes, src.num_blocks, grid.shape[2], -1) * grid).to(own)
        rows = values.view(src.planes * src.num_blocks, -1).view(pool.dtype)
        pool.index_copy_(0, _index(_rows(dst, ids[dst.group_id], layout.num_blocks), pool.device), rows)


def span_digests(layout: KVLayoutSpec, area: StagingArea, offset: int, counts: Sequence[int],
                 jobs: Sequence[DigestJob]) -> list[np.ndarray]:
    """Each job's unit digests over the span at ``offset`` of ``counts[g]`` blocks per group (``staged_spans`` of
    ``layout``), instead of over blocks: group g's blocks are those of the job's tokens from its first block
    (``job.start // block size``), in order. Blocking (a worker thread's, or the staging stream's). Each group's
    share of the span is copied once for its digest (the digest's strided views start at a buffer's storage)."""
    spans = staged_spans(layout, tuple(counts))[0]
    out = []
    for job in jobs:
        g = job.group_id
        pool = dataclasses.replace(layout, num_blocks=max(1, counts[g]))
        # The digest's views address a buffer from its storage's start: each of the group's buffers is copied out.
        mine = {s.buffer_index: _span_bytes(area, offset, s) for s in spans if s.group_id == g}
        buffers = [mine[s.buffer_index].clone() if s.buffer_index in mine else area.buffer[:0] for s in spans]
        first = job.start // layout.block_size(g)
        ids = np.concatenate([np.zeros(first, np.int64), np.arange(counts[g], dtype=np.int64)])
        out.append(digest_job(pool, buffers, msgspec.structs.replace(job, block_ids=ids)))
        if job.corrupt:  # fault injection changes the span itself, as it would a pool's blocks
            for index, span in mine.items():
                span.copy_(buffers[index])
    return out
