"""TP rank mapping, block-size mapping and sliding-window clipping between prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.parallel import ParallelConfig
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.topology import (
    BlockPiece,
    RankRead,
    check_tp,
    group_rank_reads,
    group_readers_per_remote_rank,
    kv_head_range,
    map_blocks,
    rank_reads,
    readers_per_remote_rank,
    window_start_token,
)

VALID = [(tp, h) for h in (1, 2, 4, 8) for tp in (1, 2, 4, 8) if h % tp == 0 or tp % h == 0]


def rr(rank: int, remote: tuple[int, int], local: tuple[int, int]) -> RankRead:
    return RankRead(rank, remote, local)


# ---- TP ranks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "heads"), VALID)
def test_head_range_matches_engine_sharding(tp: int, heads: int) -> None:
    for rank in range(tp):
        assert kv_head_range(tp, rank, heads) == ParallelConfig(tp, rank).kv_head_range(heads)


@pytest.mark.parametrize(
    ("local_tp", "local_rank", "remote_tp", "heads", "expected"),
    [
        # equal TP: rank r reads all of remote rank r
        (2, 0, 2, 8, (rr(0, (0, 4), (0, 4)),)),
        (2, 1, 2, 8, (rr(1, (0, 4), (0, 4)),)),
        # 1 -> 2 (decode has more ranks): each decode rank reads its slice of the one prefill rank
        (2, 0, 1, 8, (rr(0, (0, 4), (0, 4)),)),
        (2, 1, 1, 8, (rr(0, (4, 8), (0, 4)),)),
        # 2 -> 1: the decode rank concatenates heads from both prefill ranks
        (1, 0, 2, 8, (rr(0, (0, 4), (0, 4)), rr(1, (0, 4), (4, 8)))),
        # 2 -> 4 and 4 -> 2
        (4, 3, 2, 8, (rr(1, (2, 4), (0, 2)),)),
        (4, 2, 2, 8, (rr(1, (0, 2), (0, 2)),)),
        (2, 1, 4, 8, (rr(2, (0, 2), (0, 2)), rr(3, (0, 2), (2, 4)))),
        # replicated heads (num_kv_heads=2): equal TP 4 pairs rank r with rank r
        (4, 1, 4, 2, (rr(1, (0, 1), (0, 1)),)),
        (4, 2, 4, 2, (rr(2, (0, 1), (0, 1)),)),
        # decode replicates, prefill does not
        (4, 3, 1, 2, (rr(0, (1, 2), (0, 1)),)),
        (4, 1, 2, 2, (rr(0, (0, 1), (0, 1)),)),
        # prefill replicates, decode does not: each head read once, from one holder
        (1, 0, 4, 2, (rr(0, (0, 1), (0, 1)), rr(2, (0, 1), (1, 2)))),
        (2, 1, 4, 2, (rr(2, (0, 1), (0, 1)),)),
        # both replicate, differently: replica 1 of head 1 on decode -> replica 1 on prefill
        (8, 5, 4, 2, (rr(3, (0, 1), (0, 1)),)),
        (4, 3, 8, 2, (rr(5, (0, 1), (0, 1)),)),
        # one KV head (MQA)
        (4, 2, 2, 1, (rr(0, (0, 1), (0, 1)),)),
    ],
)
def test_rank_reads_cases(local_tp, local_rank, remote_tp, heads, expected) -> None:
    assert rank_reads(local_tp, local_rank, remote_tp, heads) == expected


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "heads", "expected"),
    [
        (2, 2, 8, (1, 1)),
        (2, 1, 8, (2,)),
        (1, 2, 8, (1, 1)),
        (4, 2, 8, (2, 2)),
        (2, 4, 8, (1, 1, 1, 1)),
        (4, 4, 2, (1, 1, 1, 1)),
        (4, 2, 2, (2, 2)),
        (1, 4, 2, (1, 0, 1, 0)),
        (2, 4, 2, (1, 0, 1, 0)),
        (8, 4, 2, (2, 2, 2, 2)),
    ],
)
def test_readers_per_remote_rank(local_tp, remote_tp, heads, expected) -> None:
    assert readers_per_remote_rank(local_tp, remote_tp, heads) == expected


@pytest.mark.parametrize(
    ("heads", "local_tp", "remote_tp"), [(h, a, b) for (a, h) in VALID for (b, g) in VALID if g == h]
)
def test_rank_reads_cover_each_head_once_from_a_holder(heads: int, local_tp: int, remote_tp: int) -> None:
    counts = [0] * remote_tp
    for local_rank in range(local_tp):
        ls, le = ParallelConfig(local_tp, local_rank).kv_head_range(heads)
        reads = rank_reads(local_tp, local_rank, remote_tp, heads)
        covered = []
        for read in reads:
            rs, re_ = ParallelConfig(remote_tp, read.remote_rank).kv_head_range(heads)
            global_heads = [rs + h for h in range(*read.remote_heads)]
            assert all(rs <= h < re_ for h in global_heads)  # the remote rank holds what it is asked for
            assert global_heads == [ls + h for h in range(*read.local_heads)]  # and it lands in place
            covered += global_heads
        assert sorted(covered) == list(range(ls, le))
        for rank in {r.remote_rank for r in reads}:
            counts[rank] += 1
    assert readers_per_remote_rank(local_tp, remote_tp, heads) == tuple(counts)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((3, 0, 1, 8), "local tp size 3 and num_kv_heads 8"),
        ((2, 0, 3, 8), "remote tp size 3 and num_kv_heads 8"),
        ((4, 0, 1, 6), "local tp size 4 and num_kv_heads 6"),
        ((2, 2, 1, 8), "rank 2 out of range"),
        ((2, -1, 1, 8), "rank -1 out of range"),
        ((0, 0, 1, 8), "tp size must be >= 1"),
        ((1, 0, 1, 0), "num_kv_heads must be >= 1"),
    ],
)
def test_rank_reads_refuses_impossible_pairs(args, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rank_reads(*args)


def test_group_rank_reads_shard_each_group_by_its_own_heads() -> None:
    # TP 1 <- TP 1: a full group of 2 heads and a sliding group of 4, each read whole
    assert group_rank_reads(1, 0, 1, {0: 2, 1: 4}) == {0: {0: rr(0, (0, 2), (0, 2)), 1: rr(0, (0, 4), (0, 4))}}
    # TP 2 <- TP 1 with 8 and 2 heads: local rank 1 reads heads 4..7 of group 0 and head 1 of group 1
    assert group_rank_reads(2, 1, 1, {0: 8, 1: 2}) == {0: {0: rr(0, (4, 8), (0, 4)), 1: rr(0, (1, 2), (0, 1))}}
    # TP 1 <- TP 2: the same remote ranks for every group when heads agree
    reads = group_rank_reads(1, 0, 2, {0: 4, 1: 4})
    assert sorted(reads) == [0, 1] and all(sorted(v) == [0, 1] for v in reads.values())
    for gid in (0, 1):
        assert tuple(reads[r][gid] for r in (0, 1)) == rank_reads(1, 0, 2, 4)


def _check_group_reads(local_tp: int, remote_tp: int, heads_by_group: dict[int, int]) -> tuple[int, ...]:
    """Every local head of every group is read exactly once, from a remote rank that holds it, into
    its own place; returns the distinct (local rank, remote rank) reads per remote rank."""
    counts = [0] * remote_tp
    for local_rank in range(local_tp):
        reads = group_rank_reads(local_tp, local_rank, remote_tp, heads_by_group)
        for gid, heads in heads_by_group.items():
            ls, le = ParallelConfig(local_tp, local_rank).kv_head_range(heads)
            covered = []
            for remote_rank, by_group in reads.items():
                if gid not in by_group:
                    continue
                read = by_group[gid]
                assert read.remote_rank == remote_rank
                rs, re_ = ParallelConfig(remote_tp, remote_rank).kv_head_range(heads)
                global_heads = [rs + h for h in range(*read.remote_heads)]
                assert all(rs <= h < re_ for h in global_heads), (gid, remote_rank, read)
                assert global_heads == [ls + h for h in range(*read.local_heads)]
                covered += global_heads
            assert sorted(covered) == list(range(ls, le)), (local_rank, gid)
        for remote_rank in reads:
            counts[remote_rank] += 1
    return tuple(counts)


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "heads_by_group", "readers"),
    [
        # 3 KV heads (neither a power of two): tp 1 <-> tp 3
        (1, 3, {0: 3}, (1, 1, 1)),
        (3, 1, {0: 3}, (3,)),
        (3, 3, {0: 3}, (1, 1, 1)),
        # 2 KV heads, local tp 4 (each head on two local ranks) <- remote tp 1 and tp 2
        (4, 1, {0: 2}, (4,)),
        (4, 2, {0: 2}, (2, 2)),
        # 8 KV heads, tp 2 <-> tp 4
        (2, 4, {0: 8}, (1, 1, 1, 1)),
        (4, 2, {0: 8}, (2, 2)),
        # 1 KV head (MQA), tp 2 <-> tp 1: replicated locally, or read once from one remote replica
        (2, 1, {0: 1}, (2,)),
        (1, 2, {0: 1}, (1, 0)),
        # groups with their own heads (group 0: 2, group 1: 4), a local rank counted once per remote rank
        (2, 1, {0: 2, 1: 4}, (2,)),
        (1, 2, {0: 2, 1: 4}, (1, 1)),
        (2, 4, {0: 2, 1: 4}, (1, 1, 1, 1)),
        (4, 2, {0: 2, 1: 4}, (2, 2)),
        (4, 4, {0: 2, 1: 4}, (1, 1, 1, 1)),
        # a replicated remote group read from replica 0 only: remote rank 1 is read for group 0 alone
        (1, 2, {0: 2, 1: 1}, (1, 1)),
        (1, 4, {0: 2, 1: 8}, (1, 1, 1, 1)),
        (1, 4, {0: 2, 1: 1}, (1, 0, 1, 0)),
    ],
)
def test_group_reads_cover_each_head_once_from_a_holder(local_tp, remote_tp, heads_by_group, readers) -> None:
    assert _check_group_reads(local_tp, remote_tp, heads_by_group) == readers
    assert group_readers_per_remote_rank(local_tp, remote_tp, heads_by_group) == readers


@settings(max_examples=80, deadline=None)
@given(
    local_tp=st.sampled_from([1, 2, 3, 4, 6, 8]),
    remote_tp=st.sampled_from([1, 2, 3, 4, 6, 8]),
    heads=st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), min_size=1, max_size=3),
)
def test_group_reads_property(local_tp: int, remote_tp: int, heads: list[int]) -> None:
    heads_by_group = dict(enumerate(heads))
    if any(h % t and t % h for h in heads for t in (local_tp, remote_tp)):
        with pytest.raises(ValueError, match="neither divides"):
            group_readers_per_remote_rank(local_tp, remote_tp, heads_by_group)
        return
    readers = group_readers_per_remote_rank(local_tp, remote_tp, heads_by_group)
    assert _check_group_reads(local_tp, remote_tp, heads_by_group) == readers
    # no local rank is counted twice on one remote rank, and every remote head is somebody's read
    assert all(0 <= n <= local_tp for n in readers) and sum(readers) >= max(1, min(local_tp, remote_tp))


def test_readers_counts_a_local_rank_once_across_groups() -> None:
    # local 0 reads remote 0 for both groups (and remote 1 for group 0): one notification each
    assert group_rank_reads(1, 0, 2, {0: 2, 1: 1}) == {0: {0: rr(0, (0, 1), (0, 1)), 1: rr(0, (0, 1), (0, 1))},
                                                       1: {0: rr(1, (0, 1), (1, 2))}}
    assert group_readers_per_remote_rank(1, 2, {0: 2, 1: 1}) == (1, 1)
    assert group_readers_per_remote_rank(2, 2, {0: 8, 1: 8}) == readers_per_remote_rank(2, 2, 8) == (1, 1)
    with pytest.raises(ValueError, match="at least one KV group"):
        group_readers_per_remote_rank(1, 1, {})


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "heads_by_group", "match"),
    [
        (2, 1, {0: 3}, "local tp size 2 and num_kv_heads 3: neither divides the other"),
        (1, 2, {0: 3}, "remote tp size 2 and num_kv_heads 3: neither divides the other"),
        (2, 2, {0: 4, 1: 3}, "local tp size 2 and num_kv_heads 3"),
        (4, 1, {0: 8, 1: 6}, "local tp size 4 and num_kv_heads 6"),
    ],
)
def test_group_reads_refuse_heads_a_tp_size_cannot_shard(local_tp, remote_tp, heads_by_group, match) -> None:
    with pytest.raises(ValueError, match=match):
        group_rank_reads(local_tp, 0, remote_tp, heads_by_group)
    with pytest.raises(ValueError, match=match):
        group_readers_per_remote_rank(local_tp, remote_tp, heads_by_group)


def test_rank_read_refuses_bad_ranges() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        RankRead(0, (0, 2), (0, 1))
    with pytest.raises(ValueError, match="empty"):
        RankRead(0, (1, 1), (0, 0))
    with pytest.raises(ValueError, match="remote_rank"):
        RankRead(-1, (0, 1), (0, 1))
    with pytest.raises(ValueError, match="neither divides"):
        check_tp(3, 8)


# ---- blocks ------------------------------------------------------------------------------------


def test_map_blocks_equal_sizes_is_one_piece_per_block() -> None:
    pieces = map_blocks([7, 3, 9], 4, [1, 2, 5], 4, 10)
    assert pieces == (BlockPiece(7, 0, 1, 0, 4), BlockPiece(3, 0, 2, 0, 4), BlockPiece(9, 0, 5, 0, 2))


def test_map_blocks_remote_larger_1_to_4() -> None:
    # remote block 16 holds four local blocks of 4; tokens [4, 22), local prefix block 0 held
    pieces = map_blocks([10, 11], 16, [0, 1, 2, 3, 4, 5], 4, 22, start_token=4)
    assert pieces == (
        BlockPiece(10, 4, 1, 0, 4),
        BlockPiece(10, 8, 2, 0, 4),
        BlockPiece(10, 12, 3, 0, 4),
        BlockPiece(11, 0, 4, 0, 4),
        BlockPiece(11, 4, 5, 0, 2),  # partial last block: only the 2 tokens that exist
    )


def test_map_blocks_remote_smaller_4_to_1() -> None:
    # four remote blocks of 4 fill one local block of 16; prefix of one local block (16) held
    pieces = map_blocks([20, 21, 22, 23, 24, 25], 4, [8, 9], 16, 22, start_token=16)
    assert pieces == (BlockPiece(24, 0, 9, 0, 4), BlockPiece(25, 0, 9, 4, 2))
    pieces = map_blocks(np.array([20, 21, 22, 23, 24]), 4, np.array([8, 9]), 16, 18)
    assert [(p.remote_block, p.local_block, p.local_offset) for p in pieces] == [
        (20, 8, 0),
        (21, 8, 4),
        (22, 8, 8),
        (23, 8, 12),
        (24, 9, 0),
    ]
    assert pieces[-1].num_tokens == 2


def test_map_blocks_16_to_64_with_a_start_token() -> None:
    # remote 16, local 64: tokens [64, 150) start at local block 1; remote blocks 4.. fill it in quarters
    remote = list(range(200, 210))
    pieces = map_blocks(remote, 16, [50, 51, 52], 64, 150, start_token=64)
    assert pieces == (
        BlockPiece(204, 0, 51, 0, 16),
        BlockPiece(205, 0, 51, 16, 16),
        BlockPiece(206, 0, 51, 32, 16),
        BlockPiece(207, 0, 51, 48, 16),
        BlockPiece(208, 0, 52, 0, 16),
        BlockPiece(209, 0, 52, 16, 6),
    )
    # a sliding-window start on the fine (remote) side, inside local block 1
    assert map_blocks(remote, 16, [50, 51, 52], 64, 100, start_token=96)[0] == BlockPiece(206, 0, 51, 32, 4)


def test_map_blocks_64_to_16_with_a_start_token() -> None:
    # remote 64, local 16: tokens [32, 100): quarters of remote block 0, then of remote block 1
    local = list(range(300, 307))
    pieces = map_blocks([70, 71], 64, local, 16, 100, start_token=32)
    assert pieces == (
        BlockPiece(70, 32, 302, 0, 16),
        BlockPiece(70, 48, 303, 0, 16),
        BlockPiece(71, 0, 304, 0, 16),
        BlockPiece(71, 16, 305, 0, 16),
        BlockPiece(71, 32, 306, 0, 4),
    )
    assert sum(p.num_tokens for p in pieces) == 100 - 32
    with pytest.raises(ValueError, match="not on a block boundary"):
        map_blocks([70, 71], 64, local, 16, 100, start_token=40)


@settings(max_examples=60, deadline=None)
@given(
    small=st.sampled_from([1, 2, 4]),
    ratio=st.sampled_from([(1, 4), (1, 2), (1, 1), (2, 1), (4, 1)]),
    num_tokens=st.integers(0, 40),
    skip=st.integers(0, 10),
    seed=st.integers(0, 2**16),
)
def test_map_blocks_matches_token_by_token(small, ratio, num_tokens, skip, seed) -> None:
    remote_bs, local_bs = small * ratio[0], small * ratio[1]
    rng = np.random.default_rng(seed)
    remote_ids = rng.permutation(100)[: -(-num_tokens // remote_bs) + 1]
    local_ids = rng.permutation(100)[: -(-num_tokens // local_bs)]
    start = min(skip, num_tokens // local_bs) * local_bs
    pieces = map_blocks(remote_ids, remote_bs, local_ids, local_bs, num_tokens, start)
    seen = []
    for p in pieces:
        assert 0 < p.num_tokens <= min(remote_bs, local_bs)
        for i in range(p.num_tokens):
            seen.append((p.remote_block, p.remote_offset + i, p.local_block, p.local_offset + i))
    expected = [
        (remote_ids[t // remote_bs], t % remote_bs, local_ids[t // local_bs], t % local_bs)
        for t in range(start, num_tokens)
    ]
    assert seen == expected


def test_map_blocks_prefix_and_placeholders() -> None:
    assert map_blocks([1, 2], 4, [3, 4], 4, 8, start_token=8) == ()
    assert map_blocks(np.array([], dtype=np.int64), 4, np.array([], dtype=np.int64), 4, 0) == ()
    # ids before the start are not read (a sliding window's dropped blocks may be placeholders)
    assert map_blocks([-1, -1, 5], 4, [-1, -1, 6], 4, 10, start_token=8) == (BlockPiece(5, 0, 6, 0, 2),)
    # the engine's placeholder is a real id (the scratch block), repeated: fine outside the range
    assert map_blocks([99, 99, 5], 4, [98, 98, 6], 4, 10, start_token=8) == (BlockPiece(5, 0, 6, 0, 2),)


def test_map_blocks_start_inside_a_coarse_local_block() -> None:
    # a window start on the fine (remote) side falls inside local block 1 (tokens 16..31): its
    # first 8 slots are older than the window and stay as they are
    pieces = map_blocks(list(range(100, 108)), 4, [0, 1], 16, 30, start_token=24)
    assert pieces == (BlockPiece(106, 0, 1, 8, 4), BlockPiece(107, 0, 1, 12, 2))


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([1, 2], 6, [1, 2], 4, 8), {}, "do not divide each other"),
        (([1, 2], 0, [1, 2], 4, 8), {}, "block sizes must be >= 1"),
        (([1], 4, [1, 2], 4, 8), {}, "need 2 remote blocks"),
        (([1, 2], 4, [1], 4, 5), {}, "need 2 local blocks"),
        (([1, 2], 4, [1, 2], 4, -1), {}, "num_tokens"),
        (([1, 2], 4, [1, 2], 4, 8), {"start_token": 9}, "outside"),
        (([1, 2], 16, [1, 2, 3, 4], 4, 8), {"start_token": 2}, "not on a block boundary"),
        (([1, 2, 3, 4], 4, [1, 2], 16, 16), {"start_token": 6}, "not on a block boundary"),
        (([1, 1], 4, [1, 2], 4, 8), {}, "remote block ids repeat"),
        (([1, 2], 4, [3, 3], 4, 8), {}, "local block ids repeat"),
        (([1, -2], 4, [1, 2], 4, 8), {}, "must be >= 0"),
        (([1.5, 2], 4, [1, 2], 4, 8), {}, "integers"),
    ],
)
def test_map_blocks_refusals(args, kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        map_blocks(*args, **kwargs)


# ---- sliding window ----------------------------------------------------------------------------


def sw(block_size: int, window: int, group_id: int = 1) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(group_id, AttentionKind.SLIDING_WINDOW, (1,), block_size, window)


def test_window_start_examples() -> None:
    full = KVCacheGroupSpec(0, AttentionKind.FULL, (0,), 4)
    assert window_start_token(full, KVCacheGroupSpec(0, AttentionKind.FULL, (0,), 16), 1000) == 0
    assert window_start_token(sw(4, 6), sw(8, 6), 30) == 24
    assert window_start_token(sw(4, 6), sw(8, 6), 22) == 16
    # key 12: the remote (block 4) keeps 12.., the local (block 8) 8..: start at the later one
    assert window_start_token(sw(4, 10), sw(8, 10), 22) == 12
    assert window_start_token(sw(8, 10), sw(4, 10), 22) == 12  # symmetric in direction
    assert window_start_token(sw(4, 10), sw(4, 10), 10) == 0  # whole prompt inside the window


@pytest.mark.parametrize(
    ("block_size", "window", "num_tokens", "start"),
    [
        (4, 5, 13, 8),  # window not a multiple of the block size: key 8 -> block 2
        (4, 5, 14, 8),  # key 9 is inside block 2: the block is kept whole (floor, not round)
        (4, 5, 17, 12),
        (16, 1024, 8192, 7168),  # Gemma-3 shape: key 7168 = block 448 exactly
        (16, 1000, 8192, 7184),  # key 7192 -> block 449 (7184..7199), not 7192 // 16 * 16 + 16
        (4, 8, 3, 0),  # prompt shorter than the window
        (4, 8, 8, 0),  # prompt exactly the window
        (4, 8, 9, 0),  # key 1: block 0 still needed
        (4, 8, 12, 4),
        (4, 8, 0, 0),
    ],
)
def test_window_start_edges(block_size: int, window: int, num_tokens: int, start: int) -> None:
    g = sw(block_size, window)
    assert window_start_token(g, g, num_tokens) == start
    # the blocks moved cover the window: cdiv arithmetic, never W // block_size
    moved = -(-num_tokens // block_size) - start // block_size
    needed = min(-(-num_tokens // block_size), -(-(window - 1) // block_size) + 1) if num_tokens else 0
    assert moved <= needed
    assert start <= max(0, num_tokens - window)


def test_window_start_never_reaches_a_block_either_side_dropped() -> None:
    # Remote block 4, local block 16, W=6, n=30: the remote dropped blocks 0..5 (placeholder 99),
    # the local keeps local block 1 (tokens 16..31). A start at the coarse boundary (16) would read
    # placeholders; the start is the remote's first kept token.
    remote_ids, local_ids = [99] * 6 + [20, 21], [98, 4]
    start = window_start_token(sw(4, 6), sw(16, 6), 30)
    assert start == 24
    pieces = map_blocks(remote_ids, 4, local_ids, 16, 30, start)
    assert {p.remote_block for p in pieces} == {20, 21} and {p.local_block for p in pieces} == {4}
    # and the other way round: the local (block 4) dropped blocks 0..5, the remote (block 16) keeps 16..31
    start = window_start_token(sw(16, 6), sw(4, 6), 30)
    pieces = map_blocks([97, 7], 16, [98] * 6 + [30, 31], 4, 30, start)
    assert {p.local_block for p in pieces} == {30, 31} and {p.remote_block for p in pieces} == {7}


@settings(max_examples=80, deadline=None)
@given(
    small=st.sampled_from([1, 2, 4, 8]),
    ratio=st.sampled_from([(1, 4), (1, 2), (1, 1), (2, 1), (4, 1)]),
    window=st.integers(1, 64),
    num_tokens=st.integers(0, 200),
)
def test_window_start_is_a_boundary_both_sides_keep(small, ratio, window, num_tokens) -> None:
    remote, local = sw(small * ratio[0], window), sw(small * ratio[1], window)
    start = window_start_token(remote, local, num_tokens)
    fine = min(remote.block_size, local.block_size)
    assert start % fine == 0  # a boundary on the finer side (map_blocks' runs stay inside blocks)
    for g in (remote, local):
        # never before a block either side may have dropped (a placeholder)...
        assert start >= g.first_needed_block(num_tokens) * g.block_size
    assert start <= max(0, num_tokens - window)  # ...and the newest token's window is fully covered
    # clipping is tight: the next fine block boundary would cut into the window
    assert start + fine > max(0, num_tokens - window)


def test_window_start_refusals() -> None:
    with pytest.raises(ValueError, match="attends differently"):
        window_start_token(sw(4, 6), sw(4, 8), 20)
    with pytest.raises(ValueError, match="group ids differ"):
        window_start_token(sw(4, 6, group_id=1), sw(4, 6, group_id=2), 20)
    with pytest.raises(ValueError, match="do not divide each other"):
        window_start_token(sw(4, 6), sw(6, 6), 20)
