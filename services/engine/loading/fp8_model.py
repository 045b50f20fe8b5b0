"""Which projections of an FP8 checkpoint stay FP8 (``--quantization``), and the model rebuilt for them.

``fp8_compute_chosen`` reads the flag: ``auto`` computes in FP8 on CUDA devices of compute capability 8.9 and
later (Ada, Hopper: FP8 tensor cores), ``fp8`` on every device (on CPU through the torch reference: slow, exact),
``none`` never. ``keep_fp8_projections`` then walks the model's ``fp8_targets``: a projection whose HF parts are
all FP8 in one format, and whose block grid its fused parts and TP shard cut only along whole blocks, becomes an
``Fp8Linear``; any other stays a ``Linear`` and gets its weights dequantized (one log line each, saying why). The
HF modules returned are those the weight stream passes through as e4m3 (``checkpoint_tensors``' ``keep_fp8``).
"""

from __future__ import annotations

import logging
import math

import torch

from services.engine.loading.quant.scheme import QuantScheme, ScaleGranularity, WeightFormat
from services.engine.loading.quant.stream import KEPT_SCALE_SUFFIX
from services.engine.models import DecoderModel
from services.engine.models.fp8_linear import Fp8Linear, Fp8Target, ScaleSlot

log = logging.getLogger(__name__)

#: FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
FP8_MIN_CAPABILITY = (8, 9)


def fp8_compute_chosen(choice: str, scheme: QuantScheme | None, device: torch.device, model_name: str) -> bool:
    """Whether ``--quantization`` ``choice`` keeps this checkpoint's FP8 weights (logged either way).
    ValueError for ``fp8`` on a checkpoint that is not FP8."""
    if scheme is None or not scheme.groups:  # not quantized, or no FP8 weights (MXFP4 experts)
        if choice == "fp8":
            raise ValueError(f"--quantization fp8: {model_name} has no FP8 quantization_config (an FP8 checkpoint "
                             "or a dummy:*-fp8 preset is needed)")
        return False
    if choice == "none":
        log.info("quantization: %s checkpoint dequantized at load (--quantization none)", scheme.method)
        return False
    if choice == "auto":
        capable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY
        if not capable:
            log.info("quantization: %s checkpoint dequantized at load (--quantization auto: %s has no FP8 tensor "
                     "cores)", scheme.method, device)
            return False
        if scheme.activation_scheme != "dynamic":
            log.info("quantization: %s checkpoint is weight-only FP8: dequantized at load (--quantization auto; "
                     "fp8 computes it with dynamic activation scales)", scheme.method)
            return False
    log.info("quantization: %s checkpoint computed in FP8 on %s (--quantization %s)", scheme.method, device, choice)
    return True


def keep_fp8_projections(model: DecoderModel, scheme: QuantScheme) -> frozenset[str]:
    """Swap every projection that can run in FP8 for an ``Fp8Linear`` (its scale slots on ``model.fp8_scales``);
    the HF modules whose weights are then loaded as e4m3."""
    kept: set[str] = set()
    slots: dict[str, tuple[ScaleSlot, tuple[int, ...]]] = {}
    fallbacks = swapped = 0
    for target in model.fp8_targets():
        old = model.get_submodule(target.path)
        fmt, why = _fp8_format(target, scheme, old.weight.shape)
        if fmt is None:
            fallbacks += 1
            log.info("FP8: %s dequantized to %s (%s)", target.path, old.weight.dtype, why)
            continue
        new = Fp8Linear(old.weight.shape[1], old.weight.shape[0], old.bias is not None, fmt.block_size,
                        old.weight.dtype, old.weight.device)
        new.amax_ub = scheme.activation_scale_ub
        model.replace_module(target.path, new)
        swapped += 1
        offset = 0
        for part in target.parts:
            rows, cols = model._hf_shape(part.hf_module + ".weight")
            shape = (math.ceil(rows / fmt.block_size[0]), math.ceil(cols / fmt.block_size[1])) if fmt.block_size \
                else (rows,)
            slots[part.hf_module + KEPT_SCALE_SUFFIX] = (ScaleSlot(new, offset, part.rows, target.col_shard,
                                                                   target.tp), shape)
            kept.add(part.hf_module)
            offset += len(part.rows)
    model.fp8_scales = slots
    log.info("FP8: %d projections in e4m3 (%d HF modules), %d dequantized", swapped,
             len(kept), fallbacks)
    return frozenset(kept)


def _fp8_format(target: Fp8Target, scheme: QuantScheme, shape: torch.Size) -> tuple[WeightFormat | None, str]:
    """The one format of ``target``'s parts if it can be computed exactly in FP8, else (None, why not)."""
    formats = {scheme.weight_format(part.hf_module) for part in target.parts}
    if None in formats:
        return None, "a part is kept unquantized by the checkpoint"
    if len(formats) > 1:
        return None, "its parts are stored in different FP8 formats"
    fmt = formats.pop()
    if fmt.granularity is not ScaleGranularity.BLOCK:
        return fmt, ""
    b0, b1 = fmt.block_size
    if target.col_shard and target.tp[1] > 1 and shape[1] % b1:
        return None, f"its TP shard of {shape[1]} columns is not whole {b1}-column blocks"
    # Every block of the projection's rows must come from one block of one part: then its scale is that one.
    keys = torch.cat([i * (1 << 40) + part.rows // b0 for i, part in enumerate(target.parts)])
    dest_block = torch.arange(len(keys)) // b0
    if not torch.equal(keys, keys[dest_block * b0]):
        sizes = ", ".join(str(len(part.rows)) for part in target.parts)
        return None, f"its parts' rows ({sizes}) do not fall on whole {b0}-row blocks"
    return fmt, ""
