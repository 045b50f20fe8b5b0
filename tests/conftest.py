"""Shared test set-up: cap oneDNN before torch loads, and small random HF checkpoints."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _bundled_gguf_parsed_once() -> Iterator[None]:
    """Parse the bundled SmolLM2 GGUF's header once per test process, not once per engine.

    Its 49k-token vocabulary takes ~3 s to parse, and every in-process engine on the bundled model or on a
    ``dummy:`` preset (whose tokenizer is SmolLM2's) opened the file again: ~40 times in the unit tests alone.
    The reader is a read-only memory map of an installed file nothing writes, so sharing it changes no result;
    the first open per process still parses the file for real, and every other path (the tests' own GGUF
    files, damaged copies) is opened afresh each time. Daemons are other processes and are not affected.
    """
    from services.text import gguf_metadata, tokenizer  # noqa: F401  (tokenizer: one of the holders below)
    from services.text.default_model import default_model_path

    real = gguf_metadata.open_gguf_reader
    try:
        bundled = default_model_path().resolve()
    except FileNotFoundError:
        yield  # the tests that need the file fail on its absence themselves
        return
    parsed = functools.cache(lambda _version: real(bundled))

    def open_gguf_reader(path):
        if Path(path).resolve() == bundled:
            stat = bundled.stat()
            return parsed((stat.st_mtime_ns, stat.st_size))
        return real(path)

    # open_gguf_reader is imported by name (services.text.tokenizer, services.engine.loading.gguf): rebind it
    # wherever services code holds the original; a module imported later picks the new one up from those.
    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("services.") and getattr(m, "open_gguf_reader", None) is real]
    for module in holders:
        module.open_gguf_reader = open_gguf_reader
    try:
        yield
    finally:
        for module in holders:
            module.open_gguf_reader = real
