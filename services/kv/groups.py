"""KV-cache groups: the layers that share one block table.

A model whose layers all attend over the full context has one group. A hybrid (Gemma-2/3 style)
has a full-attention group and a sliding-window group; the window group only ever needs the
blocks that cover its last ``sliding_window`` tokens, which is what transfers clip to. A model with
multi-head latent attention (DeepSeek-V2/V3) has one MLA group: each layer caches one row per token
(the compressed KV latent and the rotated rope key), not a K and a V per head.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class AttentionKind(enum.Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    #: Multi-head latent attention: full attention over one shared row per token and layer, so one
    #: "head" of the row's width and a single plane (the row is both what keys and values come from).
    MLA = "mla"


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: which layers, how they attend, the block size in tokens, the KV shape.

    ``num_kv_heads``/``head_dim`` give this group's page shape when it differs from the layout's
    (Gemma-4's full layers have wider heads than its sliding ones); None means the layout's own.
    Inside a :class:`KVLayoutSpec` heads are those of one TP rank.

    An MLA group states its shape: one head (the latent row is shared by every query head, so it
    is the same on every TP rank) of ``head_dim`` = the row width (``kv_lora_rank +
    qk_rope_head_dim``), stored once per token and layer (``num_kv_planes`` 1, no V plane).
    """

    group_id: int
    kind: AttentionKind
    layer_ids: tuple[int, ...]
    block_size: int
    sliding_window: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.layer_ids:
            raise ValueError(f"KV group {self.group_id} has no layers")
        if (self.kind is AttentionKind.SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ValueError("sliding_window is set exactly when kind is SLIDING_WINDOW")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        for name in ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"KV group {self.group_id}: {name} must be >= 1, got {value}")
        if self.kind is AttentionKind.MLA and (self.num_kv_heads != 1 or self.head_dim is None):
            raise ValueError(f"KV group {self.group_id} (mla) holds one latent row per token: num_kv_heads must be 1 "
                             f"and head_dim its width, got {self.num_kv_heads} and {self.head_dim}")

    @property
    def num_kv_planes(self) -> int:
        """Planes each layer stores per token: K and V (2), or MLA's one latent row (1)."""
        return 1 if self.kind is AttentionKind.MLA else 2

    @property
    def label(self) -> str:
        """How errors name the group: ``KV group 1 (full)``, ``KV group 0 (sliding_window 512)``."""
        window = f" {self.sliding_window}" if self.sliding_window is not None else ""
        return f"KV group {self.group_id} ({self.kind.value}{window})"

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks a block table needs to address ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def first_needed_block(self, num_tokens: int) -> int:
        """Index of the first block the newest of ``num_tokens`` tokens can still attend to.

        Full attention needs every block. With a window of W tokens, the query at position
        ``n - 1`` sees keys ``n - W .. n - 1``; blocks wholly before that are never read again::

            block_size=4, W=6, n=14: keys 8..13 -> blocks 2, 3 -> first needed block = 8 // 4 = 2
        """
        if self.sliding_window is None or num_tokens <= self.sliding_window:
            return 0
        return (num_tokens - self.sliding_window) // self.block_size


#: The convention a state group's transfer follows: the owner sends the state after ALL prompt tokens (the
#: state its first token was sampled from), and the reader's first step feeds that first token. The other
#: convention (state after N-1 tokens, the reader recomputing the last) corrupts output when mixed with this
#: one, so it is hashed: two engines that disagree are never paired.
STATE_SENT_AFTER = "all_prompt_tokens"


@dataclass(frozen=True)
class StateTensorSpec:
    """One fixed-size per-request tensor of a state layer: its name, shape and dtype (torch's name)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def num_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype] * math.prod(self.shape)


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: A slot's tensors start on this many bytes (a float32 view needs 4; 64 keeps rows cache-line aligned).
STATE_ALIGN = 64


@dataclass(frozen=True)
class StateGroupSpec:
    """The per-request state of a model's state layers (Mamba2: a causal conv's last inputs and the SSM
    state), the KV-cache group kind that holds no blocks: each request owns one *slot* of ``slot_bytes``
    holding every state layer's tensors, so moving a request's state is one contiguous run. Within a slot,
    layer by layer, each of ``tensors`` starts on a multiple of ``STATE_ALIGN`` bytes. The same on every
    engine with this model, dtype and TP size (the shapes are one rank's); the slot count is each engine's own."""

    layer_ids: tuple[int, ...]
    tensors: tuple[StateTensorSpec, ...]
    kind: str = "mamba2"
    sent_after: str = STATE_SENT_AFTER
    #: The TP size the tensors are one rank's of (Mamba heads are split over ranks; the shapes are per rank).
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.layer_ids or not self.tensors:
            raise ValueError("a state group has at least one layer and one tensor")
        for t in self.tensors:
            if t.dtype not in _DTYPE_BYTES or not t.shape or min(t.shape) < 1:
                raise ValueError(f"state tensor {t.name}: shape {t.shape} / dtype {t.dtype} not supported")

    @property
    def label(self) -> str:
        return f"state group ({self.kind}, {len(self.layer_ids)} layers)"

    @property
    def layer_stride(self) -> int:
        """Bytes one layer's tensors take in a slot, alignment included."""
        return sum(-(-t.num_bytes // STATE_ALIGN) * STATE_ALIGN for t in self.tensors)

    @property
    def slot_bytes(self) -> int:
        return self.layer_stride * len(self.layer_ids)

    def offset(self, layer_id: int, name: str) -> int:
        """Byte offset of layer ``layer_id``'s tensor ``name`` inside a slot."""
        at = self.layer_ids.index(layer_id) * self.layer_stride
        for t in self.tensors:
            if t.name == name:
                return at
            at += -(-t.num_bytes // STATE_ALIGN) * STATE_ALIGN
        raise KeyError(f"{self.label} has no tensor {name!r}")
