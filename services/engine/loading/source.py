"""Resolve a ``--model`` argument to a config, a weight source and a tokenizer.

Accepted forms: a Hugging Face model directory, a ``.gguf`` file, ``dummy:<preset>`` (seeded
random weights at a real shape), or nothing (the bundled SmolLM2-135M-Instruct GGUF).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from services.engine.loading.gguf import load_gguf
from services.engine.loading.quant.kv_scales import read_kv_scales
from services.engine.loading.quant.registry import parse_quantization
from services.engine.loading.quant.scheme import QuantScheme
from services.engine.loading.quant.stream import checkpoint_tensors
from services.engine.loading.weights import iter_safetensors, safetensors_files
from services.engine.model_config.hf import ModelConfig, preset, preset_quantization
from services.text.model_ref import ModelRef, load_tokenizer, parse_model
from services.text.tokenizer import Tokenizer

# Called with the HF modules to pass through as e4m3 (``checkpoint_tensors``' ``keep_fp8``).
WeightSource = Callable[[frozenset[str]], Iterator[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class ModelSource:
    """What was resolved: ``weights`` is None for dummy models (initialised in place)."""

    name: str
    kind: str  # "hf" | "gguf" | "dummy"
    config: ModelConfig
    weights: WeightSource | None
    load_tokenizer: Callable[[], Tokenizer | None]
    # The checkpoint's own dtype, when it states one ("float32", "bfloat16", ...).
    checkpoint_dtype: str | None = None
    # Per-layer KV-cache scales the checkpoint stores (layer id -> (k_scale, v_scale)); empty when it stores none,
    # and an FP8 KV cache then scales by 1.0.
    kv_scales: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    # The checkpoint's quantization (FP8 formats; a dummy:*-fp8 preset's too), None when it has none: the model
    # keeps the projections it computes in FP8 as stored (``--quantization``), the others come dequantized.
    quantization: QuantScheme | None = None


def resolve_model(model: str | None) -> ModelSource:
    """Raise FileNotFoundError / ValueError naming the problem when the model cannot be used."""
    ref = parse_model(model)
    if ref.kind == "dummy":
        return _dummy_source(ref)
    if ref.kind == "hf":
        return _hf_source(ref)
    return _gguf_source(ref)


def _hf_source(ref: ModelRef) -> ModelSource:
    path = ref.path
    config_path = path / "config.json"
    config = ModelConfig.from_file(config_path)
    raw = json.loads(config_path.read_text())
    scheme = parse_quantization(raw)
    return ModelSource(
        name=ref.name,
        kind="hf",
        config=config,
        weights=lambda keep_fp8=frozenset(): checkpoint_tensors(iter_safetensors(path), scheme, keep_fp8),
        load_tokenizer=lambda: load_tokenizer(ref),
        checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        kv_scales=read_kv_scales(safetensors_files(path)),
        quantization=scheme,
    )


def _gguf_source(ref: ModelRef) -> ModelSource:
    checkpoint = load_gguf(ref.path)
    return ModelSource(
        name=ref.name,
        kind="gguf",
        config=ModelConfig.from_hf_dict(checkpoint.config),
        weights=lambda keep_fp8=frozenset(): checkpoint.tensors(),
        load_tokenizer=checkpoint.tokenizer,
    )


def _dummy_source(ref: ModelRef) -> ModelSource:
    quantization = preset_quantization(ref.preset)
    scheme = parse_quantization({"quantization_config": quantization}) if quantization is not None else None
    return ModelSource(name=ref.name, kind="dummy", config=preset(ref.preset), weights=None,
                       load_tokenizer=lambda: load_tokenizer(ref), quantization=scheme)
