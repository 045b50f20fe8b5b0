"""TP rank mapping, block-size mapping and sliding-window clipping between prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.parallel import ParallelConfig
from services.kv.groups import AttentionKind, KVCacheGroupSpec
from services.kv.topology import (
    BlockPiece,
    RankRead,
    check_tp,
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


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([1, 2], 6, [1, 2], 4, 8), {}, "neither divides"),
        (([1, 2], 0, [1, 2], 4, 8), {}, "block sizes must be >= 1"),
        (([1], 4, [1, 2], 4, 8), {}, "need 2 remote blocks"),
        (([1, 2], 4, [1], 4, 5), {}, "need 2 local blocks"),
        (([1, 2], 4, [1, 2], 4, -1), {}, "num_tokens"),
        (([1, 2], 4, [1, 2], 4, 8), {"start_token": 9}, "outside"),
        (([1, 2], 16, [1, 2, 3, 4], 4, 8), {"start_token": 2}, "local block boundary"),
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
    assert window_start_token(sw(4, 10), sw(8, 10), 22) == 8
    assert window_start_token(sw(8, 10), sw(4, 10), 22) == 8  # symmetric in direction
    assert window_start_token(sw(4, 10), sw(4, 10), 10) == 0  # whole prompt inside the window


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
    for g in (remote, local):
        assert start % g.block_size == 0
        assert start <= g.first_needed_block(num_tokens) * g.block_size  # nothing either side needs is cut
    assert start <= max(0, num_tokens - window)  # the newest token's window is fully covered
    # and clipping is tight: the next coarse block boundary would cut into the window
    coarse = max(remote.block_size, local.block_size)
    assert start + coarse > max(0, num_tokens - window)


def test_window_start_refusals() -> None:
    with pytest.raises(ValueError, match="attends differently"):
        window_start_token(sw(4, 6), sw(4, 8), 20)
    with pytest.raises(ValueError, match="group ids differ"):
        window_start_token(sw(4, 6, group_id=1), sw(4, 6, group_id=2), 20)
    with pytest.raises(ValueError, match="neither divides"):
        window_start_token(sw(4, 6), sw(6, 6), 20)
