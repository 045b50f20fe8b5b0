"""``python -m services.cli generate`` end to end, as a user runs it.

stdout carries the completion and nothing else (one line), so the command composes in a shell
pipeline; the bundled SmolLM2 answers greedily and deterministically. Each call parses and
dequantizes the GGUF (~10 s), so there are only three.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.default_model import default_model_path

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # generous: a loaded 2-core CI machine is several times slower than idle
STORY_START = ", the city of Nova Haven was a thriving metropolis, with towering skyscrapers and bustling streets."


@pytest.fixture(scope="module")
def model_path() -> Path:
    """The bundled GGUF; not installed is a failure (``make install`` installs it), never a skip."""
    return default_model_path()


def _generate(*args: str) -> str:
    """Run the CLI; assert it succeeded and printed exactly one line; return that line."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") == 1, f"stdout: {proc.stdout!r}"
    return proc.stdout.removesuffix("\n")


def test_chat_answers_the_capital_of_france(model_path: Path) -> None:
    # No --model: the default resolves to the bundled file.
    line = _generate("--chat", "--prompt", "What is the capital of France?")
    assert "Paris" in line


def test_greedy_story_continuation(model_path: Path) -> None:
    line = _generate("--model", str(model_path), "--prompt", "Once upon a time", "--max-tokens", "24")
    assert line.startswith(STORY_START), line


def test_dummy_model() -> None:
    line = _generate("--model", "dummy:tiny", "--prompt", "hi", "--max-tokens", "4")
    assert line.strip()
