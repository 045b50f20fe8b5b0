"""The values a step passes between the engine, the model runner and the decode graphs.

Kept apart from the runner and the graphs so both can read them without importing each other:
``Chunk`` (what a scheduled chunk looks like to a runner), ``DeviceTokens`` (input tokens still on
the device) and ``StepLogits`` (what a step returns).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class Chunk(Protocol):
    """What the runner reads of a scheduled chunk (``ScheduledChunk``, or a TP follower's ``StepChunk``).

    ``token_ids`` are the chunk's own tokens (positions ``start ..``); ``block_ids[g]`` is the
    request's block table of KV group g from token 0.
    """

    start: int
    num_tokens: int
    samples: bool

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def block_ids(self) -> Sequence[Sequence[int]]: ...

    @property
    def return_logits(self) -> bool: ...

    @property
    def state_slot(self) -> int | None:
        """The request's row of the state pool (models with state layers), else None."""

    @property
    def kv_rounding(self) -> str:
        """The FP8 dtype the request's K/V are rounded through (``attention.kv_rounding``), else ""."""


@dataclass(frozen=True)
class DeviceTokens:
    """Input tokens taken from a tensor on the device: row ``rows[i]`` gets ``tokens[source_rows[i]]``."""

    tokens: torch.Tensor
    rows: list[int]
    source_rows: list[int]

    def copy_into(self, input_ids: torch.Tensor) -> None:
        device = input_ids.device
        pin = device.type == "cuda"
        index = torch.tensor([self.rows, self.source_rows], dtype=torch.int64, pin_memory=pin).to(
            device, non_blocking=pin)
        input_ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]))


@dataclass(frozen=True)
class StepLogits:
    """``sample_logits[i]`` belongs to ``sample_rows[i]`` (index into the step's chunks).

    ``all_logits[chunk index]`` holds logits for every position of a chunk whose request asked
    for them (``SamplingParams.return_logits``).
    """

    sample_rows: list[int]
    sample_logits: torch.Tensor
    all_logits: dict[int, torch.Tensor]
