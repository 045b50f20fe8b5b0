"""FP8 (e4m3) KV values: how a cache write rounds them and a read gives them back (``fp8_format``'s rule).

Write: ``quantize(x, layer scale)``; read: ``dequantize(fp8, scale, compute dtype)``. The Triton kernels
(``ops.triton_ops``, ``attention.triton_kernels``) do the same steps in float32 registers; the torch functions
here are what the CPU path runs and what the tests' HF reference reproduces.
"""

from __future__ import annotations

import torch

from services.engine.ops.fp8_format import dequantize, is_fp8, quantize


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as ``cache`` stores it: quantized when the cache is FP8, else ``x`` itself (copied as it is)."""
    return quantize(x, scale) if is_fp8(cache) else x


def from_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values in the compute ``dtype``: an FP8 tensor dequantized (in float32, then cast), else ``x``."""
    return dequantize(x, scale, dtype) if is_fp8(x) else x


def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a cache read of ``x`` after an FP8 write returns, in ``x``'s dtype: ``from_cache(quantize(x))``."""
    return from_cache(quantize(x, scale), scale, x.dtype)
