"""The longest cached prefix of a request that every group can serve: the prefix cache's lookup."""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.kv_cache.block_hash import RequestBlockHashes
from services.engine.kv_cache.group_managers import GroupLookup, GroupManager, SlidingWindowManager


def find_prefix_hit(managers: Sequence[GroupManager], hashes: RequestBlockHashes, num_tokens: int,
                    granularity: int) -> tuple[list[list[int]], int]:
    """Longest cached prefix valid in every group, as table entries per group, and its length.

    At least one of the ``num_tokens`` tokens is left to compute so the model still produces logits::

        block_size 4, 8 tokens, both blocks cached -> hit = 1 block (4 tokens), not 8

    A hit of ``n`` tokens needs, in a full-attention group, blocks ``0 .. n/bs - 1``; in a
    sliding group only the blocks the first computed query (position ``n``) can see, and the
    table starts with placeholders. ``n`` is the longest length valid in every group and a
    multiple of ``granularity`` (of every block size), so each group's table ends exactly at it::

        full bs 4 cached 0..4; sliding bs 4, W 6, cached 2..3 only (0, 1 evicted)
        n = 16: sliding needs blocks (17 - 6) // 4 = 2 .. 3   -> hit [[f0..f3], [P, P, s2, s3]]
        n = 20: sliding needs block 4, not cached; n = 12: needs blocks 1..2, 1 missing
    """
    limit, lookups = _lookup_all(managers, hashes, num_tokens - 1)
    for n in range(limit - limit % granularity, 0, -granularity):
        if all(m.is_hit(lk, n) for m, lk in zip(managers, lookups, strict=True)):
            return [m.hit_table(lk, n) for m, lk in zip(managers, lookups, strict=True)], n
    return [[] for _ in managers], 0


def _lookup_all(managers: Sequence[GroupManager], hashes: RequestBlockHashes,
                limit: int) -> tuple[int, list[GroupLookup]]:
    """Each group's cached blocks, and the longest hit they allow (in tokens, not yet validated).

    Full-attention groups go first: their unbroken prefix bounds the hit, so the sliding groups
    hash no further than that.
    """
    lookups: dict[int, GroupLookup] = {}
    order = sorted(range(len(managers)), key=lambda g: isinstance(managers[g], SlidingWindowManager))
    for g in order:
        m = managers[g]
        lookup = lookups[g] = m.lookup(hashes, limit // m.block_size)
        if not isinstance(m, SlidingWindowManager):
            limit = min(limit, len(lookup.blocks) * m.block_size)
    return limit, [lookups[g] for g in range(len(managers))]
