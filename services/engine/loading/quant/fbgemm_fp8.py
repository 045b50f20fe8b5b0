"""``quant_method: "fbgemm_fp8"`` (Meta's Llama-3.1-405B-FP8): e4m3 weights with one float32 ``weight_scale``
per output row ([rows, 1]); activations are quantized per row at run time, their scale clamped to
``activation_scale_ub``."""

from __future__ import annotations

from typing import Any

from services.engine.loading.quant.patterns import ModulePatterns, string_list
from services.engine.loading.quant.scheme import QuantScheme, ScaleGranularity, WeightFormat, WeightGroup


def parse_fbgemm_fp8(config: dict[str, Any]) -> QuantScheme:
    ub = config.get("activation_scale_ub", 1200.0)
    if isinstance(ub, bool) or not isinstance(ub, int | float) or ub <= 0:
        raise ValueError(f"quantization_config field 'activation_scale_ub' must be a positive number, got {ub!r}")
    return QuantScheme(
        method="fbgemm_fp8",
        groups=(WeightGroup(WeightFormat(ScaleGranularity.CHANNEL)),),
        scale_suffix="weight_scale",
        unquantized=ModulePatterns(names=string_list(config.get("modules_to_not_convert"),
                                                     "modules_to_not_convert")),
        activation_scale_ub=float(ub),
    )
