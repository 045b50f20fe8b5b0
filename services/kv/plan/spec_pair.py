"""One (remote spec, local spec, group, read, layers) combination as the planner needs it, pieces aside: the
pair checked, its planes, and the runs one block piece of it copies (:class:`SpecPair`), computed once per
combination (:func:`spec_pair`), since the same pair recurs for every request between two engines.

How rows coalesce. One (layer, K/V, token, head) row is ``head_dim`` elements. Inside one block
page the copy is a small nest of strided axes; an axis folds into the run below it when it is
contiguous with that run on BOTH sides::

    NHD page [block_size, H, D]          HND page [H, block_size, D]
      run  = D elements                     run  = D elements
      + heads   always (stride D)           + tokens  always (stride D)
      + tokens  iff all heads, both sides   + heads   iff whole block, both sides

which gives, coarsest first: a whole page (all heads, whole block), an NHD token run (all heads),
an HND head-slice of whole blocks, and otherwise one run per token (NHD head slice) or per head
(HND partial block). Planes (one (layer, K/V) each) that continue each other by one run on both
sides then fold into one, and a single folded plane takes in the axes left over the same way. In a
heads-outer buffer (``layout.py``) a block's (layer, K/V) planes are back to back inside each head's
plane of the whole pool, so a head of a whole block is one run however many layers it spans, and the
head axis is left over (heads sit a pool apart)::

    heads-outer  [H, blocks, planes, block_size, D]:  run = D -> + tokens (whole block)
                                                      -> + planes (folded) = one run per (head, block)

An MLA group (DeepSeek's latent rows) is the same with one plane per layer instead of K and V, and
one head, the row (``kv_lora_rank + qk_rope_head_dim`` wide): a page is ``block_size`` rows back to
back in either order, so whole blocks fold as full-attention pages do, and the bytes moved are one
row per token and layer. Under TP the row is whole on every rank: a read names head ``(0, 1)`` on
both sides (``topology.rank_reads`` with one head), so a local rank reads it once, from one remote rank.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, KVView, LayoutKind
from services.kv.spec.topology import RankRead

# ---- the pair's checks ---------------------------------------------------------------------------


def _group(spec: KVLayoutSpec, group_id: int, side: str) -> KVCacheGroupSpec:
    for g in spec.groups:
        if g.group_id == group_id:
            return g
    raise ValueError(f"{side} layout has no KV group {group_id}")


def _check_specs(remote: KVLayoutSpec, local: KVLayoutSpec, group_id: int) -> tuple[KVCacheGroupSpec, KVCacheGroupSpec]:
    """Refuse spec pairs whose bytes do not mean the same thing (dtype, order, the group's shape)."""
    if remote.dtype != local.dtype:
        raise ValueError(f"dtype differs: remote {remote.dtype}, local {local.dtype}")
    if remote.order is not local.order:
        raise ValueError(f"block order differs: remote {remote.order.value}, local {local.order.value}")
    rg, lg = _group(remote, group_id, "remote"), _group(local, group_id, "local")
    if set(rg.layer_ids) != set(lg.layer_ids):
        raise ValueError(f"{lg.label}: layers differ: remote {rg.layer_ids}, local {lg.layer_ids}")
    if (rg.kind, rg.sliding_window) != (lg.kind, lg.sliding_window):
        raise ValueError(f"{lg.label}: attention differs: remote {rg.kind.value} (window {rg.sliding_window}), "
                         f"local {lg.kind.value} (window {lg.sliding_window})")
    r_dim, l_dim = remote.group_head_dim(group_id), local.group_head_dim(group_id)
    if r_dim != l_dim:
        what = "row_width" if lg.kind is AttentionKind.MLA else "head_dim"
        raise ValueError(f"{lg.label}: {what} differs: remote {r_dim}, local {l_dim}")
    return rg, lg


def _check_heads(read: RankRead, remote: KVLayoutSpec, local: KVLayoutSpec, group_id: int) -> None:
    """The read's head slices inside the group's heads on each side (groups may differ in heads)."""
    r_heads, l_heads = remote.kv_heads(group_id), local.kv_heads(group_id)
    label = remote.groups[group_id].label
    if read.remote_heads[1] > r_heads:
        raise ValueError(f"{label}: remote heads {read.remote_heads} exceed the remote rank's {r_heads} heads")
    if read.local_heads[1] > l_heads:
        raise ValueError(f"{label}: local heads {read.local_heads} exceed the local rank's {l_heads} heads")


@functools.lru_cache(maxsize=64)
def _views(spec: KVLayoutSpec, layers: tuple[int, ...]) -> tuple[KVView, ...]:
    """``spec.view`` of every plane of every layer (K before V; an MLA layer's one latent row); cached as the
    same spec pair recurs per request."""
    planes = range(spec.group_of_layer(layers[0]).num_kv_planes) if layers else ()
    views = tuple(spec.view(layer, kv) for layer in layers for kv in planes)
    if len({v.strides for v in views}) != 1:
        raise ValueError("a group's layers do not share one block/token/head stride")
    return views


# ---- within one page -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Axis:
    extent: int
    src_stride: int  # bytes
    dst_stride: int  # bytes


def _coalesce(row_bytes: int, axes_inner_first: Sequence[_Axis]) -> tuple[int, list[_Axis]]:
    """Fold axes into the contiguous run while each is contiguous with it on both sides.

    Returns the run length and the axes left over (outermost first) that enumerate the runs.
    """
    run, left = row_bytes, []
    for axis in axes_inner_first:
        if axis.extent == 1:
            continue
        if not left and axis.src_stride == run and axis.dst_stride == run:
            run *= axis.extent
        else:
            left.append(axis)
    return run, left[::-1]


def _grid(axes_outer_first: Sequence[_Axis]) -> tuple[np.ndarray, np.ndarray]:
    """Relative (src, dst) byte offsets of every run, outermost axis slowest."""
    src, dst = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    for axis in axes_outer_first:
        idx = np.arange(axis.extent, dtype=np.int64)
        src = (src[:, None] + idx[None, :] * axis.src_stride).ravel()
        dst = (dst[:, None] + idx[None, :] * axis.dst_stride).ravel()
    return src, dst


def _fold_planes(planes: Sequence[np.ndarray], run: int) -> list[np.ndarray]:
    """Join planes that continue each other on both sides when each copies one ``run`` per piece.

    Planes are sorted by source; plane i+1 joins plane i when it starts ``run`` bytes after it in
    the same source and destination buffers, so every piece's run in i+1 continues its run in i (at
    every position of the grid left over: the grid shifts both alike). A whole cross-layer block (all
    heads, whole pages) thus becomes one plane of the block's size before the pieces multiply it,
    instead of ``2 * layers`` runs per piece that ``_merge`` would join.
    Returns (src buffer, src offset, dst buffer, dst offset, length) per folded plane.
    """
    sb, so, db, do = planes
    joins = (sb[1:] == sb[:-1]) & (db[1:] == db[:-1]) & (so[1:] == so[:-1] + run) & (do[1:] == do[:-1] + run)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    counts = np.diff(np.append(starts, sb.size))
    return [sb[starts], so[starts], db[starts], do[starts], counts * run]


class Nesting(enum.Enum):
    """How a source's addresses nest the three axes a plan enumerates (planes, block pieces, the grid of
    runs inside one piece and plane), outermost first: enumerating runs in this order lists them by
    source address when the source block ids ascend, so the merge needs no sort.

    ::

        per-layer    a buffer per layer (K, V planes), its blocks inside     plane > piece > grid
        cross-layer  a block holds every plane                               piece > plane > grid
        heads-outer  a head's plane holds every block (the grid: heads)      grid > piece > plane
    """

    PLANE_PIECE_GRID = ("plane", "piece", "grid")
    PIECE_PLANE_GRID = ("piece", "plane", "grid")
    GRID_PIECE_PLANE = ("grid", "piece", "plane")

    @classmethod
    def of(cls, kind: LayoutKind) -> Nesting:
        return {LayoutKind.PER_LAYER: cls.PLANE_PIECE_GRID, LayoutKind.CROSS_LAYER: cls.PIECE_PLANE_GRID,
                LayoutKind.HEADS_OUTER: cls.GRID_PIECE_PLANE}[kind]


# ---- the pair ------------------------------------------------------------------------------------


class SpecPair:
    """What a plan needs of (remote spec, local spec, group, read, layers), pieces aside: checked and
    computed once per combination, since the same pair recurs for every request between two engines."""

    def __init__(self, remote: KVLayoutSpec, local: KVLayoutSpec, group_id: int, read: RankRead,
                 layers: tuple[int, ...] | None) -> None:
        rg, lg = _check_specs(remote, local, group_id)
        _check_heads(read, remote, local, group_id)
        layers = rg.layer_ids if layers is None else layers
        if len(set(layers)) != len(layers) or not set(layers) <= set(rg.layer_ids):
            raise ValueError(f"layers {layers} must be distinct layers of group {group_id} {rg.layer_ids}")
        self.rg, self.lg, self.layers = rg, lg, layers
        self.unit = min(rg.block_size, lg.block_size)
        self.src_buffer_bytes = max(b.num_bytes for b in remote.buffers())
        self.nesting = Nesting.of(remote.kind)
        self.nhd = remote.order is BlockOrder.NHD
        self._runs: dict[int, tuple[np.ndarray, ...]] = {}
        if not layers:
            return
        e = remote.element_size
        # Planes: one (layer, K/V) each, sorted by source address so a sorted source needs no sort.
        r_views, l_views = _views(remote, layers), _views(local, layers)
        planes = sorted(
            (rv.buffer_index, rv.offset * e, lv.buffer_index, lv.offset * e)
            for rv, lv in zip(r_views, l_views, strict=True)
        )
        self.planes = tuple(np.array(c, dtype=np.int64) for c in zip(*planes, strict=True))
        self.r_block, self.r_token, self.r_head = (s * e for s in r_views[0].strides[:3])
        self.l_block, self.l_token, self.l_head = (s * e for s in l_views[0].strides[:3])
        self.num_heads = read.num_heads
        self.row_bytes = remote.group_head_dim(group_id) * e
        self.head_base_src = read.remote_heads[0] * self.r_head
        self.head_base_dst = read.local_heads[0] * self.l_head

    def runs(self, tokens: int) -> tuple[np.ndarray, ...]:
        """For pieces of ``tokens`` tokens: the (folded) planes with their run lengths, and the grid of
        runs inside one piece and plane (src, dst offsets)."""
        got = self._runs.get(tokens)
        if got is None:
            head_axis = _Axis(self.num_heads, self.r_head, self.l_head)
            token_axis = _Axis(tokens, self.r_token, self.l_token)
            run, left = _coalesce(self.row_bytes, [head_axis, token_axis] if self.nhd else [token_axis, head_axis])
            planes = _fold_planes(self.planes, run)
            if left and planes[0].size == 1:  # one run per piece so far: the axes left may continue it
                run, left = _coalesce(int(planes[4][0]), left[::-1])
                planes[4] = np.full(1, run, dtype=np.int64)
            got = self._runs[tokens] = (*planes, *_grid(left))
        return got


_PAIRS: dict[tuple, tuple[KVLayoutSpec, KVLayoutSpec, SpecPair]] = {}


def spec_pair(remote: KVLayoutSpec, local: KVLayoutSpec, group_id: int, read: RankRead,
              layers: tuple[int, ...] | None) -> SpecPair:
    """The cached :class:`SpecPair`, by the specs' identity (hashing a spec costs more than planning a
    small request); the entry keeps both specs alive, so an id is never reused while it is cached."""
    key = (id(remote), id(local), group_id, read, layers)
    entry = _PAIRS.get(key)
    if entry is None or entry[0] is not remote or entry[1] is not local:
        if len(_PAIRS) >= 256:
            _PAIRS.clear()
        entry = _PAIRS[key] = (remote, local, SpecPair(remote, local, group_id, read, layers))
    return entry[2]
