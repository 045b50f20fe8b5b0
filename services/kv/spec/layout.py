"""Explicit KV-cache layout specs: where every (layer, K/V, block, token, head) lives in memory.

The engine allocates its KV buffers from a :class:`KVLayoutSpec`, attention reads through the
views the spec describes, and the transfer planner computes byte offsets from the same spec.
Nobody guesses a layout from a tensor's shape.

Three kinds. In the first two, a block's tokens and heads are ordered NHD
(``[block_size, heads, head_dim]``) or HND (``[heads, block_size, head_dim]``).

Per-layer: one buffer per layer, K and V split::

    buffer[layer] = [2 (K,V), num_blocks, <block: NHD or HND>]
    one block of one layer's K = block_size * heads * head_dim elements (8-32 KB typically)

Cross-layer: one buffer per KV group; a block holds every layer's K and V contiguously, so a
block is one descriptor (0.5-2.5 MB) instead of ``2 * num_layers`` small ones::

    buffer[group] = [num_blocks, num_layers_in_group, 2 (K,V), <block: NHD or HND>]

Heads-outer: one buffer per KV group whose outermost axis is the head: head h's plane holds every
block of the pool (all layers, K and V), then head h+1's plane follows. It is for pulls between
engines of different TP sizes, where a reader rank reads a head slice of every remote block: heads
[h0, h1) of a run of consecutive blocks [b0, b1) are ``h1 - h0`` runs, one per head plane, of
``b1 - b0`` blocks each (one run only when [b0, b1) is the whole pool). A consecutive 512-block pull
into TP 2 is thus a descriptor per head the reading rank reads (4 of Llama-3.1-8B's 8), not one per
block. The price: a block is no longer one region but ``heads`` (one per plane), so even between
equal TP sizes a consecutive pull is ``heads`` descriptors (runs still merge across blocks), and the
host tier copies a block run plane by plane. Each head's tokens are contiguous, so the block order
is HND by construction (an NHD heads-outer spec is refused)::

    buffer[group] = [heads, num_blocks, num_layers_in_group, 2 (K,V), block_size, head_dim]

    head planes:  |h0: b0 b1 b2 ... b(N-1)|h1: b0 b1 ... b(N-1)|h2: ...      b = |L0.K L0.V L1.K ...|
    heads [1, 3) of blocks [1, 3) = 2 runs:  h1: ^^^^^ b1..b2      h2: ^^^^^ b1..b2

Every kind gives each (layer, K/V) the same strided view (:class:`KVView`,
``[num_blocks, block_size, heads, head_dim]``), which is all attention, the K/V write, the digest
and the host KV tier read; only the strides differ.

An MLA group (``AttentionKind.MLA``) has one plane per layer, not two: each token's one latent row
(one head of ``kv_lora_rank + qk_rope_head_dim``) is its K/V, so in every kind above the ``2 (K,V)``
axis is ``1`` for that group (``KVCacheGroupSpec.num_kv_planes``) and its only view is ``kv=0``::

    per-layer   buffer[layer] = [1, num_blocks, block_size, 1, row]
    cross-layer buffer[group] = [num_blocks, num_layers_in_group, 1, block_size, 1, row]
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.kv.spec.groups import KVCacheGroupSpec

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


class BlockOrder(enum.Enum):
    """Order of tokens and heads inside one block."""

    NHD = "NHD"
    HND = "HND"


class LayoutKind(enum.Enum):
    """Where a block's (layer, K/V, head) pages sit (placement). Reconciled between engines, not hashed:
    the planner addresses bytes from each side's spec, so any two kinds of one block order can pull."""

    PER_LAYER = "per_layer"
    CROSS_LAYER = "cross_layer"
    #: For pulls between different TP sizes: a head's plane holds every block, so a reader rank's heads of
    #: consecutive blocks are one run per head.
    HEADS_OUTER = "heads_outer"

    @property
    def orders(self) -> tuple[BlockOrder, ...]:
        """The block orders this kind can hold: heads-outer keeps each head's tokens together (HND)."""
        return (BlockOrder.HND,) if self is LayoutKind.HEADS_OUTER else (BlockOrder.NHD, BlockOrder.HND)


@dataclass(frozen=True)
class KVBufferSpec:
    """One contiguous allocation: which group and layers it holds and how big it is.

    A block of this buffer is ``num_planes`` regions of ``block_stride_bytes`` each, one per plane, and
    the buffer is ``[num_planes, num_blocks, block_stride_bytes]``: per-layer K then V (2 planes; an
    MLA layer's latent rows, 1), cross-layer the whole block (1), heads-outer one per head (``kv_heads``
    planes).
    """

    index: int
    group_id: int
    layer_ids: tuple[int, ...]
    num_bytes: int
    # Bytes between consecutive blocks of the same (layer, K/V, head) inside this buffer.
    block_stride_bytes: int
    num_planes: int


@dataclass(frozen=True)
class KVView:
    """The strided view of one layer's K or V: shape [num_blocks, block_size, heads, head_dim].

    ``offset`` and ``strides`` are in elements of the buffer's dtype.
    """

    buffer_index: int
    offset: int
    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]


