"""Shared, cached access to the SmolLM2 GGUF file and its transformers reference objects.

Cached per process, so the test modules that need the same slow object (parsing the GGUF takes
seconds) build it once per pytest run.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from services.engine.loading.gguf import GGUFCheckpoint, load_gguf
from services.text.default_model import default_model_path
from services.text.tokenizer import Tokenizer


def smollm2_path() -> Path:
    """The model file; `make install` always installs it, so its absence fails the test."""
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


@functools.cache
def smollm2_checkpoint() -> GGUFCheckpoint:
    return load_gguf(smollm2_path())


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    return smollm2_checkpoint().tokenizer()


@functools.cache
def transformers_tokenizer():
    """transformers' tokenizer built from the same GGUF: the reference our encodings must equal."""
    import transformers
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@functools.cache
def transformers_model():
    """transformers' model loaded from the same GGUF (fp32): the reference for the engine's tokens."""
    import torch
    import transformers

    path = smollm2_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32
    ).eval()
