"""One decode row through a block-scaled e4m3 weight on the CUDA cores: ``fp8_gemm``'s product at one row.

At one row the tensor-core GEMM (``fp8_gemm_triton``) pads x to a 16-row tile and reads the weight at about twice
its floor (``bench/RESULTS.md``). This kernel is shaped like the bf16 GEMV (``gemv_triton``): each program owns
``BLOCK_N`` output features and streams their weight rows along K, ``GROUPS`` scale groups at a time, in fp32 on
the CUDA cores. It quantizes x itself, group by group, exactly as ``quantize_groups`` does (the group's absolute
maximum over e4m3's, IEEE division, rounded to e4m3), so the activation never makes a round trip through memory
and no quantization kernel is launched; each group's partial sum is multiplied by the x group's and the weight
block's scales as the Triton GEMM does per K slab (only the order of the fp32 sum differs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.engine.ops.fp8_format import FP8_MAX, MIN_SCALE


class GemvTile(NamedTuple):
    block_n: int
    groups: int  # scale groups of K per loop step
    num_warps: int
    num_stages: int


DEFAULT_TILE = GemvTile(16, 4, 4, 3)


@triton.jit
def _fp8_gemv_kernel(X, W, W_s, Bias, Y, N, K, stride_wn, stride_wsn, num_groups, SCALE_N: tl.constexpr,
                     GROUP: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                     FMAX: tl.constexpr, SMIN: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rg = tl.arange(0, GROUPS)
    rc = tl.arange(0, GROUP)
    w_rows = W + rn.to(tl.int64)[:, None, None] * stride_wn
    s_rows = W_s + (rn // SCALE_N)[:, None] * stride_wsn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for first in range(0, num_groups, GROUPS):
        g = first + rg
        cols = g[:, None] * GROUP + rc[None, :]  # [GROUPS, GROUP]
        k_ok = (cols < K) & (g < num_groups)[:, None]
        x = tl.load(X + cols, mask=k_ok, other=0.0).to(tl.float32)
        x_scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FMAX, SMIN)  # as quantize_groups
        xq = tl.clamp(tl.div_rn(x, x_scale[:, None]), -FMAX, FMAX).to(tl.float8e4nv).to(tl.float32)
        w = tl.load(w_rows + cols[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0)
        part = tl.sum(w.to(tl.float32) * xq[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
        w_scale = tl.load(s_rows + g[None, :], mask=n_ok[:, None] & (g < num_groups)[None, :], other=0.0)
        acc += tl.sum(part * w_scale * x_scale[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + rn, acc.to(Y.dtype.element_ty), mask=n_ok)


def supported(x: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether this kernel takes the product: one contiguous row, rows of the weight and its scales contiguous, a
    power-of-two block width (the group)."""
    group = block[1]
    return (x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and wq.stride(1) == 1 and w_scales.dim() == 2
            and w_scales.stride(1) == 1 and group >= 16 and group & (group - 1) == 0)


def fp8_gemv(x: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor, block: tuple[int, int],
             bias: torch.Tensor | None = None, tile: GemvTile | None = None) -> torch.Tensor:
    """``x @ dequant(wq).T (+ bias)`` for one row x [1, K] with x quantized in 1 x ``block[1]`` groups; out in
    x's dtype."""
    n, k = wq.shape
    if not supported(x, wq, w_scales, block) or x.shape[1] != k:
        raise ValueError(f"fp8_gemv takes one contiguous row of {k} values and a power-of-two block width, got x "
                         f"{tuple(x.shape)} and block {block}")
    num_groups = triton.cdiv(k, block[1])
    if tuple(w_scales.shape) != (triton.cdiv(n, block[0]), num_groups):
        raise ValueError(f"fp8_gemv: scales {tuple(w_scales.shape)} do not fit w {tuple(wq.shape)} in {block} blocks")
    t = tile or DEFAULT_TILE
    groups = min(t.groups, triton.next_power_of_2(num_groups))
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, t.block_n),)](
        x, wq, w_scales, bias if bias is not None else out, out, n, k, wq.stride(0), w_scales.stride(0), num_groups,
        SCALE_N=block[0], GROUP=block[1], GROUPS=groups, BLOCK_N=t.block_n, HAS_BIAS=bias is not None,
        FMAX=FP8_MAX, SMIN=MIN_SCALE, num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def search_space() -> list[GemvTile]:
    """The tiles ``bench/fp8_gemm.py --sweep`` tries for one row."""
    return [GemvTile(n, g, w, s) for n in (4, 8, 16, 32) for g in (1, 2, 4) for w in (4, 8) for s in (2, 3)]
