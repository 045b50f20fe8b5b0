"""``quant_method: "mxfp4"`` (gpt-oss): the experts' projections as OCP microscaling FP4.

A projection ``P`` of HF shape [E, in, out] is stored as ``P_blocks`` [E, out, in / 32, 16] uint8 -- two e2m1
values a byte, the low nibble first -- and ``P_scales`` [E, out, in / 32] uint8, one E8M0 exponent (bias 127) per
32 values: value = e2m1 * 2 ** (scale - 127). Every other tensor is stored as it is (``modules_to_not_convert``).

Loading dequantizes (``mxfp4_tensors``): each pair becomes ``P`` in HF's layout and dtype bfloat16, which holds
every e2m1 value times any power of two of the E8M0 range exactly -- unless the model keeps the experts as stored
(``GptOssExperts`` with ``mxfp4``: ``ops.mxfp4_moe`` computes on them), when the pair passes through.
``quantize_mxfp4`` is the inverse, for dummy presets (``dummy:gpt-oss-20b``) and tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from services.engine.loading.quant.patterns import ModulePatterns, string_list
from services.engine.loading.quant.scheme import QuantScheme
from services.engine.ops.mxfp4_format import E2M1_VALUES, GROUP, SCALE_BIAS, dequantize_mxfp4

__all__ = ["dequantize_mxfp4", "mxfp4_tensors", "parse_mxfp4", "quantize_mxfp4", "quantized_checkpoint"]

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
#: The tensors gpt-oss's MXFP4 checkpoints quantize: every layer's stacked experts.
QUANTIZED_TENSORS = (".experts.gate_up_proj", ".experts.down_proj")


def parse_mxfp4(config: dict[str, Any]) -> QuantScheme:
    """The scheme of an MXFP4 ``quantization_config``: no FP8 groups; the skip list as ``unquantized``."""
    skip = string_list(config.get("modules_to_not_convert"), "modules_to_not_convert")
    return QuantScheme(method="mxfp4", groups=(), scale_suffix=SCALES_SUFFIX.lstrip("_"),
                       unquantized=ModulePatterns(names=skip), activation_scheme="none")


def quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] (K a multiple of 32) -> (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8): each group's
    exponent the smallest that fits its largest magnitude under 6, each value rounded to the nearest e2m1."""
    *lead, k = values.shape
    if k % GROUP:
        raise ValueError(f"MXFP4 groups {GROUP} values: a last dimension of {k} does not divide")
    groups = values.float().reshape(*lead, k // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax / 6.0)).nan_to_num(0.0, neginf=-SCALE_BIAS).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=values.device)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    codes = codes + 8 * ((scaled < 0) & (codes > 0))
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + SCALE_BIAS).to(torch.uint8)


def is_quantized_tensor(name: str) -> bool:
    """Whether an MXFP4 checkpoint stores ``name`` (an HF parameter name) as blocks and scales."""
    return name.endswith(QUANTIZED_TENSORS)


def quantized_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors as an MXFP4 checkpoint stores them: the experts' [E, in, out] projections as
    ``_blocks``/``_scales`` of their [E, out, in] transpose, the rest unchanged."""
    for name, tensor in tensors:
        if not is_quantized_tensor(name):
            yield name, tensor
            continue
        pairs = [quantize_mxfp4(expert.t()) for expert in tensor]  # one expert at a time: bounded temporaries
        yield name + BLOCKS_SUFFIX, torch.stack([blocks for blocks, _ in pairs])
        yield name + SCALES_SUFFIX, torch.stack([scales for _, scales in pairs])


def mxfp4_tensors(tensors: Iterable[tuple[str, torch.Tensor]], scheme: QuantScheme,
                  keep: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors the model loads from an MXFP4 checkpoint: each ``P_blocks``/``P_scales`` pair as ``P``,
    dequantized and transposed back to HF's [E, in, out], or as stored when ``P``'s module is in ``keep`` (a model
    computing on MXFP4); everything else as stored. ValueError names a half without its partner, a pair of the
    wrong dtype or shapes, and blocks of a module the config keeps unquantized."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        suffix = BLOCKS_SUFFIX if name.endswith(BLOCKS_SUFFIX) else SCALES_SUFFIX if name.endswith(SCALES_SUFFIX) \
            else None
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        if scheme.unquantized.matches(base.rpartition(".")[0]):
            raise ValueError(f"tensor {name!r} is MXFP4, but modules_to_not_convert keeps {base} unquantized")
        if tensor.dtype != torch.uint8:
            raise ValueError(f"MXFP4 tensor {name!r} is {tensor.dtype}, expected uint8")
        pair = waiting.setdefault(base, {})
        pair[suffix] = tensor
        if len(pair) == 2:
            del waiting[base]
            blocks, scales = pair[BLOCKS_SUFFIX], pair[SCALES_SUFFIX]
            if base.rpartition(".")[0] in keep:
                _check_pair(base, blocks, scales)
                yield base + BLOCKS_SUFFIX, blocks
                yield base + SCALES_SUFFIX, scales
            else:
                yield base, _dequantized(base, blocks, scales)
    if waiting:
        base, pair = next(iter(waiting.items()))
        (have,) = pair
        other = SCALES_SUFFIX if have == BLOCKS_SUFFIX else BLOCKS_SUFFIX
        raise ValueError(f"MXFP4 tensor {base + have!r} has no {base + other!r} in the checkpoint")


def _check_pair(base: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dim() < 3 or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 tensor {base}{BLOCKS_SUFFIX} has shape {list(blocks.shape)} and its scales "
                         f"{list(scales.shape)}: expected [..., G, {GROUP // 2}] and [..., G]")


def _dequantized(base: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    _check_pair(base, blocks, scales)
    if blocks.dim() == 3:
        return dequantize_mxfp4(blocks, scales).transpose(-1, -2)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * GROUP, dtype=torch.bfloat16, device=blocks.device)
    for e in range(blocks.shape[0]):  # one expert at a time: the codes' index tensor is 8 bytes a value
        out[e] = dequantize_mxfp4(blocks[e], scales[e])
    return out.transpose(-1, -2)
