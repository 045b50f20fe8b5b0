"""The torch side of per-request state: fixed-size Mamba2 states, one row per state slot.

A model with state layers (Granite-4.0-H) keeps, per request and Mamba2 layer, its causal conv's
last ``d_conv - 1`` inputs ``[conv_dim, d_conv - 1]`` and its SSM state ``[heads, head_dim,
d_state]`` (float32: the scan runs in float32 and the state accumulates over the whole sequence).
``KVCacheManager``'s ``StateSlots`` says which row a request owns; the model reads and updates
that row in place, chunk after chunk (chunked prefill carries the state between steps) and
token after token. A row is zeroed when a request's chunk starts at position 0 (``StateBatch``),
so a freed slot needs no clearing. The pool is sized ``max_num_seqs`` rows: a running request
always has one. All slots live in one byte buffer, a slot holding every layer's tensors
(``StateGroupSpec``): a peer reads a request's state in a few runs per layer (``services.kv.plan.state_runs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.kv_cache.buffers import DTYPE_NAMES, TORCH_DTYPES
from services.engine.model_config.hf import ModelConfig
from services.engine.parallel import ParallelConfig
from services.kv.spec.groups import StateGroupSpec


@dataclass(frozen=True)
class StateBatch:
    """One step's state rows, per chunk in step order: the slot, and whether it starts at token 0
    (its state is zeroed first). ``slots_tensor`` is ``slots`` on the model's device."""

    slots: list[int]
    fresh: list[bool]
    slots_tensor: torch.Tensor

    @classmethod
    def on_device(cls, slots: torch.Tensor) -> StateBatch:
        """A captured decode step's: the slots only on the device, no chunk at token 0 (the graph runner takes
        none: a fresh state is zeroed by the host)."""
        return cls([], [], slots)

    @classmethod
    def of(cls, slots: Sequence[int | None], starts: Sequence[int], device: torch.device) -> StateBatch:
        if any(s is None for s in slots):
            raise ValueError("a chunk of a model with state layers has no state slot")
        slots = [int(s) for s in slots]
        return cls(slots, [start == 0 for start in starts], torch.tensor(slots, device=device))


def state_group(config: ModelConfig, dtype: torch.dtype, parallel: ParallelConfig | None = None
                ) -> StateGroupSpec | None:
    """The state group one TP rank of a model with state layers holds (conv state in the model's dtype, SSM state
    in float32; its heads' and groups' channels only); None for a model without."""
    if not config.state_layer_ids:
        return None
    parallel = parallel or ParallelConfig()
    shape = config.granite.mamba.state_shape(DTYPE_NAMES[dtype])
    return StateGroupSpec(tuple(config.state_layer_ids), shape, tp_size=parallel.tp_size)


class StatePool:
    """Every state slot of this TP rank in one byte buffer ``[slots, slot_bytes]`` (``StateGroupSpec``'s slot
    layout), registered with the rank's NIXL agent as one region; ``conv[layer]`` [slots + 1, conv_dim,
    d_conv - 1] and ``ssm[layer]`` [slots + 1, heads, head_dim, d_state] (this rank's heads) are strided views
    into it and the scratch slot after it."""

    def __init__(self, spec: StateGroupSpec, num_slots: int, device: torch.device) -> None:
        self.spec = spec
        self.num_slots = num_slots
        # One row more than the slots: the scratch slot, where a captured decode step's padding rows write
        # (as their K/V go to the KV cache's scratch block). Peers see ``buffer``, the slots alone.
        self.scratch_slot = num_slots
        self._rows = torch.zeros(num_slots + 1, spec.slot_bytes, dtype=torch.uint8, device=device)
        self.buffer = self._rows[:num_slots]
        self.conv = {i: self._view(i, "conv") for i in spec.layer_ids}
        self.ssm = {i: self._view(i, "ssm") for i in spec.layer_ids}

    def _view(self, layer_id: int, name: str) -> torch.Tensor:
        t = next(t for t in self.spec.tensors if t.name == name)
        at = self.spec.offset(layer_id, name)
        raw = self._rows[:, at:at + t.num_bytes].view(TORCH_DTYPES[t.dtype])
        return raw.view(self.num_slots + 1, *t.shape)

    @classmethod
    def for_model(cls, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device,
                  parallel: ParallelConfig | None = None) -> StatePool | None:
        """The pool of one TP rank of a model with state layers; None for a model without."""
        spec = state_group(config, dtype, parallel)
        return cls(spec, num_slots, device) if spec is not None else None

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel()
