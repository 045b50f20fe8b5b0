"""Triton kernels of the FP8 projections (``fp8_gemm``): activation quantization in groups and the block-scaled GEMM.

``quantize_groups``: one program per (row, group of columns) finds the group's absolute maximum, scales it onto
e4m3's range and writes the e4m3 values and the float32 scale; a group as wide as the row is the per-token
quantization of the row-scaled path.

``block_scaled_mm``: ``C = A @ B.T`` with A [M, K] e4m3 in 1 x ``BLOCK_K`` groups (scales [M, ceil(K/BLOCK_K)]) and
B [N, K] e4m3 in ``SCALE_N`` x ``BLOCK_K`` blocks (scales [ceil(N/SCALE_N), ceil(K/BLOCK_K)]). A program owns a
``BLOCK_M`` x ``BLOCK_N`` tile of C (or, split K ways for a small decode product, its share of the K slabs,
written as an fp32 partial sum) and walks K one scale slab at a time::

    acc += dot(A[m, slab], B[n, slab].T) * a_scale[m, slab] * b_scale[n // SCALE_N, slab]

so each slab's FP8 tensor-core product is rescaled in fp32 before it is summed (the slab is the scale's K extent,
hence ``BLOCK_K`` is the weight's block width). B's tile is read K-contiguous, the operand order Hopper's FP8 MMA
wants. Programs are ordered in groups of ``GROUP_M`` rows of tiles so a weight tile is reused from L2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.engine.ops.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE
from services.engine.ops.split_k_triton import sum_splits


class Fp8Tile(NamedTuple):
    """A launch shape of the block-scaled GEMM; ``split_k`` 0 picks the K split by ``split_k_for``."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k: int = 0


#: The tile by rows of A (a decode batch up to 16 rows, a larger batch, a prefill), chosen by ``bench/fp8_gemm.py``.
TILES = ((16, Fp8Tile(16, 64, 4, 4)), (64, Fp8Tile(64, 64, 4, 4)), (None, Fp8Tile(128, 128, 8, 3)))


#: FP8 tensor-core MMAs take K in steps of 32: a narrower weight block cannot be one slab of the kernel.
MIN_BLOCK_K = 32


def supported_block(block: tuple[int, int]) -> bool:
    """Whether the kernel computes weights of these blocks (real checkpoints' 128 x 128 are)."""
    return block[1] >= MIN_BLOCK_K and block[1] & (block[1] - 1) == 0


#: Up to this many rows, a product whose tiles do not fill the GPU twice splits K (at most ``MAX_SPLIT_K`` ways).
SPLIT_K_MAX_ROWS = 16
MAX_SPLIT_K = 8


def split_k_for(num_tiles: int, num_slabs: int, m: int, device: torch.device) -> int:
    """How many programs share one output tile's K slabs: a decode batch's projection with few output tiles (a
    576-row MLA projection has 18 of 32 columns) reads its weight from too few SMs unless K is split; each split
    then writes an fp32 partial sum."""
    if m > SPLIT_K_MAX_ROWS or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLIT_K, num_slabs, triton.cdiv(2 * sms, num_tiles)))


def tile_for(m: int) -> Fp8Tile:
    return next(tile for limit, tile in TILES if limit is None or m <= limit)


@triton.jit
def _quantize_groups_kernel(X, Q, S, K, stride_x, stride_q, stride_sm, stride_sg, num_groups, amax_ub,
                            GROUP: tl.constexpr,
                            BLOCK: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, FMAX: tl.constexpr,
                            SMIN: tl.constexpr):
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK)
    offs = groups[:, None] * GROUP + cols[None, :]
    ok = (cols[None, :] < GROUP) & (offs < K) & (groups[:, None] < num_groups)
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.minimum(tl.max(tl.abs(x), axis=1), amax_ub) / FMAX, SMIN)
    q = tl.clamp(tl.div_rn(x, scale[:, None]), -FMAX, FMAX)  # IEEE division, as fp8_format.quantize divides
    tl.store(Q + row * stride_q + offs, q.to(Q.dtype.element_ty), mask=ok)
    tl.store(S + row * stride_sm + groups * stride_sg, scale, mask=groups < num_groups)


