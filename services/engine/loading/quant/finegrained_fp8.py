"""``quant_method: "fp8"`` (DeepSeek-V3/R1, Qwen3-*-FP8): e4m3 weights with a float32 ``weight_scale_inv``
per ``weight_block_size`` block of each weight (rounded up at a ragged edge), or one per weight when it is null.
A config without the field means 128 x 128 blocks, as transformers' ``FineGrainedFP8Config`` reads it."""

from __future__ import annotations

from typing import Any

from services.engine.loading.quant.patterns import ModulePatterns, string_list
from services.engine.loading.quant.scheme import QuantScheme, ScaleGranularity, WeightFormat, WeightGroup


def parse_finegrained_fp8(config: dict[str, Any]) -> QuantScheme:
    """Refuses static activation scales, ue8m0 scales, FP4 experts and FP8 embeddings by field name."""
    activation = str(config.get("activation_scheme", "dynamic")).lower()
    if activation != "dynamic":
        raise ValueError(f"quantization_config field 'activation_scheme' is {activation!r}: only dynamic FP8 "
                         "activation scaling is supported (static activation_scale tensors are not)")
    if config.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config field 'fmt' is {config['fmt']!r}: only e4m3 FP8 is supported")
    if config.get("scale_fmt") not in (None, "float"):
        raise ValueError(f"quantization_config field 'scale_fmt' is {config['scale_fmt']!r}: only float32 "
                         "scales are supported (not ue8m0)")
    if config.get("expert_dtype") not in (None, "fp8"):
        raise ValueError(f"quantization_config field 'expert_dtype' is {config['expert_dtype']!r}: only FP8 "
                         "experts are supported")
    if config.get("modules_to_convert"):
        raise ValueError("quantization_config field 'modules_to_convert' is set: FP8 embeddings are not supported")
    skip = config.get("modules_to_not_convert")
    skip = config.get("ignored_layers") if skip is None else skip
    return QuantScheme(
        method="fp8",
        groups=(WeightGroup(_weight_format(config.get("weight_block_size", DEFAULT_BLOCK))),),
        scale_suffix="weight_scale_inv",
        unquantized=ModulePatterns(names=string_list(skip, "modules_to_not_convert")),
        activation_scheme=activation,
    )


#: transformers' default ``weight_block_size`` (the DeepSeek-V3 recipe's).
DEFAULT_BLOCK = (128, 128)


def _weight_format(block_size: object) -> WeightFormat:
    if block_size is None:
        return WeightFormat(ScaleGranularity.TENSOR)
    if (not isinstance(block_size, list | tuple) or len(block_size) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_size)):
        raise ValueError(f"quantization_config field 'weight_block_size' must be two positive integers, "
                         f"got {block_size!r}")
    return WeightFormat(ScaleGranularity.BLOCK, (block_size[0], block_size[1]))
