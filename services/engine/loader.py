"""Resolve a ``--model`` argument to a config, a weight source and a tokenizer.

Accepted forms: a Hugging Face model directory, a ``.gguf`` file, ``dummy:<preset>`` (seeded
random weights at a real shape), or nothing (the bundled SmolLM2-135M-Instruct GGUF).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.config import ModelConfig, preset
from services.engine.default_model import default_model_path
from services.engine.gguf_loader import load_gguf
from services.engine.tokenizer import Tokenizer
from services.engine.weights import iter_safetensors

WeightSource = Callable[[], Iterator[tuple[str, torch.Tensor]]]


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


def resolve_model(model: str | None) -> ModelSource:
    """Raise FileNotFoundError / ValueError naming the problem when the model cannot be used."""
    if not model:
        return _gguf_source(default_model_path())
    if model.startswith("dummy:"):
        return _dummy_source(model.removeprefix("dummy:"))
    path = Path(model).expanduser()
    if path.is_dir():
        return _hf_source(path)
    if path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such GGUF file")
        return _gguf_source(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{model}: not a directory, a .gguf file or dummy:<preset> (models are never downloaded)"
        )
    raise ValueError(f"{model}: expected a Hugging Face model directory, a .gguf file or dummy:<preset>")


def _hf_source(path: Path) -> ModelSource:
    config_path = path / "config.json"
    config = ModelConfig.from_file(config_path)
    raw = json.loads(config_path.read_text())
    return ModelSource(
        name=path.name,
        kind="hf",
        config=config,
        weights=lambda: iter_safetensors(path),
        load_tokenizer=lambda: Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None,
        checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )


def _gguf_source(path: Path) -> ModelSource:
    checkpoint = load_gguf(path)
    return ModelSource(
        name=path.stem,
        kind="gguf",
        config=ModelConfig.from_hf_dict(checkpoint.config),
        weights=checkpoint.tensors,
        load_tokenizer=checkpoint.tokenizer,
    )


def _dummy_source(name: str) -> ModelSource:
    config = preset(name)

    def tokenizer() -> Tokenizer | None:
        # Dummy models have no vocabulary of their own; the bundled SmolLM2 tokenizer's ids are
        # valid in every preset's vocabulary, which is enough to drive text through them.
        try:
            return load_gguf(default_model_path()).tokenizer()
        except (FileNotFoundError, ValueError):
            return None

    return ModelSource(name=f"dummy-{name}", kind="dummy", config=config, weights=None, load_tokenizer=tokenizer)
