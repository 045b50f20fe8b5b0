"""Shared, cached access to the SmolLM2 GGUF file and its transformers reference objects.

Cached per process, so the test modules that need the same slow object (parsing the GGUF takes
seconds) build it once per pytest run.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from services.engine.default_model import default_model_path
from services.engine.gguf_loader import GGUFCheckpoint, load_gguf
from services.engine.tokenizer import Tokenizer


def smollm2_path() -> Path:
    """The model file, or a skip of the calling test when the package is not installed."""
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@functools.cache
def smollm2_checkpoint() -> GGUFCheckpoint:
    return load_gguf(smollm2_path())


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    return smollm2_checkpoint().tokenizer()


@functools.cache
def transformers_tokenizer():
    """transformers' tokenizer built from the same GGUF: the reference our encodings must equal."""
    transformers = pytest.importorskip("transformers")
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
