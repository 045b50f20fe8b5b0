"""The request-level KV-cache manager: tables across groups, prefix hits, hold and release (no torch).

The block pool and the hashes have their own tests: test_block_pool.py, test_block_hash.py.
"""

from __future__ import annotations

import copy
import math
import random

import pytest

from services.contract.prefix_keys import hash_request_blocks
from services.contract.sampling_params import SamplingParams
from services.engine.kv_cache.block_pool import BlockPool
from services.engine.kv_cache.group_managers import SlidingWindowManager
from services.engine.kv_cache.manager import KVCacheManager
from services.engine.request import Request
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from tests.unit.engine.kv_cache.test_block_pool import pool_state

BS = 4


def full_group(group_id: int = 0, block_size: int = BS) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(group_id, AttentionKind.FULL, (0,), block_size)


def make_kv(num_blocks: int = 16, **kwargs) -> KVCacheManager:
    return KVCacheManager([full_group()], [num_blocks], **kwargs)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def kv_state(kv: KVCacheManager, *requests: Request) -> tuple:
    pools = tuple(pool_state(m.pool) for m in kv.managers)
    return (pools, copy.deepcopy(kv._cursors), copy.deepcopy(kv._held),
            [(r.block_ids and [list(t) for t in r.block_ids], r.num_computed_tokens) for r in requests])


# ---- KV-cache manager ---------------------------------------------------------------------------


def test_allocate_slots_grows_tables_contiguously():
    kv = make_kv(16)
    r = req("a", range(10))
    assert r.block_ids == []
    assert kv.allocate_slots(r, 6) == [[0, 1]]
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 4) == [[2]]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 1) == [[]]  # position 10 still fits block 2
    assert r.block_ids == [[0, 1, 2]]
    assert kv.usage == 3 / 16


def test_prefix_hit_drops_last_block_and_is_shared():
    kv = make_kv(16)
    a = req("a", range(8))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a, 8)
    assert kv.pool(0).num_cached_blocks == 2

    same = req("b", range(8))
    computed, num_hit = kv.get_computed_blocks(same)
    assert computed == [[0]] and num_hit == 4  # the whole prompt is cached: keep one block to run

    longer = req("c", list(range(8)) + [99, 98])
    computed, num_hit = kv.get_computed_blocks(longer)
    assert computed == [[0, 1]] and num_hit == 8
    assert kv.pool(0).ref_count(0) == 1  # lookup takes no reference
    assert kv.allocate_slots(longer, 2, computed) == [[2]]
    assert longer.block_ids == [[0, 1, 2]] and kv.pool(0).ref_count(0) == 2

    other = req("d", [7] + list(range(1, 8)))
    assert kv.get_computed_blocks(other) == ([[]], 0)
    assert make_kv(16, enable_prefix_caching=False).get_computed_blocks(same) == ([[]], 0)


def test_cache_salt_separates_caches():
    salted, plain = make_kv(8, cache_salt=b"tenant"), make_kv(8)
    for kv in (salted, plain):
        r = req("a", range(8))
        kv.allocate_slots(r, 8)
        kv.cache_full_blocks(r, 8)
    assert salted.pool(0).block_hash(0) != plain.pool(0).block_hash(0)


def test_freed_blocks_are_revived_by_a_later_request():
    kv = make_kv(4)
    a = req("a", range(12))
    kv.allocate_slots(a, 12)
    kv.cache_full_blocks(a, 12)
    kv.free(a)
    assert a.block_ids == [] and kv.pool(0).num_free_blocks == 4
    b = req("b", list(range(12)) + [5])
    computed, num_hit = kv.get_computed_blocks(b)
    assert computed == [[0, 1, 2]] and num_hit == 12
    assert kv.can_allocate(b, 1, computed)
    assert kv.allocate_slots(b, 1, computed) == [[3]]  # a fresh block, not an eviction
    assert kv.pool(0).num_free_blocks == 0


def test_free_evicts_tail_blocks_first():
    kv = make_kv(4)
    a = req("a", range(16))
    kv.allocate_slots(a, 16)
    kv.cache_full_blocks(a, 16)
    kv.free(a)
    b = req("b", [100] * 4)
    kv.allocate_slots(b, 4)  # evicts one block: a's last
    assert b.block_ids == [[3]]
    _, num_hit = kv.get_computed_blocks(req("c", list(range(16)) + [1]))
    assert num_hit == 12  # the head of a's prefix survived


