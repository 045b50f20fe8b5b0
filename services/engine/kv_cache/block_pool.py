"""One KV group's blocks: reference counts, the free pool and the prefix cache's hash -> block map."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from services.engine.kv_cache.events import PoolEvents
from services.engine.kv_cache.free_runs import FreeRunIndex


class BlockPool:
    """Blocks ``0 .. num_blocks - 1`` of one KV group, with reference counts and a prefix cache.

    A block is in exactly one state:

    - used: ``ref_count > 0`` (it may also carry a hash, i.e. be in the prefix cache);
    - cached-free: ``ref_count == 0`` with a hash; revivable by ``touch`` until evicted;
    - fresh-free: ``ref_count == 0``, no hash.

    ``allocate`` hands out fresh-free blocks first (contiguous runs, see ``FreeRunIndex``), then
    evicts cached-free blocks least-recently-freed first.

    ``events``: where the hash map's changes are reported (KV events: a hash published is STORED, one
    evicted REMOVED, a reset CLEARED); checked with ``events.on`` first, so off costs one test.
    """

    def __init__(self, num_blocks: int, events: PoolEvents | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached-free, oldest first
        self._fresh = FreeRunIndex(num_blocks)
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: fresh-free plus evictable cached-free."""
        return self._fresh.num_free + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks carrying a hash, used or not."""
        return len(self._by_hash)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hashes[block_id]

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this hash's content, used or cached-free, if any."""
        return self._by_hash.get(block_hash)

    def allocate(self, n: int, prefer_after: int | None = None) -> list[int] | None:
        """Take ``n`` blocks with reference count 1, or return None (changing nothing) if short.

        ``prefer_after`` is the caller's last block: continuing right after it keeps a growing
        table contiguous, which the KV transfer turns into fewer descriptors.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if prefer_after is not None and not 0 <= prefer_after < self.num_blocks:
            raise ValueError(f"prefer_after {prefer_after} is not a block id")
        if n > self.num_free_blocks:
            return None
        continuation, rest = self._fresh.take(min(n, self._fresh.num_free), prefer_after)
        # Ascending after the continuation: adjacent ids, fresh or evicted, merge into one run.
        block_ids = continuation + sorted(rest + self._evict(n - len(continuation) - len(rest)))
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def _evict(self, n: int) -> list[int]:
        evicted = []
        for _ in range(n):
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(block_id)
            evicted.append(block_id)
        return evicted

    def _uncache(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            del self._by_hash[block_hash]
            self._hashes[block_id] = None
            if self.events is not None and self.events.on:
                self.events.removed(block_hash)

    def num_to_revive(self, block_ids: Iterable[int]) -> int:
        """How many of these (prefix-hit) blocks ``touch`` would take out of the free pool."""
        return sum(1 for b in block_ids if self._ref_counts[b] == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block; a cached-free block is revived, not evicted."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0 and block_id not in self._evictable:
                raise ValueError(f"block {block_id} is free and holds no cached content")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def refresh(self, block_id: int) -> None:
        """Mark a cached-free block as just used: it moves to the back of the eviction queue."""
        if block_id in self._evictable:
            self._evictable.move_to_end(block_id)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per listed id; blocks reaching zero are freed in the given order.

        A freed block with a hash joins the evictable queue (so the caller's order is the
        eviction order); one without goes back to the fresh pool.
        """
        for block_id, count in Counter(block_ids).items():
            if self._ref_counts[block_id] < count:
                raise ValueError(f"block {block_id} freed more often than referenced")
        fresh = []
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] > 0:
                continue
            if self._hashes[block_id] is None:
                fresh.append(block_id)
            else:
                self._evictable[block_id] = None
        self._fresh.put(fresh)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Publish a used, full block under its hash; False if another block already has it.

        The duplicate stays an ordinary block and returns to the fresh pool when freed.
        """
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only used blocks can be cached")
        current = self._hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return True
        if block_hash in self._by_hash:
            return False
        self._hashes[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        if self.events is not None and self.events.on:
            self.events.stored(block_hash)
        return True

    def cached_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds now, in the order they were published."""
        return list(self._by_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every hash; cached-free blocks become fresh. Returns the number forgotten."""
        num_hashes = len(self._by_hash)
        for block_id in self._by_hash.values():
            self._hashes[block_id] = None
        self._by_hash.clear()
        if self.events is not None and self.events.on:
            self.events.cleared()
        self._fresh.put(self._evictable)
        self._evictable.clear()
        return num_hashes
