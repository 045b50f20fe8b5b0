"""Per-layer scales of an FP8 KV cache: what each layer's K and V are divided by before they are stored.

An FP8 (e4m3) cache stores ``saturate(x / scale)`` (``ops.kv_fp8``) and attention reads
``fp8 * scale``; the scale lets a layer whose K or V runs past e4m3's range (+-448) keep its
magnitude. Scales come from the checkpoint (``ModelSource.kv_scales``: its ``k_scale``/``v_scale``);
a layer the checkpoint gives none scales by 1.0, as vLLM does. An MLA layer stores one latent row
per token and uses its layer's ``k_scale`` for the whole row.

The scales are fixed for the engine's life, so decode and prefill CUDA graphs bake them as
constants at capture. Two engines must agree on them to exchange FP8 blocks (a block's bytes mean
nothing without its scale): ``RankRuntime.kv_scales`` is where a compatibility check reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.kv.spec.kv_quant import DEFAULT_SCALE, is_quantized

UNIT_SCALE = (DEFAULT_SCALE, DEFAULT_SCALE)


@dataclass(frozen=True)
class KVScales:
    """``(k_scale, v_scale)`` of every layer id ``0 .. num_layers - 1``, and the cache dtype they apply to.

    For a cache that is not FP8 every scale is 1.0 (nothing is quantized, so nothing is scaled).
    """

    dtype: str
    layers: tuple[tuple[float, float], ...]

    @classmethod
    def for_cache(cls, dtype: str, num_layers: int, checkpoint: Mapping[int, tuple[float, float]]) -> KVScales:
        """The scales a cache of ``dtype`` uses: the checkpoint's (absent layer: 1.0) when FP8, else all 1.0.

        ValueError for a scale that is not a positive finite number or a layer id the model does not have.
        """
        for layer, pair in checkpoint.items():
            if not 0 <= layer < num_layers:
                raise ValueError(f"KV scale given for layer {layer}; the model has layers 0..{num_layers - 1}")
            if len(pair) != 2 or not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in pair):
                raise ValueError(f"KV scales of layer {layer} must be two positive finite numbers, got {pair!r}")
        if not is_quantized(dtype):
            return cls(dtype, (UNIT_SCALE,) * num_layers)
        return cls(dtype, tuple(tuple(float(s) for s in checkpoint.get(i, UNIT_SCALE)) for i in range(num_layers)))

    @property
    def quantized(self) -> bool:
        """Whether the cache stores FP8 (values divided by their scale and rounded to e4m3)."""
        return is_quantized(self.dtype)

    def of(self, layer: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of ``layer``; an MLA layer's latent rows use the first."""
        return self.layers[layer]
