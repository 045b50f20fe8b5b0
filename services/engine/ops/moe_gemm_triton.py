"""Triton kernels of ``moe_fused``: the grouped GEMMs of 16/32-bit routed experts over (token, expert) pairs sorted by
expert, with the permutation fused in.

``C[r] = A[row(r)] @ W[e(r)].T (+ bias[e(r)])`` for sorted rows ``r``, W [E, N, K] as the experts are stored (rows
contiguous). A program owns ``BLOCK_M`` rows of one expert (``grouped_rows_triton.row_tile``: found from ``ends`` in
the kernel, no host sync) and ``BLOCK_N`` output columns, and walks its share of K ``BLOCK_K`` at a time:

* **gate_up** reads its rows straight from the tokens: ``row(r) = sorted_pairs[r] // top_k`` (no ``x[rows]``
  copy). With ``ACT`` the program owns gate columns ``cols`` and up columns ``I + cols`` of the [gate; up] weight
  and writes ``silu(gate) * up`` [rows, I] (each rounded first, as the unfused path rounds), so the activation is
  no kernel of its own; without it (gpt-oss's clamped SwiGLU) it writes [rows, 2I].
* **down** reads the activations in sorted order; ``combine`` then un-permutes: token ``t``'s output is the sum
  over its k pairs of ``weight * C[pos_of_pair[pair]]`` (rounded as the unfused path rounds), one launch in place
  of a multiply, a scatter and a sum.

Decode (a few rows per expert) splits K over programs so that enough of them stream the weights: each writes an
fp32 partial, summed in split order (deterministic) by ``combine`` for down and by ``_sum_and_act_kernel`` for
gate_up. The tile is ``MoeTile``, chosen per shape by ``config_for``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.engine.ops.gated_act_triton import gated_act
from services.engine.ops.grouped_rows_triton import row_tile, row_tiles
from services.engine.ops.split_k_triton import sum_splits


@triton.jit
def _weight_tile(ptrs, col_ok, k_ok, EVEN_K: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] tile of W[e].T (columns past N, and unless EVEN_K rows past K, read as 0)."""
    if EVEN_K:
        return tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    return tl.load(ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` in fp32; ``UPCAST``: both in fp32 first (Triton's CPU interpreter cannot dot bfloat16)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _moe_gemm_kernel(A, Pairs, W, Bias, C, Ends, num_experts, N, K, k_per_split, top_k, stride_am, stride_we,
                     stride_wn, stride_be, stride_cm, stride_cs, GATHER: tl.constexpr, ACT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    expert, first, end = row_tile(Ends, num_experts, tl.program_id(0), BLOCK_M, BLOCK_E)
    if expert >= num_experts:  # a tile past the last expert's rows (the grid is sized for the worst case)
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    # gathered: the pair's token (pairs are numbered token * top_k + slot)
    a_rows = (tl.load(Pairs + rows, mask=row_ok, other=0) // top_k).to(tl.int64) if GATHER else rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    e = expert.to(tl.int64)
    split = tl.program_id(2)  # this program's share of K (a multiple of BLOCK_K); one share when not split
    k_first = split * k_per_split
    offs_k = k_first + tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    up_offset = N * stride_wn  # with ACT: the up rows sit I = N rows below the gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, tl.minimum(k_first + k_per_split, K), BLOCK_K):
        k_ok = k0 + tl.arange(0, BLOCK_K) < K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(a, _weight_tile(w_ptrs, col_ok, k_ok, EVEN_K), acc, UPCAST, PRECISION)
        if ACT:
            acc_up = _dot(a, _weight_tile(w_ptrs + up_offset, col_ok, k_ok, EVEN_K), acc_up, UPCAST, PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS and split == 0:
        acc += tl.load(Bias + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if ACT:
            acc_up += tl.load(Bias + e * stride_be + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = C + split * stride_cs + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    if ACT:
        y = gated_act(acc.to(C.dtype.element_ty), acc_up.to(C.dtype.element_ty), False)
    else:
        y = acc.to(C.dtype.element_ty)
    tl.store(out, y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_and_act_kernel(P, Y, M, width, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``silu(gate) * up`` [M, width] of split-K partials [SPLITS, M, 2 * width] (fp32, gate columns then up), each
    half summed in split order and rounded to Y's dtype first."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * width
    src = (i // width) * 2 * width + i % width
    gate = tl.load(P + src, mask=ok, other=0.0)
    up = tl.load(P + src + width, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        gate += tl.load(P + s * M * 2 * width + src, mask=ok, other=0.0)
        up += tl.load(P + s * M * 2 * width + src + width, mask=ok, other=0.0)
    dtype = Y.dtype.element_ty
    tl.store(Y + i, gated_act(gate.to(dtype), up.to(dtype), False), mask=ok)


@triton.jit
def _combine_kernel(Y, PosOfPair, Weights, Out, H, stride_ys, stride_ym, TOP_K: tl.constexpr,
                    SPLITS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Out[t] = sum over slots j of round(weight[t, j] * round(Y[pos_of_pair[t, j]])), the sum in fp32 (as torch
    sums 16-bit values), Y being [SPLITS, rows, H] partials summed in split order first."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    dtype = Out.dtype.element_ty
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pos = tl.load(PosOfPair + t * TOP_K + j).to(tl.int64)
        y = tl.load(Y + pos * stride_ym + cols, mask=ok, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SPLITS):
            y += tl.load(Y + s * stride_ys + pos * stride_ym + cols, mask=ok, other=0.0)
        w = tl.load(Weights + t * TOP_K + j).to(tl.float32)
        acc += (y.to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
    tl.store(Out + t * H + cols, acc.to(dtype), mask=ok)


@dataclass(frozen=True)
class MoeTile:
    """One launch's tile: rows x columns x K step, warps, pipeline stages and K splits (``splits`` > 1: fp32
    partials summed in split order)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    splits: int = 1


WAVE_PROGRAMS = 264  # two programs per SM of an H100/H200 (132): what the decode tiles aim to keep streaming
MIN_K_PER_SPLIT = 256


def config_for(num_rows: int, num_experts: int, n: int, k: int, act: bool = False) -> MoeTile:
    """The tile for ``num_rows`` (token, expert) rows over ``num_experts`` experts of an [n, k] projection (``act``:
    gate_up with the activation fused, n being I). While most experts hold a few rows (decode), 16-row tiles
    (the MMA's least) 64 columns wide, K split in powers of two (shares of at least ``MIN_K_PER_SPLIT``) until
    about ``WAVE_PROGRAMS`` programs stream the weights, as the FP8 and MXFP4 kernels do; past that (prefill)
    128-row tiles on 8 warps, 64 columns with the activation (two accumulators) and 128 without. A starting
    point: ``bench/moe_fused.py --sweep`` times others."""
    if num_rows <= 16 * num_experts:
        programs = min(num_rows, num_experts) * triton.cdiv(n, 64)
        splits = 1
        while programs * splits < WAVE_PROGRAMS and k // (2 * splits) >= MIN_K_PER_SPLIT and splits < 8:
            splits *= 2
        return MoeTile(16, 64, 128, 4, 4, splits)
    return MoeTile(128, 64 if act else 128, 64, 8, 3)


def _launch(a: torch.Tensor, pairs: torch.Tensor | None, top_k: int, w: torch.Tensor, bias: torch.Tensor | None,
            ends: torch.Tensor, dest: torch.Tensor, n: int, act: bool, cfg: MoeTile, k_per_split: int,
            num_rows: int) -> None:
    num_experts, _, k = w.shape
    split = dest.dim() == 3
    grid = (row_tiles(num_rows, num_experts, cfg.block_m), triton.cdiv(n, cfg.block_n), dest.shape[0] if split else 1)
    _moe_gemm_kernel[grid](
        a, dest if pairs is None else pairs, w, dest if bias is None else bias, dest, ends, num_experts, n, k,
        k_per_split, top_k, a.stride(0), w.stride(0), w.stride(1), 0 if bias is None else bias.stride(0),
        dest.stride(-2), dest.stride(0) if split else 0, GATHER=pairs is not None, ACT=act, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=triton.next_power_of_2(num_experts),
        EVEN_K=k % cfg.block_k == 0, UPCAST=not a.is_cuda, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg.warps, num_stages=cfg.stages,
    )


def _check(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, act: bool) -> None:
    e, n, k = w.shape
    if a.dim() != 2 or a.shape[1] != k or a.stride(1) != 1 or w.stride(2) != 1 or a.dtype != w.dtype:
        raise ValueError(f"moe_gemm: rows {tuple(a.shape)} {a.dtype} do not fit experts {tuple(w.shape)} {w.dtype} "
                         "(rows and weight rows contiguous, one dtype)")
    if (act and n % 2) or (bias is not None and (tuple(bias.shape) != (e, n) or bias.stride(1) != 1)):
        raise ValueError(f"moe_gemm: bias {None if bias is None else tuple(bias.shape)} or an odd gate/up width {n}")


def moe_gemm(a: torch.Tensor, pairs: torch.Tensor | None, top_k: int, w: torch.Tensor, bias: torch.Tensor | None,
             ends: torch.Tensor, act: bool = False, keep_splits: bool = False,
             config: MoeTile | None = None) -> torch.Tensor:
    """The grouped GEMM of the module docstring in ``a``'s dtype: [rows, N], or [rows, N / 2] with ``act`` (W is
    [gate; up]). ``pairs`` [rows] int32 each sorted row's pair (None: ``a``'s rows are the sorted rows; else
    ``a`` is [tokens, K] and the rows are gathered); ``ends`` [E] int32. ``keep_splits``: a split-K launch returns
    its fp32 partials [splits, rows, N] for ``combine`` to sum (no sum launch). ``config``: the tile (default
    ``config_for``; the benchmark's sweep passes its own)."""
    _check(a, w, bias, act)
    num_experts, n_total, k = w.shape
    num_rows = a.shape[0] if pairs is None else pairs.shape[0]
    n = n_total // 2 if act else n_total
    cfg = config or config_for(num_rows, num_experts, n, k, act)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)  # no empty share
    if num_rows == 0:
        return a.new_empty((splits, 0, n_total) if keep_splits and splits > 1 else (0, n))
    if splits == 1:
        out = a.new_empty(num_rows, n)
        _launch(a, pairs, top_k, w, bias, ends, out, n, act, cfg, k_per_split, num_rows)
        return out
    partials = torch.empty(splits, num_rows, n_total, dtype=torch.float32, device=a.device)
    _launch(a, pairs, top_k, w, bias, ends, partials, n_total, False, cfg, k_per_split, num_rows)
    if act:
        out = a.new_empty(num_rows, n)
        _sum_and_act_kernel[(triton.cdiv(num_rows * n, 1024),)](partials, out, num_rows, n, SPLITS=splits, BLOCK=1024)
        return out
    return partials if keep_splits else sum_splits(partials, None, a.dtype)


def combine(y: torch.Tensor, pos_of_pair: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[tokens, H] in ``out_dtype``: each token's k sorted rows of ``y`` ([rows, H], or split-K partials
    [splits, rows, H]) found through ``pos_of_pair`` [tokens * k], times ``weights`` [tokens, k], summed."""
    tokens, top_k = weights.shape
    parts = y if y.dim() == 3 else y[None]
    h = parts.shape[-1]
    out = torch.empty(tokens, h, dtype=out_dtype, device=y.device)
    if tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(h))
    _combine_kernel[(tokens, triton.cdiv(h, block_h))](parts, pos_of_pair, weights.contiguous(), out, h,
                                                       parts.stride(0), parts.stride(1), TOP_K=top_k,
                                                       SPLITS=parts.shape[0], BLOCK_H=block_h)
    return out