def test_revival_counts_against_free_space():
    kv = make_kv(3)
    a = req("a", range(8))
    kv.allocate_slots(a, 8)
    kv.cache_full_blocks(a, 8)
    kv.free(a)  # 3 free, 2 of them cached
    b = req("b", list(range(8)) + [1, 2, 3, 4, 5])
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # 5 new tokens need 2 new blocks, plus reviving the 2 hits = 4 > 3.
    assert not kv.can_allocate(b, 5, computed)
    before = kv_state(kv, b)
    assert kv.allocate_slots(b, 5, computed) is None
    assert kv_state(kv, b) == before
    assert kv.allocate_slots(b, 4, computed) == [[2]]


def test_failed_allocation_changes_nothing():
    kv = make_kv(6)
    a, b = req("a", range(12)), req("b", range(12))
    kv.allocate_slots(a, 12)
    kv.cache_full_blocks(a, 12)
    a.num_computed_tokens = 12
    before = kv_state(kv, a, b)
    assert kv.allocate_slots(a, 13) is None  # grow a running request
    computed, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 20, computed) is None  # first allocation with a prefix hit
    assert kv_state(kv, a, b) == before


def test_allocate_slots_rejects_bad_input():
    kv = make_kv(8)
    a = req("a", range(8))
    with pytest.raises(ValueError):
        kv.allocate_slots(a, -1)
    kv.allocate_slots(a, 8)
    kv.cache_full_blocks(a, 8)
    with pytest.raises(ValueError, match="already has blocks"):
        kv.allocate_slots(a, 1, [[0]])
    with pytest.raises(ValueError, match="groups"):
        kv.allocate_slots(req("b", range(8)), 1, [[0], [1]])
    kv.reset_prefix_cache()
    with pytest.raises(ValueError, match="no longer cached"):
        kv.allocate_slots(req("c", range(8)), 4, [[0]])


def test_a_reallocated_request_republishes_from_its_first_block():
    kv = make_kv(4)
    a = req("a", range(8))
    kv.allocate_slots(a, 8)
    kv.cache_full_blocks(a, 8)
    kv.free(a)  # e.g. preempted
    filler = req("x", [9] * 16)
    kv.allocate_slots(filler, 16)  # evicts a's cached blocks
    kv.free(filler)
    kv.allocate_slots(a, 8)  # recomputed into new blocks
    kv.cache_full_blocks(a, 8)
    computed, num_hit = kv.get_computed_blocks(req("b", list(range(8)) + [1]))
    assert num_hit == 8 and computed == a.block_ids


def test_hold_and_release():
    kv = make_kv(8)
    a = req("a", range(8))
    kv.allocate_slots(a, 8)
    kv.hold(a)
    assert a.block_ids == [[0, 1]]  # kept for building the transfer ticket
    assert kv.held_block_ids("a") == [[0, 1]]
    assert kv.stats()[0].num_held == 2 and kv.pool(0).num_used_blocks == 2
    with pytest.raises(ValueError, match="held"):
        kv.free(a)
    with pytest.raises(ValueError, match="already held"):
        kv.hold(a)
    assert kv.release("a") and not kv.release("a") and not kv.release("nope")
    assert kv.pool(0).num_free_blocks == 8 and kv.stats()[0].num_held == 0


def test_reset_prefix_cache_republishes_live_blocks():
    kv = make_kv(8)
    a = req("a", range(9))
    kv.allocate_slots(a, 9)
    kv.cache_full_blocks(a, 8)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(req("b", range(9)))[1] == 0
    kv.cache_full_blocks(a, 8)
    assert kv.get_computed_blocks(req("b", range(9)))[1] == 8


def test_two_groups_share_a_prefix_boundary():
    groups = [full_group(0, 4), KVCacheGroupSpec(1, AttentionKind.SLIDING_WINDOW, (1,), 8, sliding_window=8)]
    kv = KVCacheManager(groups, [16, 8])
    assert isinstance(kv.managers[1], SlidingWindowManager)
    a = req("a", range(20))
    assert kv.allocate_slots(a, 20) == [[0, 1, 2, 3, 4], [0, 1, 2]]
    kv.cache_full_blocks(a, 20)  # group 0: 5 full blocks, group 1: 2 full blocks
    computed, num_hit = kv.get_computed_blocks(req("b", range(21)))
    # The query at 16 sees keys 9..16: sliding block 0 (keys 0..7) is left out, as the placeholder.
    assert num_hit == 16 and computed == [[0, 1, 2, 3], [kv.placeholder_block_id(1), 1]]
    assert kv.placeholder_block_id(1) == 8 and kv.placeholder_block_id(0) == 16
    assert kv.managers[1].needed_blocks(a.block_ids[1], 20) == [1, 2]
    assert kv.managers[0].needed_blocks(a.block_ids[0], 20) == [0, 1, 2, 3, 4]
    full = req("c", range(30))
    before = kv_state(kv, full)
    assert kv.allocate_slots(full, 48) is None  # group 1 is short (6 > 5 free), group 0 is not
    assert kv_state(kv, full) == before
    kv.free(a)
    assert [s.num_free for s in kv.stats()] == [16, 8]


