"""MXFP4 (OCP microscaling FP4) as gpt-oss stores its experts: e2m1 values, two a byte with the low nibble first,
and one E8M0 exponent (bias 127) per 32 values: value = e2m1 * 2 ** (scale - 127)."""

from __future__ import annotations

import torch

#: The 16 e2m1 codes' values: sign bit 8, then exponent and mantissa (0, 0.5, 1, 1.5, 2, 3, 4, 6).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per E8M0 scale
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents -> [..., G * 32] values (stored layout, ``dtype``)."""
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # low nibble first
    values = lut[codes] * torch.exp2(scales.to(torch.float32) - SCALE_BIAS).to(dtype)[..., None]
    return values.flatten(-2)
