"""Per-group rules: how one KV group's table grows, which blocks a query still reads, where prefix hits are.

A *group* is the layers sharing one block table (``services.kv.spec.groups.KVCacheGroupSpec``); each
has its own ``BlockPool`` and one ``GroupManager`` of the kind its attention needs:

- ``FullAttentionManager``: every block from token 0 stays needed; a hit is every block from 0.
- ``SlidingWindowManager``: only the window's blocks stay; a hit needs only the window before it.

Sliding-window groups give back what falls out of the window. A table always has one entry per
block from token 0, so position ``p`` stays at ``table[p // block_size]`` and a table describes
the whole sequence (a transfer ticket lists it as is). The entry of a block no query can read any
more becomes the group's *placeholder*, ``pool.num_blocks``: one past the last pool id, never
handed out. In the engine that id is the KV cache's scratch block (the layout holds one block
more than the pool), so a table with placeholders still indexes real memory, and the attention
mask hides every key before the window, so the placeholder's contents are never read::

    block_size 4, window 6; 14 tokens computed, the next query (position 14) sees keys 9..14
    positions   0..3    4..7    8..11   12..15
    table      [  P   ,   P   ,   17  ,    4  ]     P = pool.num_blocks (= the scratch block)
                 freed    freed   keys 9..11  12..14: first needed block (14 + 1 - 6) // 4 = 2

Placeholders are always a leading run of a sliding table, are never referenced, freed, held or
published in the prefix cache, and the freed blocks keep their hashes (cached-free), so a later
request can still revive them. Hashes stay chained over the whole prefix: a sliding block's hash
names every token before it (its K/V depends on them through the full-attention layers), which
is what makes a sliding-window prefix hit that starts at block k valid.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from services.engine.kv_cache.block_hash import RequestBlockHashes
from services.engine.kv_cache.block_pool import BlockPool
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec


@dataclass(frozen=True)
class GroupLookup:
    """What one group's prefix cache holds of a sequence: a block id (or None) per block index.

    ``run[i]`` is the number of consecutive cached blocks ending at ``i``, so "are blocks
    ``k .. n-1`` all cached" is ``run[n - 1] >= n - k``, O(1) per candidate hit length.
    """

    blocks: list[int | None]
    run: list[int]


class GroupManager(abc.ABC):
    """The rules of one group's table and prefix hits; ``KVCacheManager`` holds one per group."""

    def __init__(self, spec: KVCacheGroupSpec, pool: BlockPool) -> None:
        self.spec = spec
        self.pool = pool

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def placeholder(self) -> int:
        """The table entry of a freed out-of-window block: one past the last pool id (never handed out)."""
        return self.pool.num_blocks

    @abc.abstractmethod
    def num_skipped_blocks(self, num_tokens: int) -> int:
        """Leading blocks the newest of ``num_tokens`` tokens cannot attend to."""

    @abc.abstractmethod
    def max_blocks_held(self, num_tokens: int, max_step_tokens: int | None) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once in this group."""

    @abc.abstractmethod
    def lookup(self, hashes: RequestBlockHashes, max_blocks: int) -> GroupLookup:
        """Which of the sequence's first ``max_blocks`` blocks this group's prefix cache holds."""

    @abc.abstractmethod
    def first_complete_pulled_block(self, num_tokens: int) -> int:
        """First block of a pulled ``num_tokens``-token prompt that the owner surely still held whole."""

    def is_hit(self, lookup: GroupLookup, num_tokens: int) -> bool:
        """Whether a request can skip its first ``num_tokens`` tokens (a multiple of the block size).

        The first query it computes, at position ``num_tokens``, reads the keys of blocks
        ``num_skipped_blocks(num_tokens + 1) .. num_tokens // block_size - 1``: those must be cached.
        """
        n = num_tokens // self.block_size
        needed = n - self.num_skipped_blocks(num_tokens + 1)
        return n <= len(lookup.blocks) and (needed <= 0 or lookup.run[n - 1] >= needed)

    def hit_table(self, lookup: GroupLookup, num_tokens: int) -> list[int]:
        """The table entries of a hit ``is_hit`` accepted: placeholders, then the window's blocks."""
        n = num_tokens // self.block_size
        k = min(self.num_skipped_blocks(num_tokens + 1), n)
        window = [b for b in lookup.blocks[k:n] if b is not None]
        assert len(window) == n - k, "hit_table needs a length is_hit accepted"
        return [self.placeholder] * k + window

    def needed_blocks(self, table: Sequence[int], num_tokens: int) -> list[int]:
        """The blocks a query after ``num_tokens`` tokens can still read."""
        return list(table[self.spec.first_needed_block(num_tokens):])


