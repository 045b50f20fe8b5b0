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
from dataclasses import dataclass, replace


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

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: A slot's tensors start on this many bytes (a float32 view needs 4; 64 keeps rows cache-line aligned).
STATE_ALIGN = 64


@dataclass(frozen=True)
class StateTensorSpec:
    """One fixed-size per-request tensor of a state layer: its name, shape and dtype (torch's name)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def num_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype] * math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the first dimension's index)."""
        return self.num_bytes // self.shape[0]


@dataclass(frozen=True)
class MambaShape:
    """A Mamba2 layer's state as the MODEL has it, and how TP splits it: ``num_heads`` heads of ``head_dim``
    channels in ``n_groups`` groups (B and C: ``d_state`` rows per group, shared by the group's heads), a causal
    conv of ``d_conv`` taps. Per request and layer: the SSM state ``[heads, head_dim, d_state]`` (float32) and the
    conv window ``[conv channels, d_conv - 1]`` (``conv_dtype``), conv channels being ``x`` (heads x head_dim),
    then B, then C. A TP rank holds ``num_heads / tp`` heads and their groups: ``n_groups / tp`` of them, or the one
    group its heads belong to when a group spans ranks (one group only; its norm is all-reduced)."""

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    conv_dtype: str

    def __post_init__(self) -> None:
        sizes = (self.num_heads, self.head_dim, self.n_groups, self.d_state, self.d_conv)
        if min(sizes) < 1 or self.num_heads % self.n_groups or self.d_conv < 2:
            raise ValueError(f"Mamba2 state shape {self}: sizes must be positive, heads a multiple of groups, "
                             "d_conv >= 2")

    def check_tp(self, tp_size: int) -> None:
        if self.num_heads % tp_size or (self.n_groups % tp_size and self.n_groups != 1):
            raise ValueError(f"tensor-parallel size {tp_size} cannot shard the Mamba2 layers: {self.num_heads} heads "
                             f"and {self.n_groups} groups over {tp_size} ranks (heads must divide; groups must divide "
                             "or be one)")

    def rank_heads(self, tp_size: int, rank: int) -> range:
        """The model's heads rank ``rank`` of ``tp_size`` holds."""
        self.check_tp(tp_size)
        n = self.num_heads // tp_size
        return range(rank * n, (rank + 1) * n)

    def rank_groups(self, tp_size: int, rank: int) -> range:
        """The model's groups that rank holds (its heads' groups)."""
        first = self.group_of(self.rank_heads(tp_size, rank)[0])
        return range(first, first + max(1, self.n_groups // tp_size))

    def group_of(self, head: int) -> int:
        return head // (self.num_heads // self.n_groups)

    def rank_conv_rows(self, tp_size: int, rank: int) -> tuple[int, ...]:
        """The model's conv channels (``x`` of every head, then B, then C of every group) that rank's conv rows
        hold, in its order: x of its heads, then B and C of its groups. The one definition of that order: the
        mixer loads its weights' rows by it and ``kv/plan/state_runs.py`` maps slots between TP sizes by it."""
        x = [h * self.head_dim + i for h in self.rank_heads(tp_size, rank) for i in range(self.head_dim)]
        groups = [g * self.d_state + i for g in self.rank_groups(tp_size, rank) for i in range(self.d_state)]
        b0 = self.num_heads * self.head_dim
        c0 = b0 + self.n_groups * self.d_state
        return tuple(x + [b0 + r for r in groups] + [c0 + r for r in groups])

    def conv_channel_head(self, channel: int, first_head: int) -> int:
        """The head whose rank a reader with heads from ``first_head`` reads a conv channel from: an x channel's own
        head; for a B or C channel, the reader's first head in that group (a group spread over ranks is on each of
        them: read once)."""
        b0 = self.num_heads * self.head_dim
        if channel < b0:
            return channel // self.head_dim
        group = (channel - b0) % (self.n_groups * self.d_state) // self.d_state
        return max(first_head, group * (self.num_heads // self.n_groups))

    def tensors(self, tp_size: int) -> tuple[StateTensorSpec, StateTensorSpec]:
        """One rank's (ssm, conv) tensors (every rank's have the same shapes)."""
        heads, groups = len(self.rank_heads(tp_size, 0)), len(self.rank_groups(tp_size, 0))
        return (StateTensorSpec("ssm", (heads, self.head_dim, self.d_state), "float32"),
                StateTensorSpec("conv", (heads * self.head_dim + 2 * groups * self.d_state, self.d_conv - 1),
                                self.conv_dtype))


@dataclass(frozen=True)
class StateGroupSpec:
    """The per-request state of a model's state layers (Mamba2: a causal conv's last inputs and the SSM
    state), the KV-cache group kind that holds no blocks: each request owns one *slot* of ``slot_bytes``
    holding every state layer's tensors as one TP rank of ``tp_size`` holds them (``mamba.tensors``), so moving
    a request's state is a few runs per layer. Within a slot, layer by layer, each tensor starts on a multiple of
    ``STATE_ALIGN`` bytes. The model's shape (``layer_ids``, ``mamba``, ``sent_after``) is what two engines must
    share; TP size and slot count are each engine's own."""

    layer_ids: tuple[int, ...]
    mamba: MambaShape
    kind: str = "mamba2"
    sent_after: str = STATE_SENT_AFTER
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("a state group has at least one layer")
        if self.mamba.conv_dtype not in _DTYPE_BYTES:
            raise ValueError(f"state conv dtype {self.mamba.conv_dtype} not supported")
        self.mamba.check_tp(self.tp_size)

    @property
    def tensors(self) -> tuple[StateTensorSpec, ...]:
        return self.mamba.tensors(self.tp_size)

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

    def with_tp(self, tp_size: int) -> StateGroupSpec:
        """The same model's state as an engine of ``tp_size`` ranks holds it."""
        return replace(self, tp_size=tp_size)
