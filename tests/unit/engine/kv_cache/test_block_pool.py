"""One group's block pool: contiguous allocation, reference counts and the prefix cache's map (no torch)."""

from __future__ import annotations

import random
import time

import pytest

from services.contract.prefix_keys import hash_block_tokens
from services.engine.kv_cache.block_pool import BlockPool


def runs(block_ids: list[int]) -> int:
    """Number of maximal ascending consecutive runs (one transfer descriptor each)."""
    return sum(1 for i, b in enumerate(block_ids) if i == 0 or b != block_ids[i - 1] + 1)


def pool_state(pool: BlockPool) -> tuple:
    free = [b for b in range(pool.num_blocks) if pool._fresh.is_free(b)]
    return (list(pool._ref_counts), list(pool._hashes), dict(pool._by_hash), list(pool._evictable), free)


# ---- block pool: contiguity ---------------------------------------------------------------------


def test_allocation_returns_ascending_runs():
    pool = BlockPool(10)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(3) == [5, 6, 7]
    pool.free([3, 4])
    pool.free([0])
    assert pool.allocate(2) == [3, 4]  # lowest run that fits, not the lone block 0
    assert pool.allocate(0) == []


def test_allocation_without_a_fitting_run_uses_fewest_runs():
    pool = BlockPool(12)
    pool.allocate(12)
    pool.free([0, 3, 4, 6, 7, 8, 10])  # runs: [0], [3, 4], [6, 7, 8], [10]
    got = pool.allocate(5)
    assert runs(got) == 2 and sorted(got) == [3, 4, 6, 7, 8]


def test_allocation_continues_after_prefer_after():
    pool = BlockPool(12)
    pool.allocate(12)
    pool.free([1, 2, 7, 8, 9])
    assert pool.allocate(2, prefer_after=6) == [7, 8]  # not the lower run 1..2
    assert pool.allocate(2, prefer_after=9) == [1, 2]  # 10 is used: lowest run instead
    assert pool.allocate(1, prefer_after=11) == [9]  # past the end is fine
    pool.free([3, 5, 6, 7])
    assert pool.allocate(3, prefer_after=2) == [5, 6, 7]  # 3 alone is too short; one run beats two
    pool.free([4, 8])
    assert pool.allocate(3, prefer_after=7) == [8, 3, 4]  # no run of 3: continue, then the rest
    with pytest.raises(ValueError):
        pool.allocate(1, prefer_after=12)


def test_allocation_when_full_returns_none_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = pool_state(pool)
    assert pool.allocate(2) is None
    assert pool_state(pool) == before
    with pytest.raises(ValueError):
        pool.allocate(-1)


def _lowest_fitting_run(free: set[int], n: int, num_blocks: int) -> int | None:
    length = 0
    for b in range(num_blocks):
        length = length + 1 if b in free else 0
        if length == n:
            return b - n + 1
    return None


def _min_runs(free: set[int], n: int, num_blocks: int) -> int:
    lengths, length = [], 0
    for b in range(num_blocks + 1):
        if b in free:
            length += 1
        elif length:
            lengths.append(length)
            length = 0
    count = 0
    for length in sorted(lengths, reverse=True):
        if n <= 0:
            break
        n -= length
        count += 1
    return count


def test_allocation_matches_brute_force_on_random_workloads():
    rng = random.Random(0)
    for num_blocks in (1, 7, 64, 100):
        pool, owned, free = BlockPool(num_blocks), [], set(range(num_blocks))
        for _ in range(400):
            if owned and rng.random() < 0.45:
                blocks = owned.pop(rng.randrange(len(owned)))
                pool.free(blocks)
                free |= set(blocks)
                continue
            n = rng.randint(1, max(1, num_blocks // 4))
            got = pool.allocate(n)
            if n > len(free):
                assert got is None
                continue
            start = _lowest_fitting_run(free, n, num_blocks)
            if start is not None:
                assert got == list(range(start, start + n))
            else:
                assert sorted(got) == got and runs(got) == _min_runs(free, n, num_blocks)
            assert set(got) <= free and len(set(got)) == n
            free -= set(got)
            owned.append(got)
            assert pool.num_free_blocks == len(free)


def test_large_pool_allocation_is_fast():
    pool = BlockPool(100_000)
    start = time.perf_counter()
    tables = [pool.allocate(64) for _ in range(1_000)]
    for table in tables[::2]:
        pool.free(table[::-1])
    for _ in range(2_000):
        assert pool.allocate(1) is not None
    assert time.perf_counter() - start < 3.0
    assert pool.num_used_blocks == 500 * 64 + 2_000


# ---- block pool: refcounts and the prefix cache ---------------------------------------------------


def test_refcounts_and_over_free():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_block(a[0], b"h" * 16)
    pool.touch(a)
    assert [pool.ref_count(b) for b in a] == [2, 2]
    pool.free(a)
    assert pool.num_used_blocks == 2
    before = pool_state(pool)
    with pytest.raises(ValueError, match="more often"):
        pool.free([a[1], a[1]])
    assert pool_state(pool) == before
    pool.free(a)
    assert pool.num_free_blocks == 4 and pool.num_evictable_blocks == 1
    with pytest.raises(ValueError, match="no cached content"):
        pool.touch([a[1]])  # fresh-free: nothing to revive


def test_cache_block_rules():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert pool.cache_block(a, h) and pool.cache_block(a, h)  # idempotent
    assert not pool.cache_block(b, h)  # duplicate content stays an ordinary block
    assert pool.lookup(h) == a and pool.block_hash(b) is None
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_block(a, hash_block_tokens(None, [9]))
    with pytest.raises(ValueError, match="free"):
        pool.cache_block(3, h)
    pool.free([a, b])
    assert pool.num_cached_blocks == 1 and pool.num_evictable_blocks == 1


def test_fresh_blocks_are_used_before_evicting_and_eviction_is_lru():
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, hash_block_tokens(None, [i]))
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])  # freed in this order
    assert pool.allocate(2) == [4, 5]  # never-cached first
    assert pool.num_cached_blocks == 4
    assert pool.allocate(1) == [blocks[2]]  # least recently freed
    assert pool.allocate(2) == sorted([blocks[0], blocks[3]])
    assert pool.lookup(hash_block_tokens(None, [2])) is None
    assert pool.lookup(hash_block_tokens(None, [1])) == blocks[1]


def test_revived_block_leaves_the_eviction_queue():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, hash_block_tokens(None, [0]))
    pool.cache_block(b, hash_block_tokens(None, [1]))
    pool.free([a, b])
    pool.touch([a])
    assert pool.num_free_blocks == 1 and pool.allocate(1) == [b]
    assert pool.allocate(1) is None


def test_reset_prefix_cache_forgets_hashes():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, hash_block_tokens(None, [0]))
    pool.cache_block(b, hash_block_tokens(None, [1]))
    pool.free([a])
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 0 and pool.num_evictable_blocks == 0 and pool.num_free_blocks == 3
    pool.free([b])
    assert pool.allocate(4) == [0, 1, 2, 3]
