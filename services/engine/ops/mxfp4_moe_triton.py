"""Triton kernel of ``mxfp4_moe``: a grouped GEMM over experts whose weights stay MXFP4 in memory.

``C[r] = A[row_of[r]] @ W[e(r)].T + bias[e(r)]`` for rows ``r`` sorted by expert (``ends``: each expert's end
row), W [E, N, K] stored as ``blocks`` [E, N, K / 2] uint8 (two e2m1 codes a byte, the low nibble the even k) and
``scales`` [E, N, K / 32] uint8 (E8M0, bias 127). A program owns ``BLOCK_M`` rows of one expert (a tile map built
on the device: no host sync, so a decode step with it is captured in a CUDA graph) and ``BLOCK_N`` output columns,
and walks K ``BLOCK_K`` at a time: it loads the A tile (gathering rows through ``row_of`` when given), the weight
tile's bytes and scales -- 4.25 bits a weight instead of 16 -- decodes them in registers to A's dtype (exact: every
e2m1 value times a power of two is a bfloat16 value) and runs the tensor-core dot in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    """Codes 0..15 -> float32: sign bit 8, exponent bits 6..4 and mantissa bit 1 (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (2.0 + mantissa) * tl.exp2(exponent.to(tl.float32) - 2.0))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _mxfp4_grouped_mm_kernel(A, RowOf, Blocks, Scales, Bias, C, TileExpert, TileStart, Ends, N, K,
                             stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_biase, stride_cm,
                             GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    expert = tl.load(TileExpert + tl.program_id(0))
    if expert < 0:  # a tile past the last expert's rows (the map is sized for the worst case)
        return
    first = tl.load(TileStart + tl.program_id(0))
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(Ends + expert)
    a_rows = tl.load(RowOf + rows, mask=row_ok, other=0).to(tl.int64) if GATHER else rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    e = expert.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(A + a_rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None], other=0.0)
        byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(Blocks + e * stride_be + cols[:, None].to(tl.int64) * stride_bn + byte[None, :],
                         mask=col_ok[:, None], other=0)
        w = tl.join(_e2m1(packed & 15), _e2m1(packed >> 4)).reshape(BLOCK_N, BLOCK_K)  # low nibble: even k
        group = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        exps = tl.load(Scales + e * stride_se + cols[:, None].to(tl.int64) * stride_sn + group[None, :],
                       mask=col_ok[:, None], other=127)
        scale = tl.exp2(exps.to(tl.float32) - 127.0)
        w = (w.reshape(BLOCK_N, BLOCK_K // 32, 32) * scale[:, :, None]).reshape(BLOCK_N, BLOCK_K)
        acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + e * stride_biase + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = C + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tile_map(ends: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert of each row tile, its first row): each expert's rows cut into ``block_m``-row tiles, sized for the
    worst case (``num_rows / block_m`` plus one partial tile per expert) with -1 past the last; device ops only."""
    ends = ends.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    slots = torch.arange(num_rows // block_m + ends.numel(), device=ends.device)
    expert = torch.searchsorted(tile_ends, slots, right=True)
    valid = expert < ends.numel()
    expert = expert.clamp(max=ends.numel() - 1)
    start = (ends - counts)[expert] + (slots - (tile_ends - tiles)[expert]) * block_m
    return torch.where(valid, expert, -1).to(torch.int32), start.to(torch.int32)


def warps_for(block_m: int) -> int:
    """8 warps for 64-row tiles (4 spill the decoded weight tile on sm_90), else 4."""
    return 8 if block_m >= 64 else 4


def block_k_for(k: int) -> int:
    """The K step: 64 where K divides by it (gpt-oss's 2880), else 32 (a group: K is always a multiple of it)."""
    return 64 if k % 64 == 0 else 32


def mxfp4_grouped_mm(a: torch.Tensor, row_of: torch.Tensor | None, blocks: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None, ends: torch.Tensor) -> torch.Tensor:
    """[rows, N] in ``a``'s dtype (see the module docstring); ``row_of`` None: ``a`` is already sorted."""
    num_rows = a.shape[0] if row_of is None else row_of.shape[0]
    _, n, half_k = blocks.shape
    k = 2 * half_k
    out = a.new_empty(num_rows, n)
    if num_rows == 0:
        return out
    block_m = 16 if num_rows <= 16 * blocks.shape[0] else 64
    block_n = 64
    experts, starts = tile_map(ends, num_rows, block_m)
    grid = (experts.numel(), triton.cdiv(n, block_n))
    _mxfp4_grouped_mm_kernel[grid](
        a, out if row_of is None else row_of, blocks, scales, out if bias is None else bias, out, experts, starts,
        ends, n, k, a.stride(0), blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1),
        0 if bias is None else bias.stride(0), out.stride(0), GATHER=row_of is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k_for(k), DOT_PRECISION="ieee" if a.dtype == torch.float32
        else "tf32", num_warps=warps_for(block_m), num_stages=3,
    )
    return out
