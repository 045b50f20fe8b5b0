"""The parsed quantization scheme of a checkpoint: a frozen value, independent of any one format's config.

Loading dequantizes with it today; a later FP8 compute path can keep the FP8 weights and their scales
instead and read the same value (which modules are FP8, how their scales are laid out, how activations
are to be quantized).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from services.engine.loading.quant.patterns import ModulePatterns


class ScaleGranularity(Enum):
    """How many scales one quantized weight has: one, one per output row, or one per 2-D block."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    BLOCK = "block"


@dataclass(frozen=True)
class WeightFormat:
    """How one group of FP8 weights is stored: e4m3 values times a float scale of this granularity.

    ``block_size`` is (rows, cols) of one scale's block for BLOCK, else None.
    """

    granularity: ScaleGranularity
    block_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if (self.granularity is ScaleGranularity.BLOCK) != (self.block_size is not None):
            raise ValueError(f"{self.granularity.value} scales take a block size only when blocked, got "
                             f"{self.block_size}")
        if self.block_size is not None and (len(self.block_size) != 2 or min(self.block_size) < 1):
            raise ValueError(f"weight block size must be two positive integers, got {self.block_size}")

    def scale_shapes(self, weight_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The scale shapes a weight of ``weight_shape`` may be stored with (leading dims: stacked experts)."""
        *lead, rows, cols = weight_shape
        lead = tuple(lead)
        if self.granularity is ScaleGranularity.TENSOR:
            return ((), (1,)) if not lead else (lead, (*lead, 1), (*lead, 1, 1))
        if self.granularity is ScaleGranularity.CHANNEL:
            return ((*lead, rows, 1), (*lead, rows))  # [rows] as some per-row checkpoints store it
        assert self.block_size is not None
        return ((*lead, math.ceil(rows / self.block_size[0]), math.ceil(cols / self.block_size[1])),)


@dataclass(frozen=True)
class WeightGroup:
    """Modules matching ``targets`` (None: every linear layer) store their weights in ``weight_format``."""

    weight_format: WeightFormat
    targets: ModulePatterns | None = None


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's ``quantization_config`` says, in the terms loading and compute need.

    ``scale_suffix``: the tensor beside ``<module>.weight`` holding its scales (``weight_scale_inv`` or
    ``weight_scale``); in every format here the weight is ``fp8 * scale``. ``unquantized``: modules kept as
    stored (``modules_to_not_convert`` / ``ignore``). ``activation_scheme``: ``dynamic`` (per-token or
    per-block scales computed at run time) or ``none`` (weight-only FP8); static scales are refused.
    ``activation_scale_ub``: fbgemm's clamp of a token row's absolute maximum before its dynamic scale is taken
    (``Fp8Linear.amax_ub``), unused when dequantizing.
    ``kv_cache_scheme``: whether the config declares FP8 KV-cache scales.
    """

    method: str
    groups: tuple[WeightGroup, ...]
    scale_suffix: str
    unquantized: ModulePatterns
    activation_scheme: str = "dynamic"
    activation_scale_ub: float | None = None
    kv_cache_scheme: bool = False

    def weight_format(self, module: str) -> WeightFormat | None:
        """The format ``module``'s weight is stored in, or None when the scheme keeps it unquantized."""
        if never_quantized(module) or self.unquantized.matches(module):
            return None
        ranked = [(0 if g.targets is None else g.targets.match_rank(module), i) for i, g in enumerate(self.groups)]
        matched = [(rank, i) for rank, i in ranked if rank is not None]  # the most specific match, then the first
        return self.groups[min(matched)[1]].weight_format if matched else None


# Module names (last one or two parts) that no FP8 format here quantizes: embeddings, the head, norms, MoE
# routers and Mamba's depthwise convolution.
_NEVER_QUANTIZED_LAST = ("embed_tokens", "lm_head", "gate", "router", "conv1d", "embedding")


def never_quantized(module: str) -> bool:
    """Whether ``module`` always stays as stored (see ``_NEVER_QUANTIZED_LAST``; any ``*norm*``)."""
    parts = module.split(".")
    last = parts[-1]
    return "norm" in last or last in _NEVER_QUANTIZED_LAST or (len(parts) > 1 and parts[-2] == "router")