class FullAttentionManager(GroupManager):
    """One full-attention group: every block from position 0 stays needed while the request lives."""

    def num_skipped_blocks(self, num_tokens: int) -> int:
        """None: the newest token attends to every token before it."""
        return 0

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int | None) -> int:
        return self.spec.num_blocks_for(num_tokens)

    def lookup(self, hashes: RequestBlockHashes, max_blocks: int) -> GroupLookup:
        """Cached blocks from block 0, stopping at the first miss: a full-attention hit needs them all."""
        blocks: list[int | None] = []
        for i in range(max_blocks):
            block_id = self.pool.lookup(hashes.at(self.block_size, i))
            if block_id is None:
                break
            blocks.append(block_id)
        return GroupLookup(blocks, list(range(1, len(blocks) + 1)))

    def first_complete_pulled_block(self, num_tokens: int) -> int:
        """Block 0: the owner holds every block of a full-attention prompt."""
        return 0


class SlidingWindowManager(GroupManager):
    """A sliding-window group: only the blocks of the current window stay allocated.

    The query at position ``p`` sees keys ``p - W + 1 .. p``, so blocks wholly before
    ``p - W + 1`` are freed and their table entries become the placeholder (module docstring). A
    prefix hit needs only the blocks of the window before it, not the blocks from token 0.
    """

    def num_skipped_blocks(self, num_tokens: int) -> int:
        """Leading blocks the newest of ``num_tokens`` tokens cannot attend to (``first_needed_block``)."""
        return self.spec.first_needed_block(num_tokens)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int | None) -> int:
        """A step of ``m`` tokens from position ``c`` holds keys ``c - W + 1 .. c + m - 1``.

        ``W - 2 + m`` apart, so at most ``(W - 2 + m) // bs + 2`` blocks (two partial ends)::

            W 32, bs 16, decode (m 1): 31 // 16 + 2 = 3 blocks = ceil(32 / 16) + 1
        """
        whole = self.spec.num_blocks_for(num_tokens)
        if max_step_tokens is None:
            return whole
        assert self.spec.sliding_window is not None
        span = self.spec.sliding_window - 2 + max(1, min(max_step_tokens, num_tokens))
        return min(whole, span // self.block_size + 2)

    def first_complete_pulled_block(self, num_tokens: int) -> int:
        """First block of a pulled prompt wholly at or after token ``num_tokens - W``.

        The owner computed the prompt in chunks; a chunk starting at ``s <= num_tokens - 1`` freed
        only tokens before ``s - W + 1 <= num_tokens - W``, so tokens from there on were held.
        When this side's blocks are coarser than the owner's, the transfer starts at this side's
        block boundary, possibly before that token, and may fill the block's first slots from a
        block the owner had freed: harmless for the queries here (masked), but such a block must
        not enter the prefix cache, where a later hit's window could reach them.
        """
        assert self.spec.sliding_window is not None
        return -(-max(0, num_tokens - self.spec.sliding_window) // self.block_size)

    def lookup(self, hashes: RequestBlockHashes, max_blocks: int) -> GroupLookup:
        """Cached blocks at every index: a miss early on (an evicted block) does not end a window hit."""
        blocks = [self.pool.lookup(hashes.at(self.block_size, i)) for i in range(max_blocks)]
        run, length = [], 0
        for block_id in blocks:
            length = 0 if block_id is None else length + 1
            run.append(length)
        return GroupLookup(blocks, run)


def make_group_manager(spec: KVCacheGroupSpec, pool: BlockPool, free_out_of_window: bool = True) -> GroupManager:
    """The manager of one group; a sliding group that keeps every block is managed like full attention."""
    if spec.kind is AttentionKind.SLIDING_WINDOW and free_out_of_window:
        return SlidingWindowManager(spec, pool)
    return FullAttentionManager(spec, pool)
