"""Whether Triton can be used in this process: asked by the fused ops and the attention backends.

Its own module so that neither of those packages imports the other for it (the attention layer
calls the fused K/V write). Cached: the answer does not change while the process lives.
"""

from __future__ import annotations

import functools
import importlib.util


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
