"""FP8 weight times its scales, in float32: the exact reference computation of every format here."""

from __future__ import annotations

import torch

from services.engine.loading.quant.scheme import ScaleGranularity, WeightFormat

FP8_DTYPES = (torch.float8_e4m3fn,)


def check_scale(name: str, weight_shape: tuple[int, ...], scale: torch.Tensor, fmt: WeightFormat) -> None:
    """ValueError naming ``name`` (the scale tensor) when its shape does not fit the weight's."""
    shapes = fmt.scale_shapes(weight_shape)
    if tuple(scale.shape) not in shapes:
        wanted = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"scale tensor {name!r} has shape {list(scale.shape)}; a {fmt.granularity.value} scale "
                         f"of a {list(weight_shape)} weight is {wanted}")
    if not scale.is_floating_point():
        raise ValueError(f"scale tensor {name!r} is {scale.dtype}, expected a float tensor")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """``weight`` (e4m3, [..., rows, cols]) scaled by ``scale`` in ``fmt``'s layout, as float32.

    A block grid is padded out to whole blocks (the last block row/column of a ragged edge covers fewer
    elements), multiplied block by block, and cut back to the weight's shape.
    """
    w = weight.to(torch.float32, copy=True)  # a tensor of its own: scaled in place below
    s = scale.to(torch.float32)
    if fmt.granularity is not ScaleGranularity.BLOCK:
        # TENSOR: a scalar (or one per stacked expert); CHANNEL: [..., rows, 1] or [..., rows]. Both broadcast.
        return w.mul_(s.reshape(*s.shape, *([1] * (w.dim() - s.dim()))))
    assert fmt.block_size is not None
    b0, b1 = fmt.block_size
    *lead, rows, cols = w.shape
    g0, g1 = s.shape[-2], s.shape[-1]
    grid = s.reshape(*lead, g0, 1, g1, 1)
    if (rows, cols) == (g0 * b0, g1 * b1):  # whole blocks: no copy
        w.view(*lead, g0, b0, g1, b1).mul_(grid)
        return w
    padded = torch.zeros(*lead, g0 * b0, g1 * b1, dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w
    padded.view(*lead, g0, b0, g1, b1).mul_(grid)
    return padded[..., :rows, :cols].contiguous()
