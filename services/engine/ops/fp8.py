"""FP8 (e4m3) rounding of KV values: the one definition every write and read path follows.

Write: ``fp8 = saturate(x / scale)`` where saturate clamps to e4m3's largest finite value (+-448,
so an outlier becomes 448 rather than NaN), computed in float32 and cast once. Read:
``x = fp8.to(compute dtype) * scale``. The Triton kernels (``ops.triton_ops``,
``attention.triton_kernels``) do the same steps in float32 registers; the torch functions here are
what the CPU path runs and what the tests' HF reference reproduces.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` saturated to +-448 and rounded to e4m3 (float32 inside).

    The division is IEEE's on every device, as the Triton write does it (``div_rn``): on CUDA a tensor divided
    by a Python number is multiplied by its reciprocal instead, off by an ulp at times, which can tip an e4m3
    rounding; a 0-dim device tensor divisor keeps the true division (a fill, no host sync: graph-safe).
    """
    divisor = scale if x.device.type == "cpu" else torch.full((), scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as ``cache`` stores it: quantized when the cache is FP8, else ``x`` itself (copied as it is)."""
    return quantize(x, scale) if is_fp8(cache) else x


def from_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values in the compute ``dtype``: an FP8 tensor dequantized (``x.to(dtype) * scale``), else ``x``."""
    return x.to(dtype) * scale if is_fp8(x) else x


def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a cache read of ``x`` after an FP8 write returns, in ``x``'s dtype: ``from_cache(quantize(x))``."""
    return from_cache(quantize(x, scale), scale, x.dtype)
