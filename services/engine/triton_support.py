"""Whether Triton can be used in this process, and how: asked by the fused ops and the attention backends.

Its own module so that neither of those packages imports the other for it (the attention layer
calls the fused K/V write). Cached: the answer does not change while the process lives. The A/B
switches of the Triton paths (``PDSERVE_PDL`` here, the fused ops' in ``ops``) are read once, at import,
by ``switch_from_env``; the engine's settings (``EngineConfig.pdl`` here, ``configure_pdl``) replace them
when it starts, unless the variable is set (``overridden_by_env``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@functools.cache
def triton_import_error() -> str | None:
    """None when Triton imports, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        import triton  # noqa: F401
    except Exception as e:  # a broken install raises anything
        return f"triton does not import: {e}"
    return None


def switch_from_env(name: str, meaning: str) -> bool:
    """An on/off A/B switch of the Triton paths from the environment: unset or 1 is on, 0 off, anything else
    a clear error at import (``meaning`` says what each value does)."""
    value = os.environ.get(name, "1").strip().lower()
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 1 or 0 ({meaning})")
    return value == "1"


def overridden_by_env(name: str) -> bool:
    """Whether the variable ``name`` decides a speed switch instead of the engine's config: whenever it is set
    (its value was read at import), so a benchmark's ``PDSERVE_...=0`` run stays one whatever the engine says."""
    return name in os.environ


PDL_ENV_VAR = "PDSERVE_PDL"
_pdl = switch_from_env(PDL_ENV_VAR, "1: programmatic dependent launch on Hopper and later, 0: plain launches")


def configure_pdl(on: bool) -> None:
    """The engine's ``pdl`` setting (``EngineConfig``, ``--no-pdl``) for this process; ``PDSERVE_PDL``, when set,
    wins over it."""
    global _pdl
    if not overridden_by_env(PDL_ENV_VAR):
        _pdl = on


@functools.cache
def _pdl_device(index: int | None) -> bool:
    import torch

    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether the engine's Triton kernels on ``device`` are launched with programmatic dependent launch:
    a CUDA device of compute capability 9.0 (Hopper) or later, unless it is switched off (``configure_pdl``,
    or ``PDSERVE_PDL=0`` set when this module was imported: the A/B switch).

    Such a launch lets a kernel start while the one before it drains; every kernel launched this way
    waits (``triton_pdl.pdl_enter``) before it touches memory another kernel writes or reads, so only its
    launch and what it loads from weights overlap the previous kernel."""
    return device.type == "cuda" and _pdl and _pdl_device(device.index)
