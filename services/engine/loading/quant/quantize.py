"""Weights to FP8 in a scheme's format: the quantizer of the ``dummy:*-fp8`` presets (and of test checkpoints).

Each block / row / tensor is divided by its absolute maximum over 448 (e4m3's largest value), saturated and cast:
``weight ~= e4m3 * scale`` with the scale stored as the format stores it (``WeightFormat.scale_shapes``' first
shape), in float32.
"""

from __future__ import annotations

import math

import torch

from services.engine.loading.quant.scheme import ScaleGranularity, WeightFormat
from services.engine.ops.fp8_format import FP8_MAX, MIN_SCALE, quantize


def quantize_weight(weight: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale) of a [rows, cols] weight in ``fmt``."""
    if weight.dim() != 2:
        raise ValueError(f"only a matrix is quantized here, got a weight of shape {list(weight.shape)}")
    w = weight.float()
    rows, cols = w.shape
    if fmt.granularity is ScaleGranularity.TENSOR:
        scale = (w.abs().amax() / FP8_MAX).clamp_min(MIN_SCALE)
        return quantize(w, scale), scale
    if fmt.granularity is ScaleGranularity.CHANNEL:
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
        return quantize(w, scale), scale
    assert fmt.block_size is not None
    b0, b1 = fmt.block_size
    g0, g1 = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = torch.nn.functional.pad(w, (0, g1 * b1 - cols, 0, g0 * b0 - rows)).view(g0, b0, g1, b1)
    scale = (padded.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
    q = quantize(padded, scale[:, None, :, None])
    return q.view(g0 * b0, g1 * b1)[:rows, :cols].contiguous(), scale
