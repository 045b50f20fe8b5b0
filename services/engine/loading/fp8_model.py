"""Which projections of an FP8 checkpoint stay FP8 (``--quantization``), and the model rebuilt for them.

``fp8_compute_chosen`` reads the flag: ``auto`` computes in FP8 on CUDA devices of compute capability 8.9 and
later (Ada, Hopper: FP8 tensor cores), ``fp8`` on every device (on CPU through the torch reference: slow, exact),
``none`` never. ``keep_fp8_projections`` then walks the model's ``fp8_targets``: a projection whose HF parts are
all FP8 in one format, and whose block grid its fused parts and TP shard cut only along whole blocks, becomes an
``Fp8Linear``; any other stays a ``Linear`` and gets its weights dequantized (one log line each, saying why). The
HF modules returned are those the weight stream passes through as e4m3 (``checkpoint_tensors``' ``keep_fp8``).

Routed experts (the model's ``fp8_experts``: DeepSeek-V3's, Qwen3-MoE's) stay FP8 on CUDA devices whose Triton
takes e4m3 (sm_89+), where the grouped FP8 GEMM of ``ops.fp8_moe`` reads them; on CPU, even under ``fp8``, they
are dequantized at load (the exact path the CPU tests compare with transformers). A layer's experts stay FP8 only
when all are in one block-scaled format (the kernel's) and each TP rank's width is whole blocks: each rank then
holds whole block rows of gate/up and whole block columns of down, with their scales. A TP split off the blocks
(DeepSeek-V2-Lite's 1408 over 2 ranks: 704, not a multiple of 128) is not refused: those experts are dequantized
at load, one log line saying why, as any projection that would cut a block is.
"""

from __future__ import annotations

import logging
import math

import torch

from services.engine.loading.quant.scheme import QuantScheme, ScaleGranularity, WeightFormat
from services.engine.loading.quant.stream import KEPT_SCALE_SUFFIX
from services.engine.models import DecoderModel
from services.engine.models.fp8_linear import Fp8Linear, Fp8Target, ScaleSlot
from services.engine.models.moe import ExpertScaleSlot, RoutedExperts
from services.engine.ops.fp8_format import fp8_kernels_run_on

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


def keep_fp8_projections(model: DecoderModel, scheme: QuantScheme, experts: bool | None = None) -> frozenset[str]:
    """Swap every projection that can run in FP8 for an ``Fp8Linear`` (its scale slots on ``model.fp8_scales``),
    and keep the routed experts that can in FP8 (``experts``: default on CUDA with e4m3 kernels only); the HF
    modules whose weights are then loaded as e4m3."""
    kept: set[str] = set()
    slots: dict[str, tuple[ScaleSlot | ExpertScaleSlot, tuple[int, ...]]] = {}
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
    log.info("FP8: %d projections in e4m3 (%d HF modules), %d dequantized", swapped,
             len(kept), fallbacks)
    device = next(model.parameters()).device
    if experts if experts is not None else device.type == "cuda" and fp8_kernels_run_on(device):
        kept |= _keep_fp8_experts(model, scheme, slots)
    else:
        log.info("FP8: routed experts dequantized at load (the grouped FP8 GEMM runs on CUDA, sm_89+)")
    model.fp8_scales = slots
    return frozenset(kept)


def _keep_fp8_experts(model: DecoderModel, scheme: QuantScheme,
                      slots: dict[str, tuple[ScaleSlot | ExpertScaleSlot, tuple[int, ...]]]) -> set[str]:
    """Switch each ``fp8_experts`` layer that can to e4m3 experts (``RoutedExperts.keep_fp8``), its scale slots
    added to ``slots``; the HF modules kept."""
    kept: set[str] = set()
    layers = 0
    for path, prefix in model.fp8_experts():
        experts = model.get_submodule(path)
        modules = [f"{prefix}.{e}.{proj}" for e in range(experts.num_experts) for proj in EXPERT_PROJS]
        fmt, why = _experts_format(experts, modules, scheme)
        if fmt is None:
            log.info("FP8: %s dequantized to %s (%s)", path, experts.down.dtype, why)
            continue
        experts.keep_fp8(fmt.block_size)
        b0, b1 = fmt.block_size
        for module in modules:
            rows, cols = model._hf_shape(module + ".weight")
            expert, proj = module.rsplit(".", 2)[1:]
            slots[module + KEPT_SCALE_SUFFIX] = (ExpertScaleSlot(experts, int(expert), proj, model.parallel),
                                                 (math.ceil(rows / b0), math.ceil(cols / b1)))
        kept.update(modules)
        layers += 1
    log.info("FP8: routed experts of %d layers in e4m3 (%d HF modules)", layers, len(kept))
    return kept


#: An expert's HF projections, as ``fp8_experts``' prefixes store them.
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def _experts_format(experts: RoutedExperts, modules: list[str], scheme: QuantScheme
                    ) -> tuple[WeightFormat | None, str]:
    """The one block format of a layer's expert modules if the grouped FP8 GEMM computes them, else (None, why)."""
    formats = {scheme.weight_format(module) for module in modules}
    if None in formats:
        return None, "an expert is kept unquantized by the checkpoint"
    if len(formats) > 1:
        return None, "its experts are stored in different FP8 formats"
    fmt = formats.pop()
    if fmt.granularity is not ScaleGranularity.BLOCK:
        return None, f"the grouped FP8 GEMM takes block scales, not {fmt.granularity.name.lower()} ones"
    b0, b1 = fmt.block_size
    if experts.intermediate % b0 or experts.intermediate % b1:
        return None, f"each rank's expert width {experts.intermediate} is not whole {b0}x{b1} blocks"
    if experts.down.device.type == "cuda":
        from services.engine.ops.fp8_gemm_triton import supported_block  # triton: a CUDA process only

        if not supported_block(fmt.block_size):
            return None, f"the kernel takes blocks at least 32 wide, a power of two (not {b1})"
    return fmt, ""


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
