"""Fixtures the router's unit tests share: a tiny model directory, its tokenizer, asyncio for anyio."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.router.tokenizing import load_tokenizer
from services.text.tokenizer import Tokenizer
from tests.unit.router._router_model import write_tiny_model_dir


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-router-model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return load_tokenizer(str(model_dir))
