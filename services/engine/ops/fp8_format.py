"""The e4m3 format every FP8 path shares: its constants and its one rounding rule.

Quantize: ``saturate(x / scale)`` -- computed in float32 with IEEE division, clamped to e4m3's largest finite
value (+-448, so an outlier becomes 448 rather than NaN), cast once. Dequantize: ``q.float() * scale``, cast once
to the compute dtype. The KV cache (``kv_fp8``), the FP8 projections (``fp8_gemm``) and the Triton kernels
(``fp8_gemm_triton``, ``triton_ops``' K/V write, the paged attention kernels) all follow it; the kernels divide
with ``div_rn`` for the same reason ``quantize`` divides by a device tensor on CUDA (below).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
#: e4m3's largest finite value: a scale maps a row's (or a group's) absolute maximum onto it.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: A zero row gets this scale rather than 0, so dequantizing it is 0 and not NaN.
MIN_SCALE = 1e-12
#: Triton compiles e4m3 (``fp8e4nv``) for compute capability 8.9 (Ada) and later.
MIN_FP8_CAPABILITY = (8, 9)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def fp8_kernels_run_on(device: torch.device) -> bool:
    """Whether Triton kernels can take e4m3 tensors on ``device`` (its interpreter on CPU; sm_89+ on CUDA): older
    GPUs run the torch paths, whose float8 casts work everywhere."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= MIN_FP8_CAPABILITY


def saturate(x: torch.Tensor) -> torch.Tensor:
    """float32 values clamped to +-448 and rounded to e4m3."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``saturate(x / scale)`` in float32 (``scale`` a number, or a tensor broadcasting against x).

    The division is IEEE's on every device, as the Triton kernels' ``div_rn``: on CUDA a tensor divided by a
    Python number is multiplied by its reciprocal instead, off by an ulp at times, which can tip an e4m3
    rounding; a 0-dim device tensor divisor keeps the true division (a fill, no host sync: graph-safe).
    """
    if not isinstance(scale, torch.Tensor) and x.device.type != "cpu":
        scale = torch.full((), scale, dtype=torch.float32, device=x.device)
    return saturate(x.float() / scale)


def dequantize(q: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in float32, rounded once to ``dtype`` (as the kernels apply scales in fp32 registers)."""
    return (q.float() * scale).to(dtype)


def expand_block_scales(scales: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A [ceil(rows / b0), ceil(cols / b1)] grid of block scales spread to one per element ([rows, cols])."""
    return scales.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 values of a block-scaled e4m3 matrix (a weight [N, K] with 2-D blocks, or an activation [M, K] with
    1 x block groups); the grid must be exactly ``ceil(N / b0) x ceil(K / b1)``."""
    rows, cols = q.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scales.shape) != grid:
        raise ValueError(f"block scales of a {rows}x{cols} matrix in {block[0]}x{block[1]} blocks must be "
                         f"{grid[0]}x{grid[1]}, got {tuple(scales.shape)}")
    return q.float() * expand_block_scales(scales.float(), rows, cols, block)
