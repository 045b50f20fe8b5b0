"""Triton kernel of ``mxfp4_moe``: a grouped GEMM over experts whose weights stay MXFP4 in memory.

``C[r] = A[row_of[r]] @ W[e(r)].T + bias[e(r)]`` for rows ``r`` sorted by expert (``ends``: each expert's end
row), W [E, N, K] stored as ``blocks`` [E, N, K / 2] uint8 (two e2m1 codes a byte, the low nibble the even k) and
``scales`` [E, N, K / 32] uint8 (E8M0, bias 127). A program owns ``BLOCK_M`` rows of one expert (it finds which from
``ends`` itself: no host sync, so a decode step with it is captured in a CUDA graph, and no tile map made by a dozen
small launches first: ``grouped_rows_triton.row_tile``) and ``BLOCK_N`` output columns,
and walks K ``BLOCK_K`` at a time: it loads the A tile (gathering rows through ``row_of`` when given), the weight
tile's bytes and scales -- 4.25 bits a weight instead of 16 -- decodes them in registers to A's dtype (exact: every
e2m1 value times a power of two is a bfloat16 value; integer ops build each value's float32 bits, no table and no
exp2 per weight) and runs the tensor-core dot in float32. ``MxConfig`` holds the tile, chosen per shape by
``config_for`` from ``bench/mxfp4_moe.py``'s sweep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.engine.ops.grouped_rows_triton import row_tile, row_tiles
from services.engine.ops.split_k_triton import sum_splits


@triton.jit
def _e2m1(code):
    """Codes 0..15 (int32) -> float32: sign bit 8, then exponent and mantissa (0, 0.5, 1, 1.5, 2, 3, 4, 6). A
    normal code's exponent field is its two exponent bits plus 126 and its mantissa bit the float's top one; code
    1 (0.5) is 126 << 23 and 0 is 0."""
    magnitude = code & 7
    bits = tl.where(magnitude >= 2, (magnitude << 22) + (126 << 23), magnitude * (126 << 23))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_grouped_mm_kernel(A, RowOf, Blocks, Scales, Bias, C, Ends, num_experts, N, K, k_per_split, stride_am,
                             stride_be, stride_bn, stride_se, stride_sn, stride_biase, stride_cm, stride_cs,
                             GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                             EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    expert, first, end = row_tile(Ends, num_experts, tl.program_id(0), BLOCK_M, BLOCK_E)
    if expert >= num_experts:  # a tile past the last expert's rows (the grid is sized for the worst case)
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    a_rows = tl.load(RowOf + rows, mask=row_ok, other=0).to(tl.int64) if GATHER else rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    e = expert.to(tl.int64)
    split = tl.program_id(2)  # this program's share of K (a multiple of BLOCK_K); one share when not split
    k_first = split * k_per_split
    a_ptrs = A + a_rows[:, None] * stride_am + (k_first + tl.arange(0, BLOCK_K))[None, :]
    b_ptrs = (Blocks + e * stride_be + cols[:, None].to(tl.int64) * stride_bn
              + (k_first // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
    s_ptrs = (Scales + e * stride_se + cols[:, None].to(tl.int64) * stride_sn
              + (k_first // 32 + tl.arange(0, BLOCK_K // 32))[None, :])
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_first, tl.minimum(k_first + k_per_split, K), BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            packed = tl.load(b_ptrs, mask=col_ok[:, None], other=0)
            exps = tl.load(s_ptrs, mask=col_ok[:, None], other=127)
        else:  # the last step runs past K: its codes read as 0 (value 0) and its A columns as 0
            k_ok = k0 + tl.arange(0, BLOCK_K) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            byte_ok = k0 // 2 + tl.arange(0, BLOCK_K // 2) < K // 2
            packed = tl.load(b_ptrs, mask=col_ok[:, None] & byte_ok[None, :], other=0)
            group_ok = k0 // 32 + tl.arange(0, BLOCK_K // 32) < K // 32
            exps = tl.load(s_ptrs, mask=col_ok[:, None] & group_ok[None, :], other=127)
        codes = packed.to(tl.int32)
        w = tl.join(_e2m1(codes & 15), _e2m1(codes >> 4)).reshape(BLOCK_N, BLOCK_K)  # low nibble: even k
        scale = tl.exp2(exps.to(tl.float32) - 127.0)
        w = (w.reshape(BLOCK_N, BLOCK_K // 32, 32) * scale[:, :, None]).reshape(BLOCK_N, BLOCK_K)
        acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 32
    if HAS_BIAS and split == 0:
        acc += tl.load(Bias + e * stride_biase + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = C + split * stride_cs + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class MxConfig:
    """One launch's tile: rows x columns x K step, warps, pipeline stages and K splits (``splits`` > 1: each
    program sums a share of K into float32 partials, which ``split_k_triton.sum_splits`` adds in order)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    splits: int = 1


def config_for(num_rows: int, num_experts: int) -> MxConfig:
    """The tile for ``num_rows`` (token, expert) rows over ``num_experts``, from ``bench/mxfp4_moe.py``'s sweep on
    an H200: while most experts hold a few rows (decode), 16-row tiles with K split (4 ways for one or two tokens,
    2 past that) so that enough programs stream the weights; past that (prefill) 128x128 tiles on 8 warps."""
    if num_rows <= 16 * num_experts:
        return MxConfig(16, 64, 64, 4, 3, splits=4 if num_rows <= 16 else 2)
    return MxConfig(128, 128, 64, 8, 3)


def mxfp4_grouped_mm(a: torch.Tensor, row_of: torch.Tensor | None, blocks: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None, ends: torch.Tensor, config: MxConfig | None = None) -> torch.Tensor:
    """[rows, N] in ``a``'s dtype (see the module docstring); ``row_of`` None: ``a`` is already sorted.
    ``config``: the tile (default ``config_for``; the benchmark's sweep passes its own)."""
    num_rows = a.shape[0] if row_of is None else row_of.shape[0]
    _, n, half_k = blocks.shape
    k = 2 * half_k
    out = a.new_empty(num_rows, n)
    if num_rows == 0:
        return out
    cfg = config or config_for(num_rows, blocks.shape[0])
    num_experts = blocks.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    dest = out if splits == 1 else torch.empty(splits, num_rows, n, dtype=torch.float32, device=a.device)
    grid = (row_tiles(num_rows, num_experts, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _mxfp4_grouped_mm_kernel[grid](
        a, out if row_of is None else row_of, blocks, scales, out if bias is None else bias, dest, ends,
        num_experts, n, k, k_per_split, a.stride(0), blocks.stride(0), blocks.stride(1), scales.stride(0),
        scales.stride(1), 0 if bias is None else bias.stride(0), dest.stride(-2),
        0 if splits == 1 else dest.stride(0), GATHER=row_of is not None, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=triton.next_power_of_2(num_experts),
        EVEN_K=k % cfg.block_k == 0, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return out if splits == 1 else sum_splits(dest, None, a.dtype)