def quantize_groups(x: torch.Tensor, group: int, column_major_scales: bool = False,
                    amax_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``fp8_gemm.quantize_groups``: x [M, K] (rows contiguous) -> (e4m3 [M, K], float32 [M, ceil(K/group)]).
    A program quantizes up to 1024 values of a row (several groups of 128, or one whole row).
    ``column_major_scales``: the scales' groups outermost in memory (strides (1, M)), as cuBLASLt's 1x128 recipe
    reads them. ``amax_ub``: a group's absolute maximum is taken as at most this (``fp8_gemm.quantize_rows``)."""
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    block = triton.next_power_of_2(group)
    per_program = max(1, min(1024 // block, triton.next_power_of_2(num_groups)))
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if column_major_scales:
        scales = torch.empty((num_groups, m), dtype=torch.float32, device=x.device).T
    else:
        scales = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m:
        grid = (m, triton.cdiv(num_groups, per_program))
        _quantize_groups_kernel[grid](x, q, scales, k, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
                                      num_groups, float("inf") if amax_ub is None else float(amax_ub),
                                      GROUP=group, BLOCK=block,
                                      GROUPS_PER_PROGRAM=per_program, FMAX=FP8_MAX, SMIN=MIN_SCALE,
                                      num_warps=4 if block * per_program <= 2048 else 8)
    return q, scales


@triton.jit
def _block_scaled_mm_kernel(A, A_s, B, B_s, C, Bias, M, N, K, stride_am, stride_bn, stride_cm, stride_cs, stride_asm,
                            stride_ask, stride_bsn, num_slabs, slabs_per_split, SCALE_N: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    first_slab = split * slabs_per_split
    last_slab = tl.minimum(num_slabs, first_slab + slabs_per_split)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = A + offs_m[:, None] * stride_am + (first_slab * BLOCK_K + offs_k)[None, :]
    b_ptrs = B + offs_n[None, :] * stride_bn + (first_slab * BLOCK_K + offs_k)[:, None]
    as_ptrs = A_s + offs_m * stride_asm
    bs_ptrs = B_s + (offs_n // SCALE_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slab in range(first_slab, last_slab):
        k_ok = offs_k < K - slab * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + slab * stride_ask, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs + slab, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C + split * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_scaled_mm(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                    block: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                    tile: Fp8Tile | None = None) -> torch.Tensor:
    """``dequant(xq) @ dequant(wq).T (+ bias)`` (see the module docstring); ``tile`` defaults to ``tile_for(M)``."""
    m, k = xq.shape
    n = wq.shape[0]
    if not supported_block(block):
        raise ValueError(f"block_scaled_mm: block width {block[1]} is not a power of two >= {MIN_BLOCK_K}")
    if wq.shape[1] != k or xq.stride(1) != 1 or wq.stride(1) != 1 or w_scales.stride(1) != 1:
        raise ValueError(f"block_scaled_mm: x {tuple(xq.shape)} and w {tuple(wq.shape)} must share K, rows contiguous")
    grid_k = triton.cdiv(k, block[1])
    if tuple(x_scales.shape) != (m, grid_k) or tuple(w_scales.shape) != (triton.cdiv(n, block[0]), grid_k):
        raise ValueError(f"block_scaled_mm: scales {tuple(x_scales.shape)} / {tuple(w_scales.shape)} do not fit x "
                         f"{tuple(xq.shape)} / w {tuple(wq.shape)} in {block[0]}x{block[1]} blocks")
    if m == 0:
        return torch.empty((m, n), dtype=out_dtype, device=xq.device)
    t = tile or tile_for(m)
    num_tiles = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    num_slabs = triton.cdiv(k, block[1])
    splits = t.split_k or split_k_for(num_tiles, num_slabs, m, xq.device)
    per_split = triton.cdiv(num_slabs, splits)
    splits = triton.cdiv(num_slabs, per_split)  # no empty split
    # One split writes the output; several write fp32 partial sums, added (with the bias) afterwards.
    out = (torch.empty((m, n), dtype=out_dtype, device=xq.device) if splits == 1
           else torch.empty((splits, m, n), dtype=torch.float32, device=xq.device))
    fused_bias = bias is not None and splits == 1
    _block_scaled_mm_kernel[(num_tiles, splits)](
        xq, x_scales, wq, w_scales, out, bias if fused_bias else out, m, n, k, xq.stride(0), wq.stride(0),
        out.stride(-2), out.stride(0) if splits > 1 else 0, x_scales.stride(0), x_scales.stride(1),
        w_scales.stride(0), num_slabs, per_split, SCALE_N=block[0], HAS_BIAS=fused_bias, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, BLOCK_K=block[1], GROUP_M=t.group_m, num_warps=t.num_warps, num_stages=t.num_stages)
    if splits == 1:
        return out
    return sum_splits(out, bias, out_dtype)
