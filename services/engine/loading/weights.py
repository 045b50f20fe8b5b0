"""Weight sources: safetensors checkpoints (single or sharded) and seeded dummy weights."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from services.engine.loading.quant import mxfp4
from services.engine.loading.quant.quantize import quantize_weight
from services.engine.loading.quant.scheme import QuantScheme
from services.engine.models import DecoderModel


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shard files, from model.safetensors.index.json when present."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise FileNotFoundError(f"{model_dir}: index names missing weight files: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weight files (only safetensors is supported)")
    return files


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every shard, memory-mapped, one tensor at a time."""
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: corrupt or unreadable safetensors file ({e})") from None


def dummy_weights(model: DecoderModel, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random HF-named tensors at the model's full checkpoint shapes (benchmarks, smoke tests).

    Each tensor comes from its own generator, seeded by ``seed`` and the tensor's name, and is
    loaded through ``load_weights`` like a real checkpoint: so every TP rank takes its shard of
    the same full weights, and a TP2 engine computes what a TP1 engine with the same seed does.
    Matrices get N(0, 0.02) like HF's initialiser; norms scale by 1 (a stored 0 where the norm
    adds 1 to its weight, as Gemma-2/3's do), per-layer output scalars are 1 and biases 0, so
    activations stay in range through many layers.
    """
    device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
    unit_norm = 1.0 - model.config.norm_weight_offset
    for name in model._expected_names():
        yield name, dummy_tensor(name, model._hf_shape(name), dtype, device, seed, unit_norm)


def dummy_quantized_checkpoint(model: DecoderModel, scheme: QuantScheme, seed: int = 0
                               ) -> Iterator[tuple[str, torch.Tensor]]:
    """``dummy_weights`` as a checkpoint of ``scheme`` would store them: for FP8, each matrix the scheme quantizes
    as e4m3 and its scale (``quantize_weight``), named as the scheme's checkpoints name them; for MXFP4 the experts
    as blocks and scales (``mxfp4.quantized_checkpoint``). The same dummy values as the unquantized preset's, so
    the two models differ by the rounding alone."""
    if scheme.method == "mxfp4":
        yield from mxfp4.quantized_checkpoint(_dense_dummy_weights(model, seed))
        return
    for name, tensor in dummy_weights(model, seed):
        module = name.removesuffix(".weight")
        fmt = scheme.weight_format(module) if name.endswith(".weight") and tensor.dim() == 2 else None
        if fmt is None:
            yield name, tensor
            continue
        weight, scale = quantize_weight(tensor, fmt)
        yield name, weight
        yield f"{module}.{scheme.scale_suffix}", scale


def _dense_dummy_weights(model: DecoderModel, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``dummy_weights`` with every MXFP4 pair the model expects (experts kept as stored) as the dense [E, in, out]
    tensor it quantizes: the same values whether the experts are kept or dequantized."""
    device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
    for name in model._expected_names():
        if name.endswith(mxfp4.SCALES_SUFFIX):
            continue
        shape = model._hf_shape(name)
        if name.endswith(mxfp4.BLOCKS_SUFFIX):
            experts, rows, groups, _ = shape
            name, shape = name.removesuffix(mxfp4.BLOCKS_SUFFIX), (experts, groups * mxfp4.GROUP, rows)
        yield name, dummy_tensor(name, shape, dtype, device, seed, 1.0 - model.config.norm_weight_offset)


def dummy_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0,
                 unit_norm: float = 1.0) -> torch.Tensor:
    """The dummy value of one HF-named tensor (see :func:`dummy_weights`); a function of its name, so other
    implementations of the model (HF transformers, in the benchmarks) can be given the same weights."""
    if name.endswith("norm.weight"):
        return torch.full(shape, unit_norm, dtype=dtype, device=device)
    if name.endswith("layer_scalar"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