@dataclass(frozen=True)
class KVLayoutSpec:
    """Everything needed to allocate, read and address the KV cache of one TP rank."""

    kind: LayoutKind
    order: BlockOrder
    num_blocks: int
    num_kv_heads: int  # heads held by this rank, after TP sharding (groups may override: kv_heads())
    head_dim: int  # groups may override: group_head_dim()
    dtype: str
    groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
        for name in ("num_blocks", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.order not in self.kind.orders:
            raise ValueError(f"a {self.kind.value} KV layout holds {'/'.join(o.value for o in self.kind.orders)} "
                             f"blocks, not {self.order.value}")
        if not self.groups:
            raise ValueError("a KV layout needs at least one KV-cache group")
        if [g.group_id for g in self.groups] != list(range(len(self.groups))):
            raise ValueError(f"KV group ids must be 0..{len(self.groups) - 1} in order, "
                             f"got {[g.group_id for g in self.groups]}")
        layers = [layer for g in self.groups for layer in g.layer_ids]
        if len(layers) != len(set(layers)):
            raise ValueError("a layer belongs to more than one KV-cache group")

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def block_size(self, group_id: int) -> int:
        return self.groups[group_id].block_size

    def kv_heads(self, group_id: int) -> int:
        """KV heads this rank holds for the group's layers."""
        heads = self.groups[group_id].num_kv_heads
        return self.num_kv_heads if heads is None else heads

    def group_head_dim(self, group_id: int) -> int:
        head_dim = self.groups[group_id].head_dim
        return self.head_dim if head_dim is None else head_dim

    def page_elements(self, group_id: int) -> int:
        """Elements of one layer's K (or V) in one block."""
        return self.block_size(group_id) * self.kv_heads(group_id) * self.group_head_dim(group_id)

    def page_bytes(self, group_id: int) -> int:
        return self.page_elements(group_id) * self.element_size

    def num_kv_planes(self, group_id: int) -> int:
        """Planes a layer of the group stores: K and V (2), or an MLA group's one latent row (1)."""
        return self.groups[group_id].num_kv_planes

    def block_bytes(self, group_id: int) -> int:
        """Bytes of one block across all of the group's layers and planes (K and V, or MLA's row)."""
        return self.num_kv_planes(group_id) * len(self.groups[group_id].layer_ids) * self.page_bytes(group_id)

    @property
    def total_bytes(self) -> int:
        return sum(b.num_bytes for b in self.buffers())

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(layer for g in self.groups for layer in g.layer_ids))

    def group_of_layer(self, layer_id: int) -> KVCacheGroupSpec:
        for g in self.groups:
            if layer_id in g.layer_ids:
                return g
        raise KeyError(f"layer {layer_id} holds no KV in this layout")

    # ---- buffers and views ---------------------------------------------------------------------
    def buffers(self) -> tuple[KVBufferSpec, ...]:
        out: list[KVBufferSpec] = []
        for g in self.groups:
            page = self.page_bytes(g.group_id)
            block = self.block_bytes(g.group_id)
            if self.kind is LayoutKind.PER_LAYER:
                planes = g.num_kv_planes
                for layer in g.layer_ids:
                    out.append(KVBufferSpec(len(out), g.group_id, (layer,), planes * self.num_blocks * page, page,
                                            planes))
            elif self.kind is LayoutKind.CROSS_LAYER:
                out.append(KVBufferSpec(len(out), g.group_id, g.layer_ids, self.num_blocks * block, block, 1))
            else:  # heads-outer: a plane per head, each of every block
                heads = self.kv_heads(g.group_id)
                out.append(KVBufferSpec(len(out), g.group_id, g.layer_ids, self.num_blocks * block, block // heads,
                                        heads))
        return tuple(out)

    def buffer_of_layer(self, layer_id: int) -> KVBufferSpec:
        for b in self.buffers():
            if layer_id in b.layer_ids:
                return b
        raise KeyError(f"layer {layer_id} holds no KV in this layout")

    def view(self, layer_id: int, kv: int) -> KVView:
        """Where layer ``layer_id``'s K (kv=0) or V (kv=1) lives, as a strided 4-D view (an MLA layer's
        latent rows: kv=0 only)."""
        group = self.group_of_layer(layer_id)
        planes = group.num_kv_planes
        if kv not in range(planes):
            raise ValueError(f"kv must be 0 (K) or 1 (V), got {kv}" if planes == 2 else
                             f"{group.label} stores one latent row per token: kv must be 0, got {kv}")
        buf = self.buffer_of_layer(layer_id)
        bs, h, d = group.block_size, self.kv_heads(group.group_id), self.group_head_dim(group.group_id)
        page = self.page_elements(group.group_id)
        token_stride, head_stride = (h * d, d) if self.order is BlockOrder.NHD else (d, bs * d)
        if self.kind is LayoutKind.PER_LAYER:
            offset = kv * self.num_blocks * page
            block_stride = page
        elif self.kind is LayoutKind.CROSS_LAYER:
            slot = buf.layer_ids.index(layer_id)
            offset = (slot * planes + kv) * page
            block_stride = planes * len(buf.layer_ids) * page
        else:  # heads-outer: [head][block][layer][K/V][token][head_dim]
            slot = buf.layer_ids.index(layer_id)
            offset = (slot * planes + kv) * bs * d
            block_stride = planes * len(buf.layer_ids) * bs * d
            head_stride = self.num_blocks * block_stride
        return KVView(buf.index, offset, (self.num_blocks, bs, h, d), (block_stride, token_stride, head_stride, 1))

    def byte_offset(self, layer_id: int, kv: int, block: int, token: int = 0, head: int = 0) -> int:
        """Byte offset inside the layer's buffer of one (block, token, head) row of head_dim elements."""
        v = self.view(layer_id, kv)
        elems = v.offset + block * v.strides[0] + token * v.strides[1] + head * v.strides[2]
        return elems * self.element_size
