"""Grouped expert GEMMs over MXFP4 weights (gpt-oss's experts kept as stored): CUDA runs the Triton kernel of
``mxfp4_moe_triton`` (the weights read at 4.25 bits each, decoded in registers); elsewhere the torch reference
dequantizes one expert at a time (it asks the host for the experts' row counts)."""

from __future__ import annotations

import torch

from services.engine.ops.mxfp4_format import GROUP, dequantize_mxfp4


def mxfp4_grouped_mm(a: torch.Tensor, row_of: torch.Tensor | None, blocks: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None, ends: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """``out[r] = a[row_of[r]] @ W[e].T + bias[e]`` for the rows ``r`` of expert ``e`` (rows sorted by expert,
    ``ends`` [E] each expert's end row; ``row_of`` None: ``a``'s rows are those rows). ``blocks`` [E, N, K / 2] and
    ``scales`` [E, N, K / 32] uint8 hold W [E, N, K]. ``use_triton``: force a path (default: Triton on CUDA)."""
    if use_triton if use_triton is not None else a.is_cuda:
        from services.engine.ops.mxfp4_moe_triton import mxfp4_grouped_mm as triton_mm

        return triton_mm(a, row_of, blocks, scales, bias, ends)
    return mxfp4_grouped_mm_reference(a, row_of, blocks, scales, bias, ends)


def mxfp4_grouped_mm_reference(a: torch.Tensor, row_of: torch.Tensor | None, blocks: torch.Tensor,
                               scales: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor) -> torch.Tensor:
    """The torch reference of ``mxfp4_grouped_mm``: each expert's weights dequantized, then one matmul."""
    rows = a if row_of is None else a[row_of]
    out = rows.new_empty(rows.shape[0], blocks.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            e_blocks = blocks[expert].view(blocks.shape[1], -1, GROUP // 2)
            weight = dequantize_mxfp4(e_blocks, scales[expert], rows.dtype)
            out[start:end] = torch.nn.functional.linear(rows[start:end], weight,
                                                        None if bias is None else bias[expert])
        start = end
    return out
