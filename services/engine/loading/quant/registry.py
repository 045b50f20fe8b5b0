"""``quantization_config`` -> QuantScheme: one parser per supported method (the FP8 formats and MXFP4); every other
method is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.engine.loading.quant.compressed_tensors import parse_compressed_tensors
from services.engine.loading.quant.fbgemm_fp8 import parse_fbgemm_fp8
from services.engine.loading.quant.finegrained_fp8 import parse_finegrained_fp8
from services.engine.loading.quant.mxfp4 import parse_mxfp4
from services.engine.loading.quant.scheme import QuantScheme

PARSERS: dict[str, Callable[[dict[str, Any]], QuantScheme]] = {
    "fp8": parse_finegrained_fp8,
    "compressed-tensors": parse_compressed_tensors,
    "fbgemm_fp8": parse_fbgemm_fp8,
    "mxfp4": parse_mxfp4,
}


def parse_quantization(config: dict[str, Any]) -> QuantScheme | None:
    """The scheme of a config.json's ``quantization_config`` (None: the checkpoint is not quantized)."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"config field 'quantization_config' must be a mapping, got {quant!r}")
    method = quant.get("quant_method")
    if method not in PARSERS:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported; supported: "
                         f"{', '.join(PARSERS)}")
    return PARSERS[method](quant)
