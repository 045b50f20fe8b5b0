"""``quant_method: "compressed-tensors"`` with ``format: "float-quantized"`` (llm-compressor's FP8 checkpoints):
each config group names its target modules and its weights' scheme (8-bit float, symmetric, one scale per
tensor, per output channel or per 2-D block, stored as ``weight_scale``); ``ignore`` lists modules kept as
stored (names, or ``re:`` regexes)."""

from __future__ import annotations

from typing import Any

from services.engine.loading.quant.patterns import ModulePatterns, string_list
from services.engine.loading.quant.scheme import QuantScheme, ScaleGranularity, WeightFormat, WeightGroup

_FORMAT = "float-quantized"
_STRATEGIES = {"tensor": ScaleGranularity.TENSOR, "channel": ScaleGranularity.CHANNEL,
               "block": ScaleGranularity.BLOCK}


def parse_compressed_tensors(config: dict[str, Any]) -> QuantScheme:
    """Refuses other formats, non-FP8 or asymmetric weights, static or output activations, by field name."""
    fmt = config.get("format")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config field 'config_groups' must be a non-empty mapping of groups")
    parsed = tuple(_group(name, group, fmt) for name, group in groups.items())
    kv = config.get("kv_cache_scheme")
    if kv is not None:
        _check_fp8(kv, "kv_cache_scheme")
    weight_only = all(g.get("input_activations") is None for g in groups.values())
    return QuantScheme(
        method="compressed-tensors",
        groups=parsed,
        scale_suffix="weight_scale",
        unquantized=patterns(string_list(config.get("ignore"), "ignore")),
        activation_scheme="none" if weight_only else "dynamic",
        kv_cache_scheme=kv is not None,
    )


def patterns(entries: tuple[str, ...]) -> ModulePatterns:
    """compressed-tensors' module list: ``re:<regex>`` entries, ``Linear`` (every linear layer), names."""
    regexes = tuple(e[3:] for e in entries if e.startswith("re:"))
    names = tuple(e for e in entries if not e.startswith("re:") and e != "Linear")
    return ModulePatterns(names=names, regexes=regexes, any_linear="Linear" in entries)


def _group(name: str, group: object, fmt: object) -> WeightGroup:
    where = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise ValueError(f"quantization_config field {where!r} must be a mapping, got {group!r}")
    group_fmt = group.get("format") or fmt
    if group_fmt != _FORMAT:
        raise ValueError(f"quantization_config format {group_fmt!r} ({where}): only compressed-tensors' "
                         f"{_FORMAT!r} FP8 format is supported")
    weights = group.get("weights")
    _check_fp8(weights, f"{where}.weights")
    if weights.get("symmetric") is False:
        raise ValueError(f"quantization_config field '{where}.weights.symmetric' is false: asymmetric FP8 "
                         "weights (zero points) are not supported")
    strategy = weights.get("strategy")
    if strategy not in _STRATEGIES:
        raise ValueError(f"quantization_config field '{where}.weights.strategy' is {strategy!r}: only "
                         f"{', '.join(_STRATEGIES)} FP8 weight scales are supported")
    block = weights.get("block_structure") if strategy == "block" else None
    if strategy == "block" and (not isinstance(block, list) or len(block) != 2):
        raise ValueError(f"quantization_config field '{where}.weights.block_structure' must be two positive "
                         f"integers for block scales, got {block!r}")
    _check_activations(group, where)
    targets = string_list(group.get("targets"), f"{where}.targets")
    if not targets:
        raise ValueError(f"quantization_config field '{where}.targets' is empty: the group quantizes nothing")
    return WeightGroup(WeightFormat(_STRATEGIES[strategy], tuple(block) if block else None), patterns(targets))


def _check_fp8(args: object, where: str) -> None:
    if not isinstance(args, dict):
        raise ValueError(f"quantization_config field {where!r} must be a mapping, got {args!r}")
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise ValueError(f"quantization_config field {where!r} is {args.get('num_bits')}-bit "
                         f"{args.get('type')}: only 8-bit float (FP8) is supported")


def _check_activations(group: dict[str, Any], where: str) -> None:
    if group.get("output_activations") is not None:
        raise ValueError(f"quantization_config field '{where}.output_activations' is set: quantized outputs "
                         "are not supported")
    inputs = group.get("input_activations")
    if inputs is None:
        return  # weight-only FP8
    _check_fp8(inputs, f"{where}.input_activations")
    if not inputs.get("dynamic"):
        raise ValueError(f"quantization_config field '{where}.input_activations.dynamic' is false: static FP8 "
                         "activation scales (input_scale tensors) are not supported; only dynamic ones are")
