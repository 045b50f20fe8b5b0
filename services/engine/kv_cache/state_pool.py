"""The torch side of per-request state: fixed-size Mamba2 states, one row per state slot.

A model with state layers (Granite-4.0-H) keeps, per request and Mamba2 layer, its causal conv's
last ``d_conv - 1`` inputs ``[conv_dim, d_conv - 1]`` and its SSM state ``[heads, head_dim,
d_state]`` (float32: the scan runs in float32 and the state accumulates over the whole sequence).
``KVCacheManager``'s ``StateSlots`` says which row a request owns; the model reads and updates
that row in place, chunk after chunk (chunked prefill carries the state between steps) and
token after token. A row is zeroed when a request's chunk starts at position 0 (``StateBatch``),
so a freed slot needs no clearing. The pool is sized ``max_num_seqs`` rows: a running request
always has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.model_config.hf import ModelConfig


@dataclass(frozen=True)
class StateBatch:
    """One step's state rows, per chunk in step order: the slot, and whether it starts at token 0
    (its state is zeroed first). ``slots_tensor`` is ``slots`` on the model's device."""

    slots: list[int]
    fresh: list[bool]
    slots_tensor: torch.Tensor

    @classmethod
    def of(cls, slots: Sequence[int | None], starts: Sequence[int], device: torch.device) -> StateBatch:
        if any(s is None for s in slots):
            raise ValueError("a chunk of a model with state layers has no state slot")
        slots = [int(s) for s in slots]
        return cls(slots, [start == 0 for start in starts], torch.tensor(slots, device=device))


class StatePool:
    """``conv[layer]`` [slots, conv_dim, d_conv - 1] (model dtype) and ``ssm[layer]`` [slots, heads,
    head_dim, d_state] (float32) for every state layer of the model."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        m = config.granite.mamba
        self.num_slots = num_slots
        self.conv = {i: torch.zeros(num_slots, m.conv_dim, m.d_conv - 1, dtype=dtype, device=device)
                     for i in config.state_layer_ids}
        self.ssm = {i: torch.zeros(num_slots, m.num_heads, m.head_dim, m.d_state, dtype=torch.float32, device=device)
                    for i in config.state_layer_ids}

    @classmethod
    def for_model(cls, config: ModelConfig, num_slots: int, dtype: torch.dtype,
                  device: torch.device) -> StatePool | None:
        """The pool of a model with state layers; None for a model without."""
        return cls(config, num_slots, dtype, device) if config.state_layer_ids else None

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.ssm.values()))
