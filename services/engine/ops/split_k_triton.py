"""The split-K epilogue of the Triton GEMMs (``fp8_gemm_triton``, ``mxfp4_moe_triton``): the partial sums of a K
split written side by side, added here in split order -- the same order every run, so a split GEMM stays
deterministic, as atomics would not."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_splits_kernel(P, Bias, Y, M, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.load(P + i, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(P + s * M * N + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + i, acc.to(Y.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024


def sum_splits(partials: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The split-K partial sums [splits, M, N] (fp32, contiguous) added in split order, plus the bias, in
    ``out_dtype``: one launch where torch takes a sum, a bias add and a cast (a tenth of an FP8 decode step as
    three kernels, measured on an H200)."""
    splits, m, n = partials.shape
    out = torch.empty((m, n), dtype=out_dtype, device=partials.device)
    _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](partials, bias if bias is not None else out, out, m, n,
                                                          SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
    return out