def test_manager_rejects_bad_groups():
    with pytest.raises(ValueError):
        KVCacheManager([], [])
    with pytest.raises(ValueError):
        KVCacheManager([full_group()], [4, 4])
    with pytest.raises(ValueError, match="in order"):
        KVCacheManager([full_group(1)], [4])
    with pytest.raises(ValueError):
        BlockPool(0)


# ---- sliding-window groups (more in test_sliding_window_blocks.py) ---------------------------------


def test_placeholder_is_one_past_each_pool_and_never_a_block():
    groups = [full_group(0), KVCacheGroupSpec(1, AttentionKind.SLIDING_WINDOW, (1,), BS, sliding_window=4)]
    kv = KVCacheManager(groups, [10, 6])
    assert [kv.placeholder_block_id(g) for g in (0, 1)] == [10, 6]
    assert kv.real_blocks(1, [6, 6, 3, 0]) == [3, 0]
    a = req("a", range(12))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    a.output_token_ids.append(1)
    kv.allocate_slots(a, 1)  # the query at 12 sees 9..12: sliding blocks 0 and 1 go
    assert a.block_ids == [[0, 1, 2, 3], [6, 6, 2, 3]]
    assert [s.num_used for s in kv.stats()] == [4, 2] and kv.usage == 6 / 16


def test_can_ever_fit_counts_a_window_per_group():
    sliding = KVCacheGroupSpec(1, AttentionKind.SLIDING_WINDOW, (1,), BS, sliding_window=8)
    kv = KVCacheManager([full_group(0), sliding], [64, 5])
    # Sliding: a step of m tokens holds keys c - 7 .. c + m - 1: (8 - 2 + m) // 4 + 2 blocks.
    assert kv.managers[1].max_blocks_held(200, 1) == 3 and kv.managers[1].max_blocks_held(200, 8) == 5
    assert kv.managers[1].max_blocks_held(6, 8) == 2  # never more than the request's own blocks
    assert kv.can_ever_fit(200, max_step_tokens=8) and not kv.can_ever_fit(200, max_step_tokens=10)
    assert not kv.can_ever_fit(200)  # a step may compute everything at once: every block
    assert not kv.can_ever_fit(260, max_step_tokens=1)  # the full group: 65 > 64
    kept = KVCacheManager([full_group(0), sliding], [64, 5], free_out_of_window=False)
    assert not kept.can_ever_fit(200, max_step_tokens=1)


def test_prefix_hit_matches_brute_force_with_a_sliding_group():
    rng = random.Random(3)
    for _ in range(300):
        full_bs, sliding_bs = rng.choice([(4, 4), (4, 8), (8, 4), (2, 4)])
        window = rng.randint(1, 20)
        groups = [full_group(0, full_bs),
                  KVCacheGroupSpec(1, AttentionKind.SLIDING_WINDOW, (1,), sliding_bs, sliding_window=window)]
        kv = KVCacheManager(groups, [64, 64])
        tokens = [rng.randrange(5) for _ in range(rng.randint(1, 60))]
        cached = []
        for g, bs in ((0, full_bs), (1, sliding_bs)):
            hashes = hash_request_blocks(tokens, bs)
            indices = [i for i in range(len(hashes)) if rng.random() < (0.9 if g == 0 else 0.6)]
            for i in indices:
                (block,) = kv.pool(g).allocate(1)
                kv.pool(g).cache_block(block, hashes[i])
                kv.pool(g).free([block])
            cached.append(set(indices))
        expected = 0
        lcm = full_bs * sliding_bs // math.gcd(full_bs, sliding_bs)
        for n in range(len(tokens) - 1, 0, -1):
            if n % lcm:
                continue
            first = max(0, n + 1 - window) // sliding_bs
            if (all(i in cached[0] for i in range(n // full_bs))
                    and all(i in cached[1] for i in range(first, n // sliding_bs))):
                expected = n
                break
        computed, num_hit = kv.get_computed_blocks(req("r", tokens))
        assert num_hit == expected, (full_bs, sliding_bs, window, len(tokens), cached)
        if num_hit:
            k = max(0, num_hit + 1 - window) // sliding_bs
            assert computed[1][:k] == [64] * k and 64 not in computed[1][k:]
            assert len(computed[0]) * full_bs == len(computed[1]) * sliding_bs == num_hit
            r = req("r", tokens)
            assert kv.allocate_slots(r, len(tokens) - num_hit, computed) is not None
            assert r.block_ids[1][:k] == [64] * k
