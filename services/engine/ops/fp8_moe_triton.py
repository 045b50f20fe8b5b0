"""Triton kernel of ``fp8_moe``: a grouped GEMM over experts whose weights stay e4m3 with 2-D block scales.

``C[r] = dequant(A[row_of[r]]) @ dequant(W[e(r)]).T`` for rows ``r`` sorted by expert (``ends``: each expert's end
row). W [E, N, K] is e4m3 with float32 scales [E, ceil(N / SCALE_N), ceil(K / BLOCK_K)] (DeepSeek-V3's and
Qwen3-FP8's 128 x 128 blocks, a ragged edge rounded up); A [tokens, K] is e4m3 with one float32 scale per row and
``BLOCK_K`` columns (``fp8_gemm``'s 1 x 128 activation groups, quantized once per token before the gather). A
program owns ``BLOCK_M`` rows of one expert -- it finds which from ``ends`` itself (``grouped_rows_triton``'s
``row_tile``: no host sync, so a decode step with it is captured in a CUDA graph) -- and ``BLOCK_N`` output
columns, and walks K one scale slab at a time, as ``fp8_gemm_triton``'s dense kernel does::

    acc += dot(A[rows, slab], W[e, cols, slab].T) * a_scale[rows, slab] * w_scale[e, cols // SCALE_N, slab]

so each slab's FP8 tensor-core product is rescaled in fp32 before it is summed. Rows past an expert's end, columns
past N and K past its last slab are masked (loaded as 0, never stored). For decode (a few rows per expert) K is
split over programs, each writing an fp32 partial that ``split_k_triton.sum_splits`` adds in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.engine.ops.fp8_gemm_triton import supported_block
from services.engine.ops.grouped_rows_triton import row_tile, row_tiles
from services.engine.ops.split_k_triton import sum_splits


@triton.jit
def _fp8_grouped_mm_kernel(A, A_s, RowOf, B, B_s, C, Ends, num_experts, N, K, slabs_per_split, stride_am,
                           stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, stride_cs,
                           GATHER: tl.constexpr, SCALE_N: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                           EVEN_K: tl.constexpr):
    expert, first, end = row_tile(Ends, num_experts, tl.program_id(0), BLOCK_M, BLOCK_E)
    if expert >= num_experts:  # a tile past the last expert's rows (the grid is sized for the worst case)
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    a_rows = tl.load(RowOf + rows, mask=row_ok, other=0).to(tl.int64) if GATHER else rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    e = expert.to(tl.int64)
    split = tl.program_id(2)  # this program's share of the K slabs; one share when not split
    first_slab = split * slabs_per_split
    last_slab = tl.minimum(first_slab + slabs_per_split, tl.cdiv(K, BLOCK_K))
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + (first_slab * BLOCK_K + offs_k)[None, :]
    b_ptrs = B + e * stride_be + cols[None, :].to(tl.int64) * stride_bn + (first_slab * BLOCK_K + offs_k)[:, None]
    as_ptrs = A_s + a_rows * stride_asm
    bs_ptrs = B_s + e * stride_bse + (cols // SCALE_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slab in range(first_slab, last_slab):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:  # the last slab runs past K: its columns read as 0
            k_ok = offs_k < K - slab * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + slab, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptrs + slab, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out = C + split * stride_cs + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class Fp8MoeConfig:
    """One launch's tile: rows x columns (K steps one scale slab, the weight's block width), warps, pipeline stages
    and K splits (``splits`` > 1: fp32 partials added by ``split_k_triton.sum_splits``)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    splits: int = 1


def config_for(num_rows: int, num_experts: int) -> Fp8MoeConfig:
    """The tile for ``num_rows`` (token, expert) rows over ``num_experts``: while most experts hold a few rows
    (decode), 16-row tiles (the FP8 MMA's least) with K split (4 ways for a single tile's rows, 2 past that) so
    that enough programs stream the weights; past that (prefill) 128 x 128 tiles on 8 warps, the dense FP8
    GEMM's prefill tile. A starting point as ``mxfp4_moe_triton``'s was: ``bench/fp8_moe.py --sweep`` times others."""
    if num_rows <= 16 * num_experts:
        return Fp8MoeConfig(16, 64, 4, 3, splits=4 if num_rows <= 16 else 2)
    return Fp8MoeConfig(128, 128, 8, 3)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _check(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
           block: tuple[int, int]) -> None:
    """ValueError unless the operands fit each other in ``block`` blocks, rows contiguous."""
    e, n, k = wq.shape
    if not supported_block(block):
        raise ValueError(f"fp8_grouped_mm: block width {block[1]} is not a power of two >= 32")
    grid_k = triton.cdiv(k, block[1])
    if (xq.shape[1] != k or tuple(x_scales.shape) != (xq.shape[0], grid_k)
            or tuple(w_scales.shape) != (e, triton.cdiv(n, block[0]), grid_k)):
        raise ValueError(f"fp8_grouped_mm: x {tuple(xq.shape)} (scales {tuple(x_scales.shape)}) and w "
                         f"{tuple(wq.shape)} (scales {tuple(w_scales.shape)}) do not fit {block[0]}x{block[1]} blocks")
    if xq.stride(1) != 1 or x_scales.stride(1) != 1 or wq.stride(2) != 1 or w_scales.stride(2) != 1:
        raise ValueError("fp8_grouped_mm: operands and scales must have contiguous rows")


def fp8_grouped_mm(xq: torch.Tensor, x_scales: torch.Tensor, row_of: torch.Tensor | None, wq: torch.Tensor,
                   w_scales: torch.Tensor, block: tuple[int, int], ends: torch.Tensor, out_dtype: torch.dtype,
                   config: Fp8MoeConfig | None = None) -> torch.Tensor:
    """[rows, N] in ``out_dtype`` (see the module docstring): ``xq`` [tokens, K] e4m3 with ``x_scales``
    [tokens, ceil(K / block[1])]; ``row_of`` [rows] the token of each row (None: ``xq`` is already sorted);
    ``ends`` [E] int32, its last the row count. ``config``: the tile (default ``config_for``)."""
    _check(xq, x_scales, wq, w_scales, block)
    num_rows = xq.shape[0] if row_of is None else row_of.shape[0]
    num_experts, n, k = wq.shape
    out = _empty((num_rows, n), out_dtype, xq.device)
    if num_rows == 0:
        return out
    cfg = config or config_for(num_rows, num_experts)
    num_slabs = triton.cdiv(k, block[1])
    per_split = triton.cdiv(num_slabs, cfg.splits)
    splits = triton.cdiv(num_slabs, per_split)  # no empty split
    dest = out if splits == 1 else _empty((splits, num_rows, n), torch.float32, xq.device)
    grid = (row_tiles(num_rows, num_experts, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _fp8_grouped_mm_kernel[grid](
        xq, x_scales, out if row_of is None else row_of, wq, w_scales, dest, ends, num_experts, n, k, per_split,
        xq.stride(0), x_scales.stride(0), wq.stride(0), wq.stride(1), w_scales.stride(0), w_scales.stride(1),
        dest.stride(-2), 0 if splits == 1 else dest.stride(0), GATHER=row_of is not None, SCALE_N=block[0],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block[1], BLOCK_E=triton.next_power_of_2(num_experts),
        EVEN_K=k % block[1] == 0, num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return out if splits == 1 else sum_splits(dest, None, out_dtype)
