"""K/V of some requests rounded through an FP8 cache's values while a 16-bit cache stores them.

A prefill worker with a 16/32-bit KV cache that serves an FP8-KV decode worker quantizes the request's KV on send
(``services.kv.spec.kv_convert``). For the decode worker to continue exactly where a colocated FP8-KV engine
would, the prefill itself must have attended over FP8-rounded K/V, as that engine does: each layer's fresh K/V
(MLA: latent rows) of such a request become ``round_trip(x, scale)`` (``ops.kv_fp8``, with the scale an FP8
cache of the model uses for the layer) before they are written and attended to. The cache then holds values an
e4m3 byte represents exactly, so the send's quantization gives back the bytes a colocated FP8 engine stores.

Per request (``Request.kv_rounding``): a step may mix rounded and plain requests; ``rows`` marks the rounded
tokens (None: every token of the step). Such steps run eagerly (no CUDA graph holds the mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.ops import kv_fp8


@dataclass(frozen=True)
class KVRounding:
    """Which of a step's token rows round their K/V through e4m3 (None: all)."""

    rows: torch.Tensor | None = None

    @classmethod
    def of(cls, rounded: Sequence[bool], lengths: Sequence[int], device: torch.device) -> KVRounding | None:
        """The step's rounding from each chunk's flag and token count; None when no chunk rounds."""
        if not any(rounded):
            return None
        if all(rounded):
            return cls()
        mask = [flag for flag, n in zip(rounded, lengths, strict=True) for _ in range(n)]
        return cls(torch.tensor(mask, dtype=torch.bool, device=device))

    def apply(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``x`` [tokens, ...] with the rounded rows replaced by what an FP8 cache would give back."""
        rounded = kv_fp8.round_trip(x, scale)
        if self.rows is None:
            return rounded
        return torch.where(self.rows.view(-1, *(1,) * (x.dim() - 1)), rounded, x)
