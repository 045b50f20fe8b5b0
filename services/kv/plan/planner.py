"""The descriptor planner: the fewest contiguous (src, dst, len) copies that move a request's KV.

Every NIXL descriptor costs ~6 us whatever its size, so the descriptor count is the lever (see
docs/design.md). A plan is computed from the two layout specs, the block pieces (after block-size ratio,
prefix skip and window clipping, see ``topology.map_blocks``) and one :class:`RankRead` (after TP).

Inside a block page the rows coalesce into runs, and a group's planes fold, the same way for every piece of one
(spec pair, group, read): ``spec_pair`` works that out once (and shows how); a plan repeats its runs over the pieces.

Pages themselves are then merged: all runs are ordered by source address and
a run joins its predecessor when it starts where that one ends in the same source buffer AND in
the same destination buffer. This one rule does the rest: per-layer pages of consecutive block
ids (on both sides) become one run per (layer, K/V); a cross-layer block (every layer's K and V
back to back) becomes one descriptor when both sides are cross-layer with the same block size and
all heads, and a run of consecutive such blocks one descriptor in total; heads-outer (head, block)
runs of consecutive blocks become one run per head read, whatever the two TP sizes. Ordering by
source makes the merge optimal: a source byte is read once, so each run has at most one possible
successor.

Everything is vectorised with numpy: offsets are built by broadcasting (planes x pieces x rows)
and merged with one pass of ``np.add.reduceat``; no Python loop runs per descriptor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.kv.plan.spec_pair import Nesting, spec_pair
from services.kv.spec.groups import KVCacheGroupSpec
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.topology import BlockPiece, RankRead

_FIELDS = ("src_buffer", "src_offset", "dst_buffer", "dst_offset", "length")


@dataclass(frozen=True)
class Descriptor:
    """One contiguous copy: ``length_bytes`` from (src buffer, offset) to (dst buffer, offset)."""

    src_buffer_index: int
    src_offset_bytes: int
    dst_buffer_index: int
    dst_offset_bytes: int
    length_bytes: int


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Descriptors for one remote rank, as parallel read-only int64 arrays (one entry each).

    Buffer indices are ``KVLayoutSpec.buffers()`` indices on the remote (src) and local (dst) side.
    """

    remote_rank: int
    src_buffer: np.ndarray
    src_offset: np.ndarray
    dst_buffer: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    def __post_init__(self) -> None:
        sizes = {getattr(self, name).shape for name in _FIELDS}
        if len(sizes) != 1 or len(next(iter(sizes))) != 1:
            raise ValueError(f"descriptor arrays must be 1-D and of equal length, got shapes {sorted(sizes)}")
        for name in _FIELDS:
            arr = np.array(getattr(self, name), dtype=np.int64)  # a private, read-only copy
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)

    @classmethod
    def _owned(cls, remote_rank: int, cols: Sequence[np.ndarray]) -> TransferPlan:
        """A plan over int64 arrays nobody else holds (the planner's own): made read-only, not copied."""
        plan = object.__new__(cls)
        object.__setattr__(plan, "remote_rank", remote_rank)
        for name, arr in zip(_FIELDS, cols, strict=True):
            arr = np.ascontiguousarray(arr, dtype=np.int64)
            arr.flags.writeable = False
            object.__setattr__(plan, name, arr)
        return plan

    @property
    def num_descriptors(self) -> int:
        return int(self.length.size)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def descriptors(self) -> list[Descriptor]:
        """The same plan as a list of values (convenient in tests and logs, slow for big plans)."""
        cols = [getattr(self, name).tolist() for name in _FIELDS]
        return [Descriptor(*row) for row in zip(*cols, strict=True)]

    def address_rows(
        self, src_regions: Sequence[tuple[int, int]], dst_regions: Sequence[tuple[int, int]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(remote, local) ``[n, 3]`` uint64 (addr, len, device) rows, the form the NIXL agent takes.

        ``*_regions[i]`` is buffer i's (base address, device id); row j of both arrays is one copy.
        """
        out = []
        for side, regions, buf, off in (
            ("src", src_regions, self.src_buffer, self.src_offset),
            ("dst", dst_regions, self.dst_buffer, self.dst_offset),
        ):
            table = np.asarray(regions, dtype=np.int64).reshape(-1, 2)
            if buf.size and int(buf.max()) >= table.shape[0]:
                raise ValueError(f"plan names {side} buffer {int(buf.max())}, only {table.shape[0]} regions given")
            rows = np.empty((buf.size, 3), dtype=np.uint64)
            if table.shape[0] == 1:  # one buffer (cross-layer, one group): no gather
                rows[:, 0] = off + table[0, 0]
                rows[:, 2] = table[0, 1]
            else:
                rows[:, 0] = table[buf, 0] + off
                rows[:, 2] = table[buf, 1]
            rows[:, 1] = self.length
            out.append(rows)
        return out[0], out[1]

    @classmethod
    def empty(cls, remote_rank: int) -> TransferPlan:
        none = np.zeros(0, dtype=np.int64)
        return cls(remote_rank, none, none, none, none, none)


# ---- pieces --------------------------------------------------------------------------------------


def _piece_arrays(pieces: Sequence[BlockPiece] | np.ndarray) -> np.ndarray:
    """Pieces as a [5, N] int64 array: remote block, remote offset, local block, local offset, tokens
    (``topology.map_block_arrays`` gives that form directly)."""
    if isinstance(pieces, np.ndarray):
        if pieces.ndim != 2 or pieces.shape[0] != 5:
            raise ValueError(f"block pieces as an array must be [5, N], got shape {pieces.shape}")
        return pieces.astype(np.int64, copy=False)
    if not len(pieces):
        return np.zeros((5, 0), dtype=np.int64)
    rows = [(p.remote_block, p.remote_offset, p.local_block, p.local_offset, p.num_tokens) for p in pieces]
    return np.array(rows, dtype=np.int64).T


def _check_pieces(
    arr: np.ndarray, remote: KVLayoutSpec, local: KVLayoutSpec, rg: KVCacheGroupSpec, lg: KVCacheGroupSpec
) -> None:
    """Pieces inside both sides' blocks and never two writing one local token (a race)."""
    rb, ro, lb, lo, nt = arr
    if (nt < 1).any():
        raise ValueError("a block piece must move at least one token")
    for side, blk, off, spec, g in (("remote", rb, ro, remote, rg), ("local", lb, lo, local, lg)):
        if ((blk < 0) | (blk >= spec.num_blocks)).any():
            raise ValueError(f"{side} block id outside [0, {spec.num_blocks})")
        if ((off < 0) | (off + nt > g.block_size)).any():
            raise ValueError(f"a piece overruns a {side} block of {g.block_size} tokens")
    if (lb[1:] > lb[:-1]).all():  # ascending local blocks: no two pieces share one
        return
    order = np.lexsort((lo, lb))
    same_block = lb[order][1:] == lb[order][:-1]
    if (same_block & (lo[order][1:] < (lo + nt)[order][:-1])).any():
        raise ValueError("block pieces overlap in the local blocks")


def _pad_partial(arr: np.ndarray, unit: int) -> np.ndarray:
    """Widen pieces that start on a ``unit`` boundary on both sides to the full unit."""
    rb, ro, lb, lo, nt = arr
    pad = (nt < unit) & (ro % unit == 0) & (lo % unit == 0)
    if not pad.any():
        return arr
    return np.stack([rb, ro, lb, lo, np.where(pad, unit, nt)])


def _expand(plane: np.ndarray, piece: np.ndarray, grid: np.ndarray, nesting: Nesting) -> np.ndarray:
    """``plane[P] + piece[N] + grid[K]`` over every combination, flattened in ``nesting``'s order."""
    parts = {"plane": plane, "piece": piece, "grid": grid}
    a, b, c = (parts[name] for name in nesting.value)
    return (a[:, None, None] + b[None, :, None] + c[None, None, :]).ravel()


# ---- merging -------------------------------------------------------------------------------------


def _merge(cols: list[np.ndarray], src_buffer_bytes: int) -> list[np.ndarray]:
    """Order runs by source address, then join each run to its predecessor where both continue.

    ::

        src  [b3 p0][b3 p1][b4 p0]...      run i+1 joins run i iff
        dst  [b7 p0][b7 p1][b8 p0]...        src_buf and dst_buf equal and
                                             src_off[i]+len[i] == src_off[i+1] and
                                             dst_off[i]+len[i] == dst_off[i+1]
    """
    sb, so, db, do, ln = cols
    if sb.size == 0:
        return cols
    if int(sb.max()) < (1 << 62) // max(src_buffer_bytes, 1):
        key = sb * src_buffer_bytes + so
        if (np.diff(key) < 0).any():
            order = np.argsort(key, kind="stable")
            sb, so, db, do, ln = (c[order] for c in (sb, so, db, do, ln))
    else:  # pragma: no cover - buffers beyond 2**62 bytes in total
        order = np.lexsort((so, sb))
        sb, so, db, do, ln = (c[order] for c in (sb, so, db, do, ln))
    joins = (sb[1:] == sb[:-1]) & (db[1:] == db[:-1]) & (so[1:] == so[:-1] + ln[:-1]) & (do[1:] == do[:-1] + ln[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return [sb[starts], so[starts], db[starts], do[starts], np.add.reduceat(ln, starts)]


# ---- planning ------------------------------------------------------------------------------------


def plan_transfer(
    remote: KVLayoutSpec,
    local: KVLayoutSpec,
    group_id: int,
    pieces: Sequence[BlockPiece] | np.ndarray,
    read: RankRead,
    layers: Sequence[int] | None = None,
    *,
    pad_partial_blocks: bool = False,
) -> TransferPlan:
    """Descriptors that copy ``pieces`` of group ``group_id`` for the heads in ``read``.

    ``remote`` is the spec of rank ``read.remote_rank`` (its own head count), ``local`` the spec
    of the reading rank; ``read``'s head slices index the GROUP's heads on each side (groups may
    have their own heads and head dim). ``layers`` defaults to all of the group's layers.

    ``pad_partial_blocks`` widens a partial piece to its whole ``min(block sizes)`` unit: the tail
    copies stale bytes into slots the reader owns and has not filled yet, and in exchange a partial
    last block costs no more descriptors than a full one (one instead of ``2 * layers`` per block
    for cross-layer). Only use it when nobody else reads those local slots.
    """
    pair = spec_pair(remote, local, group_id, read, None if layers is None else tuple(layers))
    arr = _piece_arrays(pieces)
    if pad_partial_blocks:
        arr = _pad_partial(arr, pair.unit)
    _check_pieces(arr, remote, local, pair.rg, pair.lg)
    if not pair.layers or arr.shape[1] == 0:
        return TransferPlan.empty(read.remote_rank)

    rb, ro, lb, lo, nt = arr
    classes = np.unique(nt).tolist() if int(nt.min()) != int(nt.max()) else [int(nt[0])]
    out: list[list[np.ndarray]] = [[] for _ in _FIELDS]
    for tokens in classes:  # full pieces, and at most a partial first/last one
        sel = slice(None) if len(classes) == 1 else nt == tokens
        f_sb, f_so, f_db, f_do, f_len, g_src, g_dst = pair.runs(tokens)
        piece_src = rb[sel] * pair.r_block + ro[sel] * pair.r_token + pair.head_base_src
        piece_dst = lb[sel] * pair.l_block + lo[sel] * pair.l_token + pair.head_base_dst
        no_piece, no_grid = np.zeros_like(piece_src), np.zeros_like(g_src)
        out[0].append(_expand(f_sb, no_piece, no_grid, pair.nesting))
        out[1].append(_expand(f_so, piece_src, g_src, pair.nesting))
        out[2].append(_expand(f_db, no_piece, no_grid, pair.nesting))
        out[3].append(_expand(f_do, piece_dst, g_dst, pair.nesting))
        out[4].append(_expand(f_len, no_piece, no_grid, pair.nesting))

    cols = [c[0] if len(c) == 1 else np.concatenate(c) for c in out]
    return TransferPlan._owned(read.remote_rank, _merge(cols, pair.src_buffer_bytes))


@dataclass(frozen=True, eq=False)
class UnitRuns:
    """The copies of one whole unit (``min(block sizes)`` tokens, the heads of one read) of a group, as
    offsets from the unit's start on each side: what a prepared descriptor list repeats per unit.

    ``src_offset``/``dst_offset`` hold, per run, the buffer offset of the unit at block 0 (heads
    included); a unit of remote block b, ``j`` units in, adds ``b * src_block_bytes + j * src_unit_bytes``.
    Runs come as [planes, grid]; ``nesting`` is the order a pull posts them in (units taking the piece
    axis): by source address for ascending block ids, which is what lets adjacent units merge.
    """

    src_buffer: np.ndarray
    src_offset: np.ndarray
    dst_buffer: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    num_planes: int
    nesting: Nesting
    unit: int
    src_block_bytes: int
    src_unit_bytes: int
    dst_block_bytes: int
    dst_unit_bytes: int


def unit_runs(remote: KVLayoutSpec, local: KVLayoutSpec, group_id: int, read: RankRead) -> UnitRuns | None:
    """The runs :func:`plan_transfer` gives one whole unit of group ``group_id`` (planes folded, rows
    coalesced), from the same checked spec pair; None for a group without layers to read."""
    pair = spec_pair(remote, local, group_id, read, None)
    if not pair.layers:
        return None
    f_sb, f_so, f_db, f_do, f_len, g_src, g_dst = pair.runs(pair.unit)
    grid = g_src.size
    return UnitRuns(
        np.repeat(f_sb, grid), (f_so[:, None] + g_src[None, :]).ravel() + pair.head_base_src,
        np.repeat(f_db, grid), (f_do[:, None] + g_dst[None, :]).ravel() + pair.head_base_dst,
        np.repeat(f_len, grid), int(f_sb.size), pair.nesting, pair.unit,
        pair.r_block, pair.unit * pair.r_token, pair.l_block, pair.unit * pair.l_token,
    )


def plan_groups(
    remote: KVLayoutSpec,
    local: KVLayoutSpec,
    pieces_by_group: Mapping[int, Sequence[BlockPiece] | np.ndarray],
    read: RankRead | Mapping[int, RankRead],
    *,
    pad_partial_blocks: bool = False,
) -> TransferPlan:
    """One plan for several KV groups of the same remote rank (each group planned on its own).

    ``read`` is one RankRead for every group, or one per group id (``topology.group_rank_reads``)
    when the groups' head counts differ; every read must name the same remote rank.
    """
    reads = {gid: read for gid in pieces_by_group} if isinstance(read, RankRead) else dict(read)
    missing = sorted(set(pieces_by_group) - set(reads))
    if missing:
        raise ValueError(f"no RankRead for KV groups {missing}")
    ranks = {reads[gid].remote_rank for gid in pieces_by_group}
    if len(ranks) > 1:
        raise ValueError(f"one plan reads one remote rank, the groups' reads name {sorted(ranks)}")
    remote_rank = ranks.pop() if ranks else (read.remote_rank if isinstance(read, RankRead) else 0)
    plans = [
        plan_transfer(remote, local, gid, pieces, reads[gid], pad_partial_blocks=pad_partial_blocks)
        for gid, pieces in pieces_by_group.items()
    ]
    return concat_plans(plans, remote_rank, max(b.num_bytes for b in remote.buffers()) if len(plans) > 1 else 0)


def merged_plan(remote_rank: int, cols: Sequence[np.ndarray], src_buffer_bytes: int = 1 << 40) -> TransferPlan:
    """A plan of runs given in any order (``_FIELDS`` columns), joined where they continue each other on both sides
    (``_merge``): for READs planned outside the planner (``services.kv.plan.staging``)."""
    return TransferPlan._owned(remote_rank, _merge([np.asarray(c, dtype=np.int64) for c in cols], src_buffer_bytes))


def concat_plans(plans: Sequence[TransferPlan], remote_rank: int, src_buffer_bytes: int = 1 << 40) -> TransferPlan:
    """Join plans that read the same remote rank, merging runs that meet across them."""
    if any(p.remote_rank != remote_rank for p in plans):
        raise ValueError(f"plans read different remote ranks: {sorted({p.remote_rank for p in plans})}")
    if not plans:
        return TransferPlan.empty(remote_rank)
    if len(plans) == 1:  # a plan is merged already
        return plans[0]
    cols = [np.concatenate([getattr(p, name) for p in plans]) for name in _FIELDS]
    return TransferPlan._owned(remote_rank, _merge(cols, src_buffer_bytes))


# ---- reference copy ------------------------------------------------------------------------------


def _byte_view(buf: Any, side: str, index: int) -> Any:
    """A flat uint8 view sharing memory with ``buf`` (numpy on CPU, torch tensor on a device)."""
    if isinstance(buf, bytearray | memoryview | bytes):
        return np.frombuffer(buf, dtype=np.uint8)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{side} buffer {index} is not contiguous")
        return buf.reshape(-1).view(np.uint8)
    if type(buf).__module__.startswith("torch"):
        import torch

        if not buf.is_contiguous():
            raise ValueError(f"{side} buffer {index} is not contiguous")
        flat = buf.detach().reshape(-1).view(torch.uint8)
        return flat.numpy() if flat.device.type == "cpu" else flat
    raise ValueError(f"{side} buffer {index}: unsupported type {type(buf).__name__}")


def _check_bounds(bufs: list[Any], index: np.ndarray, offset: np.ndarray, length: np.ndarray, side: str) -> None:
    if index.size == 0:
        return
    if int(index.min()) < 0 or int(index.max()) >= len(bufs):
        raise ValueError(f"plan names a {side} buffer outside [0, {len(bufs)})")
    sizes = np.array([b.shape[0] for b in bufs], dtype=np.int64)
    if ((offset < 0) | (offset + length > sizes[index])).any():
        raise ValueError(f"plan reaches past the end of a {side} buffer")


def apply_plan(plan: TransferPlan, src_buffers: Sequence[Any], dst_buffers: Sequence[Any]) -> None:
    """Execute ``plan`` as plain memcpys (reference for tests; a same-process copy).

    Buffers may be ``bytearray``, contiguous numpy arrays or contiguous torch tensors of any
    dtype; they are addressed as bytes.
    """
    src = [_byte_view(b, "src", i) for i, b in enumerate(src_buffers)]
    dst = [_byte_view(b, "dst", i) for i, b in enumerate(dst_buffers)]
    _check_bounds(src, plan.src_buffer, plan.src_offset, plan.length, "src")
    _check_bounds(dst, plan.dst_buffer, plan.dst_offset, plan.length, "dst")
    on_device = any(not isinstance(b, np.ndarray) for b in src + dst)
    if on_device:
        import torch

        src = [torch.from_numpy(b) if isinstance(b, np.ndarray) else b for b in src]
        dst = [torch.from_numpy(b) if isinstance(b, np.ndarray) else b for b in dst]
    for sb, so, db, do, n in zip(*(getattr(plan, name).tolist() for name in _FIELDS), strict=True):
        if on_device:
            dst[db][do : do + n].copy_(src[sb][so : so + n], non_blocking=False)
        else:
            dst[db][do : do + n] = src[sb][so : so + n]
