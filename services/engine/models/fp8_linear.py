"""FP8 projections kept as stored: an e4m3 weight, its float32 scales and a bias, computed by ``ops.fp8_gemm``.

An FP8 checkpoint's weight is half the bytes of bf16 and FP8 tensor cores run at twice the rate, so a module the
checkpoint quantizes keeps its e4m3 weight instead of being widened at load. Scales are either a grid of 2-D
blocks (``block`` set: DeepSeek/Qwen3's 128 x 128) or one per output row; a per-tensor scale is stored per row,
so that fused q/k/v or gate/up whose parts have different per-tensor scales stay exact.

A model says where each HF module's rows go (``Fp8Target``: the fused module, then per HF part the source rows
this rank takes, in destination order); loading (``services.engine.loading.fp8_model``) decides from the
checkpoint's scheme which targets can stay FP8, swaps their ``Linear`` for an ``Fp8Linear`` and records a
``ScaleSlot`` per HF module, which places the checkpoint's scale in the fused grid (``place``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from services.engine.ops.fp8_format import FP8_DTYPE
from services.engine.ops.fp8_gemm import block_scaled_linear, row_scaled_linear


class Fp8Linear(nn.Module):
    """``y = x @ dequant(W).T (+ b)`` with W e4m3 [out, in]: activations quantized on the fly (1 x ``block[1]``
    groups for block scales, one scale per token row otherwise), output in x's dtype. No host syncs: a forward
    can be captured in a CUDA graph."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.block = block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        scale_shape = ((math.ceil(out_features / block[0]), math.ceil(in_features / block[1])) if block is not None
                       else (out_features,))
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.amax_ub: float | None = None  # fbgemm's activation_scale_ub (row scales only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block is not None:
            return block_scaled_linear(x, self.weight, self.weight_scale, self.block, self.bias)
        return row_scaled_linear(x, self.weight, self.weight_scale, self.bias, self.amax_ub)

    def extra_repr(self) -> str:
        scales = f"blocks {self.block[0]}x{self.block[1]}" if self.block is not None else "per-row scales"
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, e4m3, {scales}, bias={self.bias is not None}"


@dataclass(frozen=True)
class Fp8Part:
    """One HF module feeding a (possibly fused) projection: ``rows`` are the indices of the HF weight's rows this
    rank holds, in the order they sit in the projection (a shard, a rope reordering, or all of them)."""

    hf_module: str
    rows: torch.Tensor


@dataclass(frozen=True)
class Fp8Target:
    """A projection that may run in FP8: ``path`` is its module path in the model (``layers.0.self_attn.qkv_proj``),
    ``parts`` its HF modules stacked by rows, ``col_shard`` whether this rank holds a TP shard of its columns (a
    row-parallel projection: ``o_proj``, ``down_proj``) with ``tp`` = (rank, size)."""

    path: str
    parts: tuple[Fp8Part, ...]
    col_shard: bool = False
    tp: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class ScaleSlot:
    """Where one HF module's scales go in an ``Fp8Linear``: its part's rows start at ``offset`` of the projection."""

    module: Fp8Linear
    offset: int
    rows: torch.Tensor
    col_shard: bool
    tp: tuple[int, int]

    def place(self, scale: torch.Tensor) -> None:
        """Copy this rank's scales of an HF module (block grid [G0, G1], or one per row [rows]) into place."""
        dest, block = self.module.weight_scale, self.module.block
        rows = self.rows.to(scale.device)
        with torch.no_grad():
            if block is None:
                dest[self.offset: self.offset + len(rows)].copy_(scale[rows])
                return
            b0, b1 = block
            first, last = self.offset // b0, (self.offset + len(rows) - 1) // b0
            # Each destination block row takes the source block of its first row (fp8_model checked they agree).
            starts = torch.arange(first, last + 1, device=rows.device) * b0 - self.offset
            grid = scale[rows[starts.clamp(min=0)] // b0]
            if self.col_shard and self.tp[1] > 1:
                width = dest.shape[1]
                grid = grid[:, self.tp[0] * width: (self.tp[0] + 1) * width]
            dest[first: last + 1].copy_(grid)


def row_range(start: int, stop: int) -> torch.Tensor:
    """Rows ``start .. stop - 1`` of an HF weight, as an ``Fp8Part``'s ``rows``."""
    return torch.arange(start, stop)
