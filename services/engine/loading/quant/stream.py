"""The checkpoint's (name, tensor) stream as the model loads it: FP8 weights paired with their scales and
dequantized (or, for the modules the model computes in FP8, passed through as e4m3 with their scales in one
layout), KV-cache scales taken out, every other tensor passed through unchanged."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from services.engine.loading.quant.dequantize import FP8_DTYPES, check_scale, dequantize
from services.engine.loading.quant.kv_scales import kv_scale_of
from services.engine.loading.quant.mxfp4 import mxfp4_tensors
from services.engine.loading.quant.scheme import QuantScheme, ScaleGranularity, WeightFormat

#: The name a kept module's scale reaches the model under (``<module>`` + this): a block grid [G0, G1] as stored,
#: or one float32 scale per output row [rows] (a per-tensor scale repeated), whatever the checkpoint's suffix.
KEPT_SCALE_SUFFIX = ".weight_fp8_scale"

# Tensors some FP8 formats store that no supported scheme here uses: named, not passed on to the model.
_FOREIGN_SUFFIXES = (".activation_scale", ".input_scale", ".weight_zero_point", ".output_scale",
                     ".weight_global_scale", ".weight_packed")


def checkpoint_tensors(tensors: Iterable[tuple[str, torch.Tensor]], scheme: QuantScheme | None,
                       keep_fp8: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors the model loads: plain HF names, FP8 weights dequantized to float32 (the model's copy
    casts them once to its dtype), except those of the modules in ``keep_fp8``: their e4m3 weight, then their
    scale as ``<module>`` + ``KEPT_SCALE_SUFFIX`` (``kept_scale``). Weight and scale may come in any order and
    from different shards; only the one waiting for its partner is held. ValueError names a weight without its
    scale, a scale without its weight or of the wrong shape, and FP8 tensors in modules the scheme keeps
    unquantized. An MXFP4 scheme's stream is ``mxfp4_tensors``' (``keep_fp8``: the expert modules kept as MXFP4)."""
    if scheme is not None and scheme.method == "mxfp4":
        yield from mxfp4_tensors(tensors, scheme, keep_fp8)
        return
    pairing = _Pairing(scheme, keep_fp8) if scheme is not None else None
    for name, tensor in tensors:
        if kv_scale_of(name) is not None:
            continue
        if pairing is None:
            if tensor.dtype in (*FP8_DTYPES, torch.float8_e5m2):
                raise ValueError(f"tensor {name!r} is {tensor.dtype}, but config.json has no quantization_config "
                                 "saying how it is scaled")
            yield name, tensor
            continue
        yield from pairing.add(name, tensor)
    if pairing is not None:
        pairing.finish()


class _Pairing:
    """Holds FP8 weights until their scales arrive and scales until their weights do."""

    def __init__(self, scheme: QuantScheme, keep_fp8: frozenset[str]) -> None:
        self.scheme = scheme
        self.keep_fp8 = keep_fp8
        self.scale_suffix = "." + scheme.scale_suffix
        self.weights: dict[str, tuple[str, torch.Tensor]] = {}  # module -> its FP8 weight, waiting
        self.scales: dict[str, tuple[str, torch.Tensor]] = {}  # module -> its scale, waiting
        self.plain: set[str] = set()  # modules whose weight passed through unquantized

    def add(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith(self.scale_suffix):
            module = name.removesuffix(self.scale_suffix)
            self._check_quantized(module, name)
            if module in self.plain:
                raise ValueError(f"scale tensor {name!r} belongs to {module}.weight, which is not stored as FP8")
            self.scales[module] = (name, tensor)
        elif name.endswith(_FOREIGN_SUFFIXES):
            raise ValueError(f"tensor {name!r} is not used by a {self.scheme.method} checkpoint of this scheme "
                             f"(activation {self.scheme.activation_scheme}, scales in *{self.scale_suffix})")
        elif name.endswith(".weight") and tensor.dtype in (*FP8_DTYPES, torch.float8_e5m2):
            if tensor.dtype not in FP8_DTYPES:
                raise ValueError(f"tensor {name!r} is {tensor.dtype}: only e4m3 FP8 weights are supported")
            module = name.removesuffix(".weight")
            self._check_quantized(module, name)
            self.weights[module] = (name, tensor)
        else:
            if tensor.dtype in (*FP8_DTYPES, torch.float8_e5m2):
                raise ValueError(f"tensor {name!r} is {tensor.dtype}, but only <module>.weight tensors are FP8 "
                                 f"in a {self.scheme.method} checkpoint (stacked experts are not supported as FP8)")
            if name.endswith(".weight"):
                module = name.removesuffix(".weight")
                if module in self.scales:
                    raise ValueError(f"scale tensor {self.scales[module][0]!r} belongs to {name}, which is "
                                     f"stored as {tensor.dtype}, not FP8")
                self.plain.add(module)
            yield name, tensor
            return
        if module in self.weights and module in self.scales:
            yield from self._paired(module)

    def _check_quantized(self, module: str, name: str) -> None:
        if self.scheme.weight_format(module) is None:
            raise ValueError(f"tensor {name!r} stores {module} in FP8, but the {self.scheme.method} scheme keeps "
                             f"{module} unquantized (never quantized, or in the config's skip list)")

    def _paired(self, module: str) -> Iterator[tuple[str, torch.Tensor]]:
        name, weight = self.weights.pop(module)
        scale_name, scale = self.scales.pop(module)
        fmt = self.scheme.weight_format(module)
        assert fmt is not None  # checked when each arrived
        if weight.dim() < 2:
            raise ValueError(f"FP8 tensor {name!r} has shape {list(weight.shape)}; a quantized weight is a matrix")
        check_scale(scale_name, tuple(weight.shape), scale, fmt)
        if module in self.keep_fp8 and weight.dim() == 2:
            yield name, weight
            yield module + KEPT_SCALE_SUFFIX, kept_scale(scale, weight.shape[0], fmt)
            return
        yield name, dequantize(weight, scale, fmt)

    def finish(self) -> None:
        if self.weights:
            name = next(iter(self.weights.values()))[0]
            raise ValueError(f"FP8 weight {name!r} has no scale tensor "
                             f"{name.removesuffix('.weight')}{self.scale_suffix!s} in the checkpoint")
        if self.scales:
            name = next(iter(self.scales.values()))[0]
            raise ValueError(f"scale tensor {name!r} has no weight {name.removesuffix(self.scale_suffix)}.weight "
                             "in the checkpoint")


def kept_scale(scale: torch.Tensor, rows: int, fmt: WeightFormat) -> torch.Tensor:
    """A checked scale of a [rows, cols] weight as an FP8 projection holds it: float32, a block grid [G0, G1] as
    stored, anything else one per row ([rows]: a per-tensor scale repeated, so fused parts stay exact)."""
    s = scale.to(torch.float32)
    if fmt.granularity is ScaleGranularity.BLOCK:
        return s
    return s.reshape(-1).expand(rows).contiguous()
