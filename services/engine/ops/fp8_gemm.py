"""FP8 (e4m3) projections of quantized checkpoints: ``y = x @ dequant(W).T (+ b)`` with W kept as e4m3.

FP8 tensor cores run at twice the bf16 rate on Hopper and an e4m3 weight is half the bytes a decode step reads,
so an FP8 checkpoint computes in FP8 instead of being widened at load. The activation is quantized on the fly
(dynamic scales, as the checkpoints' ``activation_scheme: dynamic`` says), then:

* **per-tensor or per-output-channel weight scales** (compressed-tensors, fbgemm): one scale per token row of x
  (``quantize_rows``) and ``torch._scaled_mm`` with row-wise scales (cuBLASLt's FP8 GEMM);
* **128x128 weight blocks** (DeepSeek-V3/R1, Qwen3-FP8): x in groups of ``block_k`` columns per row, one scale
  each (``quantize_groups``, the 1x128 recipe of DeepSeek's reference), then by the number of rows (measured on
  an H200 by ``bench/fp8_gemm.py``, ``bench/RESULTS.md``): up to ``TRITON_MAX_ROWS`` rows (decode) the Triton GEMM
  of ``fp8_gemm_triton``, which multiplies each K slab's partial product by its two scales as it accumulates
  (K split over programs for the small-N projections) and reads the large weights at 1.25-1.5x their floor
  (1.3-2.1x faster than bf16 there, about bf16's speed on Llama's qkv and o); more rows take cuBLASLt's
  block-scaled GEMM (``torch.nn.functional.scaled_mm`` with the 1x128 / 128x128 recipes, where its shape limits
  allow: ``_cublas_block_applies``), 1.5-1.7x faster than bf16 where the Triton GEMM reaches only 0.3 of the FP8
  peak.

The torch functions are the exact math the kernels implement, and the tests' reference: a block-scaled product
equals the product of the dequantized operands up to the order of the fp32 sum.
"""

from __future__ import annotations

import math

import torch

from services.engine.ops.fp8_format import FP8_MAX, MIN_SCALE, dequantize_blocks, quantize

#: Rows of x up to which block-scaled projections take the Triton GEMM (more go to cuBLASLt where it applies).
TRITON_MAX_ROWS = 16
#: The one block shape cuBLASLt's block-scaled recipe takes (with K a multiple of it).
CUBLAS_BLOCK = (128, 128)
#: cuBLASLt's block recipe: torch refuses N off a multiple of 16 and a K of scale blocks off a multiple of 4 (its
#: weight-scale layout), and cuBLASLt finds no algorithm for a row count off a multiple of 4 (measured on an H200:
#: 17, 18, 31, 33, 2047 and 2049 rows refused, 20, 24 and 2056 taken; the column-major activation scales' leading
#: dimension): rows are padded to it, the other shapes take the Triton GEMM.
CUBLAS_N_ALIGN = 16
CUBLAS_ROW_ALIGN = 4
CUBLAS_K_BLOCKS_ALIGN = 4


def _kernels():
    """The Triton kernels, imported on first use: a CPU process never imports triton."""
    from services.engine.ops import fp8_gemm_triton

    return fp8_gemm_triton


