"""Reconcile a prefill ("remote", P) engine with a decode ("local", D) engine.

The two sides may run different TP sizes and different block sizes; neither is in the
compatibility hash, both are reconciled here into plain values the descriptor planner reads:

* :func:`rank_reads` -- which remote ranks a local rank reads, and which of their heads land where
  (:func:`group_rank_reads`: the same per KV group, each group sharded by its own head count).
* :func:`group_readers_per_remote_rank` -- how many local ranks read each remote rank (in any group),
  so the owner knows how many notifications to wait for before it frees a request's blocks
  (:func:`readers_per_remote_rank`: the same when every group has the model's heads).
* :func:`map_blocks` -- runs of tokens that sit in one remote block and one local block.
* :func:`window_start_token` -- the first token a sliding-window group still needs (every token for
  the groups that attend over the whole context: full attention and MLA).

Head arithmetic follows ``services.engine.parallel``: KV heads split evenly when
``tp <= num_kv_heads``, otherwise each head is replicated on ``tp // num_kv_heads`` consecutive
ranks. It is restated here (no torch import) and a test checks the two agree.

An MLA group (DeepSeek's latent rows) has one "head", its row, which every rank holds whole: with
one head the rule above replicates it on every rank, so each local rank reads the row once, from the
remote rank of its own replica index (``local_rank % remote_tp``), never split and never per query
head::

    MLA, local tp 4 <- remote tp 2:  local 0, 2 <- remote 0;  local 1, 3 <- remote 1   (heads (0, 1))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec

# ---- TP ranks ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankRead:
    """One remote rank's contribution to one local rank.

    Heads are indices into each rank's own (sharded) head axis, half-open ``[start, end)``.
    """

    remote_rank: int
    remote_heads: tuple[int, int]
    local_heads: tuple[int, int]

    def __post_init__(self) -> None:
        (rs, re_), (ls, le) = self.remote_heads, self.local_heads
        if self.remote_rank < 0:
            raise ValueError(f"remote_rank must be >= 0, got {self.remote_rank}")
        if not (0 <= rs < re_ and 0 <= ls < le):
            raise ValueError(f"empty or negative head range: remote {self.remote_heads}, local {self.local_heads}")
        if re_ - rs != le - ls:
            raise ValueError(f"head ranges differ in length: remote {self.remote_heads}, local {self.local_heads}")

    @property
    def num_heads(self) -> int:
        return self.remote_heads[1] - self.remote_heads[0]


def check_tp(tp_size: int, num_kv_heads: int, side: str = "") -> None:
    """Refuse a TP size that cannot shard ``num_kv_heads`` (neither divides the other)."""
    who = f"{side} " if side else ""
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    if tp_size < 1:
        raise ValueError(f"{who}tp size must be >= 1, got {tp_size}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"{who}tp size {tp_size} and num_kv_heads {num_kv_heads}: neither divides the other, "
            "so KV heads cannot be sharded evenly"
        )


def kv_head_range(tp_size: int, rank: int, num_kv_heads: int) -> tuple[int, int]:
    """[start, end) of the global KV heads ``rank`` holds (same rule as ``ParallelConfig``)."""
    check_tp(tp_size, num_kv_heads)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for tp size {tp_size}")
    if tp_size <= num_kv_heads:
        n = num_kv_heads // tp_size
        return rank * n, (rank + 1) * n
    head = rank * num_kv_heads // tp_size
    return head, head + 1


def _holder(head: int, replica: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """(rank, head index inside that rank) of the ``replica``-th holder of global ``head``.

    Replicas wrap around, so any non-negative ``replica`` names a holder.
    """
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return head // per_rank, head % per_rank
    copies = tp_size // num_kv_heads
    return head * copies + replica % copies, 0


def rank_reads(local_tp: int, local_rank: int, remote_tp: int, num_kv_heads: int) -> tuple[RankRead, ...]:
    """The remote ranks local rank ``local_rank`` reads, each with its head ranges.

    Each local head is read exactly once. A replicated remote head is read from the holder whose
    replica index matches the local rank's own replica index (modulo the remote copies), so equal
    TP pairs rank r with rank r and replicated readers spread over replicated owners::

        num_kv_heads=8, local tp 2 <- remote tp 4     local rank 0 holds heads 0..3
            remote 0 heads [0,2) -> local [0,2)
            remote 1 heads [0,2) -> local [2,4)

        num_kv_heads=2, local tp 4 <- remote tp 2     local rank 3 holds head 1 (replica 1 of 2)
            remote 1 heads [0,1) -> local [0,1)

        num_kv_heads=2, local tp 1 <- remote tp 4     heads 0,1 live on ranks {0,1} and {2,3}
            remote 0 heads [0,1) -> local [0,1)
            remote 2 heads [0,1) -> local [1,2)
    """
    check_tp(local_tp, num_kv_heads, "local")
    check_tp(remote_tp, num_kv_heads, "remote")
    start, end = kv_head_range(local_tp, local_rank, num_kv_heads)
    replica = local_rank % (local_tp // num_kv_heads) if local_tp > num_kv_heads else 0

    reads: list[RankRead] = []
    for head in range(start, end):
        rank, remote_head = _holder(head, replica, remote_tp, num_kv_heads)
        local_head = head - start
        last = reads[-1] if reads else None
        if last and last.remote_rank == rank and last.remote_heads[1] == remote_head:
            reads[-1] = RankRead(rank, (last.remote_heads[0], remote_head + 1), (last.local_heads[0], local_head + 1))
        else:
            reads.append(RankRead(rank, (remote_head, remote_head + 1), (local_head, local_head + 1)))
    return tuple(reads)


def group_rank_reads(
    local_tp: int, local_rank: int, remote_tp: int, heads_by_group: Mapping[int, int]
) -> dict[int, dict[int, RankRead]]:
    """``{remote rank: {group id: RankRead}}`` for one local rank, each group by its own total heads.

    Groups whose layers have different KV head counts shard differently under TP, so the head
    slices (and even the remote ranks) of one local rank may differ per group::

        TP 1 <- TP 1, full group 2 heads, sliding group 4 heads:
            {0: {0: RankRead(0, (0, 2), (0, 2)), 1: RankRead(0, (0, 4), (0, 4))}}
    """
    out: dict[int, dict[int, RankRead]] = {}
    for gid, heads in heads_by_group.items():
        for read in rank_reads(local_tp, local_rank, remote_tp, heads):
            out.setdefault(read.remote_rank, {})[gid] = read
    return dict(sorted(out.items()))


def group_readers_per_remote_rank(local_tp: int, remote_tp: int, heads_by_group: Mapping[int, int]) -> tuple[int, ...]:
    """For each remote rank, how many distinct local ranks read from it in any group (0: free at once).

    The owner waits for this many notifications per request before freeing its blocks, and a local
    rank sends one per remote rank it reads, however many groups that read covers (the puller issues
    one READ per (local rank, remote rank)); so a local rank reading one remote rank for two groups
    counts once::

        local tp 1 <- remote tp 2, group 0 with 2 heads, group 1 with 1 head (replicated remotely):
            group 0: local 0 <- remotes 0 and 1
            group 1: local 0 <- remote 0                -> (1, 1), not (2, 1)
    """
    if not heads_by_group:
        raise ValueError("heads_by_group is empty: at least one KV group is needed")
    counts = [0] * remote_tp
    for local_rank in range(local_tp):
        for rank in group_rank_reads(local_tp, local_rank, remote_tp, heads_by_group):
            counts[rank] += 1
    return tuple(counts)


def readers_per_remote_rank(local_tp: int, remote_tp: int, num_kv_heads: int) -> tuple[int, ...]:
    """:func:`group_readers_per_remote_rank` for a model whose groups all have ``num_kv_heads``."""
    return group_readers_per_remote_rank(local_tp, remote_tp, {0: num_kv_heads})


# ---- blocks ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockPiece:
    """A run of tokens that sits inside one remote block and one local block (offsets in tokens)."""

    remote_block: int
    remote_offset: int
    local_block: int
    local_offset: int
    num_tokens: int


def block_unit(remote_block_size: int, local_block_size: int) -> int:
    """The unit two sides move a group's KV in: the smaller block size, which must divide the larger (the one
    block-size rule: a run of ``unit`` tokens then lies inside one block on both sides). Refused otherwise."""
    small, large = sorted((remote_block_size, local_block_size))
    if small < 1 or large % small:
        raise ValueError(f"block sizes {remote_block_size} (remote) and {local_block_size} (local) do not divide "
                         "each other")
    return small


def _as_ids(block_ids: Sequence[int] | np.ndarray, side: str) -> np.ndarray:
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{side} block ids must be a flat sequence of integers")
    return ids.astype(np.int64, copy=False)


def _check_ids(ids: np.ndarray, side: str) -> None:
    """The ids a transfer touches: non-negative and distinct (a repeat would mean a double write)."""
    if ids.size == 0:
        return
    if int(ids.min()) < 0:
        raise ValueError(f"{side} block ids must be >= 0, got {int(ids.min())}")
    if not (ids[1:] > ids[:-1]).all() and np.unique(ids).size != ids.size:  # ascending ids: distinct, no sort
        raise ValueError(f"{side} block ids repeat inside the transferred range")


def map_blocks(
    remote_block_ids: Sequence[int] | np.ndarray,
    remote_block_size: int,
    local_block_ids: Sequence[int] | np.ndarray,
    local_block_size: int,
    num_tokens: int,
    start_token: int = 0,
) -> tuple[BlockPiece, ...]:
    """Split tokens ``[start_token, num_tokens)`` into runs that stay in one block on each side
    (:func:`map_block_arrays` as :class:`BlockPiece` values).

    Both id lists are block tables from token 0; entries before ``start_token`` are not read.
    One block size must divide the other, so every run is ``min(sizes)`` tokens except a partial
    last one, which moves only the tokens that exist::

        remote block 16, local block 4, tokens [4, 22):
          remote  |r0 .............................|r1 .....
          local   |l0  |l1  |l2  |l3  |l4  |l5  |..
          pieces        (r0@4,l1@0,4) (r0@8,l2@0,4) (r0@12,l3@0,4) (r1@0,l4@0,4) (r1@4,l5@0,2)

    ``start_token`` must sit on a boundary of the smaller block size, so every run stays inside
    one block on both sides. The reader's prefix cache holds whole local blocks, so a start taken
    from it is a local boundary; a sliding window's start (:func:`window_start_token`) is a
    boundary of the finer side and may fall inside a coarse local block, whose earlier slots then
    stay as they are (they are older than the window and never read).
    """
    cols = map_block_arrays(remote_block_ids, remote_block_size, local_block_ids, local_block_size, num_tokens,
                            start_token)
    return tuple(BlockPiece(*row) for row in zip(*cols.tolist(), strict=True))


def map_block_arrays(
    remote_block_ids: Sequence[int] | np.ndarray,
    remote_block_size: int,
    local_block_ids: Sequence[int] | np.ndarray,
    local_block_size: int,
    num_tokens: int,
    start_token: int = 0,
) -> np.ndarray:
    """:func:`map_blocks` as one ``[5, N]`` int64 array (rows: remote block, remote offset, local block,
    local offset, tokens), built without a Python loop per piece: what the planner consumes."""
    remote_ids, local_ids = _checked_tables(remote_block_ids, remote_block_size, local_block_ids, local_block_size,
                                            num_tokens, start_token)
    if start_token == num_tokens:
        return np.zeros((5, 0), dtype=np.int64)

    small = min(remote_block_size, local_block_size)
    starts = np.arange(start_token, num_tokens, small, dtype=np.int64)
    counts = np.minimum(starts + small, num_tokens) - starts
    r_idx, r_off = np.divmod(starts, remote_block_size)
    l_idx, l_off = np.divmod(starts, local_block_size)
    _check_ids(remote_ids[r_idx[0] : r_idx[-1] + 1], "remote")
    _check_ids(local_ids[l_idx[0] : l_idx[-1] + 1], "local")
    return np.stack((remote_ids[r_idx], r_off, local_ids[l_idx], l_off, counts))


def _checked_tables(remote_block_ids: Sequence[int] | np.ndarray, remote_block_size: int,
                    local_block_ids: Sequence[int] | np.ndarray, local_block_size: int, num_tokens: int,
                    start_token: int) -> tuple[np.ndarray, np.ndarray]:
    """Both block tables as int64 arrays, after checking sizes, the token range and the tables' lengths."""
    if remote_block_size < 1 or local_block_size < 1:
        raise ValueError(f"block sizes must be >= 1, got remote {remote_block_size}, local {local_block_size}")
    small = block_unit(remote_block_size, local_block_size)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not 0 <= start_token <= num_tokens:
        raise ValueError(f"start_token {start_token} outside [0, num_tokens={num_tokens}]")
    if start_token % small:
        raise ValueError(f"start_token {start_token} is not on a block boundary (block sizes: remote "
                         f"{remote_block_size}, local {local_block_size})")
    remote_ids = _as_ids(remote_block_ids, "remote")
    local_ids = _as_ids(local_block_ids, "local")
    for side, ids, size in (("remote", remote_ids, remote_block_size), ("local", local_ids, local_block_size)):
        needed = -(-num_tokens // size)
        if ids.size < needed:
            raise ValueError(f"{num_tokens} tokens need {needed} {side} blocks of {size}, got {ids.size}")
    return remote_ids, local_ids


def map_unit_arrays(
    remote_block_ids: Sequence[int] | np.ndarray,
    remote_block_size: int,
    local_block_ids: Sequence[int] | np.ndarray,
    local_block_size: int,
    num_tokens: int,
    start_token: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The units (``min(block sizes)`` tokens) covering tokens ``[start_token, num_tokens)``, as (remote, local)
    unit indices: ``block id * units per block + unit inside the block`` on each side.

    The same runs as :func:`map_block_arrays` with a partial last piece widened to its whole unit (the
    planner's ``pad_partial_blocks``), and the same checks; with equal block sizes a unit is a block and
    the indices are the tables' entries themselves::

        remote block 16, local block 4, tokens [4, 22) -> units of 4 tokens, 4 per remote block:
          remote  4*r0 + 1, 4*r0 + 2, 4*r0 + 3, 4*r1 + 0, 4*r1 + 1   (the last one padded: tokens 20..23)
          local   l1, l2, l3, l4, l5
    """
    remote_ids, local_ids = _checked_tables(remote_block_ids, remote_block_size, local_block_ids, local_block_size,
                                            num_tokens, start_token)
    unit = min(remote_block_size, local_block_size)
    first, last = start_token // unit, -(-num_tokens // unit)
    out = []
    for side, ids, size in (("remote", remote_ids, remote_block_size), ("local", local_ids, local_block_size)):
        per_block = size // unit
        if per_block == 1:
            units = ids[first:last]
            _check_ids(units, side)
        else:
            pos = np.arange(first, last, dtype=np.int64)
            blocks, within = np.divmod(pos, per_block)
            _check_ids(ids[blocks[0] : blocks[-1] + 1] if pos.size else ids[:0], side)
            units = ids[blocks] * per_block + within
        out.append(units)
    return out[0], out[1]


# ---- sliding window ----------------------------------------------------------------------------


def attends_whole_context(group: KVCacheGroupSpec) -> bool:
    """Whether the group's newest token attends to every earlier one (full attention, MLA): nothing is clipped."""
    return group.kind in (AttentionKind.FULL, AttentionKind.MLA)


def window_start_token(remote_group: KVCacheGroupSpec, local_group: KVCacheGroupSpec, num_tokens: int) -> int:
    """First token a transfer of this group must move; 0 for a group that attends over the whole context
    (full attention and MLA).

    The newest of ``num_tokens`` tokens attends to keys ``num_tokens - W ..``; each side keeps its
    blocks from the one holding that key (``first_needed_block``) and may have dropped the blocks
    before it (a placeholder id in the table). The start is the LATER of the two sides' first kept
    tokens, which is the finer side's: it is on a block boundary there, never before a block either
    side dropped, and never after the window's first key, so no needed token is cut. On the coarse
    side it may fall inside a block (map_blocks moves the rest of that block)::

        W=6, n=30, remote block 4, local block 8: key 24 ->
          remote keeps from block 24//4 = 6 (token 24), local from block 24//8 = 3 (token 24) -> 24
        W=10, n=22: key 12 -> remote keeps token 12.., local 8..             -> 12 (mid local block 1)
        W=10, n=10: the prompt is inside the window                            -> 0

    Block counts use ceil division (a window of W tokens spans up to cdiv(W - 1, bs) + 1 blocks),
    never ``W // bs``: a window that is not a multiple of the block size still gets its first block.
    """
    if remote_group.group_id != local_group.group_id:
        raise ValueError(f"group ids differ: remote {remote_group.group_id}, local {local_group.group_id}")
    if (remote_group.kind, remote_group.sliding_window) != (local_group.kind, local_group.sliding_window):
        raise ValueError(
            f"group {local_group.group_id} attends differently: "
            f"remote {remote_group.kind.value}(window={remote_group.sliding_window}), "
            f"local {local_group.kind.value}(window={local_group.sliding_window})"
        )
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if attends_whole_context(local_group):
        return 0
    block_unit(remote_group.block_size, local_group.block_size)
    return max(g.first_needed_block(num_tokens) * g.block_size for g in (remote_group, local_group))
