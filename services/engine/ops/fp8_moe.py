"""Grouped expert GEMMs over block-scaled FP8 weights (DeepSeek-V3's and Qwen3-FP8's routed experts kept as
stored): half the bytes of bf16 experts a decode step reads, and FP8 tensor cores for prefill.

The activation is quantized the way the dense FP8 projections quantize it (``fp8_gemm.quantize_groups``: one scale
per token and ``block[1]`` columns, DeepSeek's 1 x 128 recipe), once per token before the rows are gathered; then
CUDA runs the Triton kernel of ``fp8_moe_triton`` and elsewhere the torch reference dequantizes one expert at a
time and multiplies in float32 (``fp8_gemm.block_scaled_mm_reference``; it asks the host for the experts' row
counts). Both compute the product of the dequantized operands, up to the order of the fp32 sum.
"""

from __future__ import annotations

import torch

from services.engine.ops.fp8_gemm import block_scaled_mm_reference, quantize_groups


def fp8_grouped_mm(x: torch.Tensor, row_of: torch.Tensor | None, wq: torch.Tensor, w_scales: torch.Tensor,
                   block: tuple[int, int], ends: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """``out[r] = q(x)[row_of[r]] @ dequant(W[e]).T`` in x's dtype for the rows ``r`` of expert ``e`` (rows sorted
    by expert, ``ends`` [E] each expert's end row; ``row_of`` None: ``x``'s rows are those rows). ``wq`` [E, N, K]
    e4m3 with ``w_scales`` [E, ceil(N / block[0]), ceil(K / block[1])] float32; ``q`` the 1 x ``block[1]`` group
    quantization. ``use_triton``: force a path (default: Triton on CUDA)."""
    if use_triton if use_triton is not None else x.is_cuda:
        from services.engine.ops import fp8_gemm_triton, fp8_moe_triton

        xq, xs = fp8_gemm_triton.quantize_groups(x, block[1])
        return fp8_moe_triton.fp8_grouped_mm(xq, xs, row_of, wq, w_scales, block, ends, x.dtype)
    xq, xs = quantize_groups(x, block[1])
    return fp8_grouped_mm_reference(xq, xs, row_of, wq, w_scales, block, ends, x.dtype)


def fp8_grouped_mm_reference(xq: torch.Tensor, x_scales: torch.Tensor, row_of: torch.Tensor | None,
                             wq: torch.Tensor, w_scales: torch.Tensor, block: tuple[int, int], ends: torch.Tensor,
                             out_dtype: torch.dtype) -> torch.Tensor:
    """The torch reference of ``fp8_moe_triton.fp8_grouped_mm`` (quantized activations in, the same arguments):
    each expert's rows times its dequantized weight in float32, rounded once to ``out_dtype``."""
    rows, scales = (xq, x_scales) if row_of is None else (xq[row_of], x_scales[row_of])
    out = torch.empty(rows.shape[0], wq.shape[1], dtype=out_dtype, device=xq.device)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = block_scaled_mm_reference(rows[start:end], scales[start:end], wq[expert],
                                                       w_scales[expert], block, out_dtype)
        start = end
    return out