def quantize_rows(x: torch.Tensor, amax_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 with one float32 scale per row ([M, 1]): ``x ~= q * scale``. ``amax_ub``: a row's absolute
    maximum is taken as at most this (fbgemm's ``activation_scale_ub``: larger values saturate)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = ((amax if amax_ub is None else amax.clamp_max(amax_ub)) / FP8_MAX).clamp_min(MIN_SCALE)
    return quantize(x, scale), scale


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 with one float32 scale per ``group`` columns of a row ([M, ceil(K / group)]); a last,
    shorter group has its own scale."""
    m, k = x.shape
    num_groups = math.ceil(k / group)
    padded = torch.nn.functional.pad(x.float(), (0, num_groups * group - k)).view(m, num_groups, group)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    q = quantize(padded, scale[..., None]).view(m, -1)[:, :k]
    return q.contiguous(), scale


def block_scaled_mm_reference(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                              block: tuple[int, int], out_dtype: torch.dtype,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``dequant(xq) @ dequant(wq).T (+ bias)`` in float32, rounded once to ``out_dtype``: what the Triton kernel
    computes, x in 1 x ``block[1]`` groups and W in ``block`` blocks."""
    x = dequantize_blocks(xq, x_scales, (1, block[1]))
    y = x @ dequantize_blocks(wq, w_scales, block).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def block_scaled_linear(x: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor, block: tuple[int, int],
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """A projection with a block-scaled e4m3 weight: x [..., K] in its dtype, out in x's dtype. CUDA runs the
    group quantization as a Triton kernel, then (``_cublas_block_applies``) cuBLASLt's block recipe or the Triton
    GEMM (blocks at least 32 wide: every real checkpoint's); elsewhere the torch reference."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x.is_cuda and _cublas_block_applies(x2, wq, block):
        F = torch.nn.functional
        m, pad = x2.shape[0], -x2.shape[0] % CUBLAS_ROW_ALIGN
        xq, xs = _kernels().quantize_groups(F.pad(x2, (0, 0, 0, pad)) if pad else x2, block[1],
                                            column_major_scales=True)
        y = F.scaled_mm(xq, wq.T, xs, F.ScalingType.BlockWise1x128, w_scales.T, F.ScalingType.BlockWise128x128,
                        bias=None if bias is None else bias.to(x.dtype), output_dtype=x.dtype)[:m]
    elif x.is_cuda and _kernels().supported_block(block):
        xq, xs = _kernels().quantize_groups(x2, block[1])
        y = _kernels().block_scaled_mm(xq, xs, wq, w_scales, block, x.dtype, bias)
    else:
        xq, xs = quantize_groups(x2, block[1])
        y = block_scaled_mm_reference(xq, xs, wq, w_scales, block, x.dtype, bias)
    return y.view(*shape[:-1], wq.shape[0])


def _cublas_block_applies(x: torch.Tensor, wq: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether cuBLASLt's block-scaled GEMM takes this product (and wins: more than ``TRITON_MAX_ROWS`` rows)."""
    k_blocks, rest = divmod(x.shape[1], CUBLAS_BLOCK[1])
    return (x.shape[0] > TRITON_MAX_ROWS and tuple(block) == CUBLAS_BLOCK and rest == 0
            and k_blocks % CUBLAS_K_BLOCKS_ALIGN == 0 and wq.shape[0] % CUBLAS_N_ALIGN == 0
            and x.dtype == torch.bfloat16 and hasattr(torch.nn.functional, "scaled_mm"))


def row_scaled_linear(x: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                      bias: torch.Tensor | None = None, amax_ub: float | None = None) -> torch.Tensor:
    """A projection with a per-tensor ([1] or []) or per-output-channel ([N] or [N, 1]) scaled e4m3 weight
    [N, K], x quantized per row: ``torch._scaled_mm`` with row-wise scales on CUDA, the float32 product of the
    dequantized operands elsewhere. ``amax_ub``: ``quantize_rows``'."""
    shape = x.shape
    n = wq.shape[0]
    x2 = x.reshape(-1, shape[-1])
    if x.is_cuda:
        xq, xs = _kernels().quantize_groups(x2, x2.shape[1], amax_ub=amax_ub)
    else:
        xq, xs = quantize_rows(x2, amax_ub)
    ws = w_scales.float().reshape(-1).expand(n).reshape(1, n).contiguous()
    if x.is_cuda:
        y = torch._scaled_mm(xq, wq.T, scale_a=xs, scale_b=ws, out_dtype=x.dtype,
                             bias=None if bias is None else bias.to(x.dtype))
    else:
        y = ((xq.float() * xs) @ (wq.float() * ws.T).T + (0.0 if bias is None else bias.float())).to(x.dtype)
    return y.view(*shape[:-1], n)
