"""Paged-KV bookkeeping: which block ids each request's tables hold, and the prefix cache.

Pure Python, no torch: the model runner reads ``request.block_ids`` and writes the tensors.

Three layers, each owning the one below:

- ``BlockPool``: one group's blocks, reference counts, the free pool and the hash -> block map.
- ``FullAttentionManager`` / ``SlidingWindowManager``: how one KV group's table grows, which of
  its blocks a query can still read, and where its prefix-cache hits are (one per group).
- ``KVCacheManager``: the request-level API the scheduler calls, across all groups, in
  check-then-act pairs (``can_allocate`` / ``allocate_slots``): a failed call changes nothing.

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

import hashlib
import math
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.engine.sched.request import Request
from services.kv.groups import AttentionKind, KVCacheGroupSpec

BLOCK_HASH_BYTES = 16
_HASH_PERSON = b"pdserve-kv-v1"


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one full block, chained on the previous block's hash so it names the whole prefix.

    Built from a fixed byte encoding (never Python's per-process ``hash()``) so that another
    process, e.g. a router routing by prefix, computes the same value::

        blake2b(digest_size=16, person=b"pdserve-kv-v1") over
            b"\\x00"                        if parent is None
            b"\\x01" + parent (16 bytes)    otherwise
          + len(extra) as uint32 LE + extra
          + each token id as uint32 LE
    """
    if parent is not None and len(parent) != BLOCK_HASH_BYTES:
        raise ValueError(f"parent hash must be {BLOCK_HASH_BYTES} bytes, got {len(parent)}")
    try:
        tokens = struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    h = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES, person=_HASH_PERSON)
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    h.update(tokens)
    return h.digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``; a trailing partial block has none."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


class _FreeRunIndex:
    """The free never-cached blocks, answering "lowest run of n free blocks" in O(log N).

    A segment tree over block ids. Each node spans a power-of-two range and keeps the length of
    the free run touching its left edge (``pre``), its right edge (``suf``) and the longest run
    inside it (``best``); padding leaves past ``num_blocks`` count as used::

        block    0 1 2 3 | 4 5 6 7        F = free
        free     F F . F | F F . F
        node     pre 2, suf 1, best 2 | pre 2, suf 1, best 2
        root     pre 2, suf 1, best = max(2, 2, suf_left 1 + pre_right 2) = 3   -> run 3..5

    Marking a range used or free rewrites its leaves and their ancestors: O(n + log N).
    """

    def __init__(self, num_blocks: int) -> None:
        size = 1
        while size < num_blocks:
            size *= 2
        self._size = size
        leaves = [1] * num_blocks + [0] * (size - num_blocks)
        self._pre = [0] * size + leaves
        self._suf = [0] * size + leaves
        self._best = [0] * size + leaves
        for node in range(size - 1, 0, -1):
            self._pull(node, size >> node.bit_length())
        self.num_free = num_blocks

    def _pull(self, node: int, half: int) -> None:
        """Recompute ``node`` from its children, each spanning ``half`` leaves."""
        left, right = 2 * node, 2 * node + 1
        pre, suf, best = self._pre, self._suf, self._best
        pre[node] = pre[left] if pre[left] < half else half + pre[right]
        suf[node] = suf[right] if suf[right] < half else half + suf[left]
        best[node] = max(best[left], best[right], suf[left] + pre[right])

    def _set_range(self, lo: int, hi: int, free: bool) -> None:
        value = int(free)
        for leaf in range(self._size + lo, self._size + hi):
            self._pre[leaf] = self._suf[leaf] = self._best[leaf] = value
        first, last, half = (self._size + lo) >> 1, (self._size + hi - 1) >> 1, 1
        while first >= 1:
            for node in range(first, last + 1):
                self._pull(node, half)
            first, last, half = first >> 1, last >> 1, half * 2
        self.num_free += (hi - lo) if free else -(hi - lo)

    def is_free(self, block_id: int) -> bool:
        return self._pre[self._size + block_id] == 1

    def _find_first(self, n: int) -> int | None:
        """Lowest block id starting ``n`` consecutive free blocks, or None."""
        if self._best[1] < n:
            return None
        node, lo, half = 1, 0, self._size // 2
        while node < self._size:
            left = 2 * node
            if self._best[left] >= n:
                node = left
            elif self._suf[left] + self._pre[left + 1] >= n:
                return lo + half - self._suf[left]
            else:
                node, lo = left + 1, lo + half
            half //= 2
        return lo

    def _run_length_from(self, block_id: int, limit: int) -> int:
        length = 0
        while length < limit and block_id + length < self._size and self.is_free(block_id + length):
            length += 1
        return length

    def take(self, n: int, prefer_after: int | None = None) -> tuple[list[int], list[int]]:
        """Mark ``n <= num_free`` blocks used, in as few runs as possible.

        Returns (continuation, rest): the run right after ``prefer_after``, taken when it alone
        fits or when no single run fits anyway, then the rest, from the lowest-addressed run that
        fits or, failing that, the largest runs first (greedy by length gives the fewest runs).
        """
        continuation: list[int] = []
        if prefer_after is not None and n > 0:
            start = prefer_after + 1
            length = self._run_length_from(start, n)
            if length and (length == n or self._best[1] < n):
                self._take_run(start, length, continuation)
        rest: list[int] = []
        while len(continuation) + len(rest) < n:
            need = n - len(continuation) - len(rest)
            start = self._find_first(need)
            if start is None:
                need = self._best[1]
                start = self._find_first(need)
            self._take_run(start, need, rest)
        return continuation, rest

    def _take_run(self, start: int, length: int, taken: list[int]) -> None:
        self._set_range(start, start + length, free=False)
        taken.extend(range(start, start + length))

    def put(self, block_ids: Iterable[int]) -> None:
        """Mark blocks free, one tree update per run of consecutive ids."""
        ordered = sorted(block_ids)
        i = 0
        while i < len(ordered):
            j = i + 1
            while j < len(ordered) and ordered[j] == ordered[j - 1] + 1:
                j += 1
            self._set_range(ordered[i], ordered[j - 1] + 1, free=True)
            i = j


class BlockPool:
    """Blocks ``0 .. num_blocks - 1`` of one KV group, with reference counts and a prefix cache.

    A block is in exactly one state:

    - used: ``ref_count > 0`` (it may also carry a hash, i.e. be in the prefix cache);
    - cached-free: ``ref_count == 0`` with a hash; revivable by ``touch`` until evicted;
    - fresh-free: ``ref_count == 0``, no hash.

    ``allocate`` hands out fresh-free blocks first (contiguous runs, see ``_FreeRunIndex``), then
    evicts cached-free blocks least-recently-freed first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached-free, oldest first
        self._fresh = _FreeRunIndex(num_blocks)

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
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every hash; cached-free blocks become fresh. Returns the number forgotten."""
        num_hashes = len(self._by_hash)
        for block_id in list(self._by_hash.values()):
            self._uncache(block_id)
        self._fresh.put(self._evictable)
        self._evictable.clear()
        return num_hashes


class _ChainedHashes:
    """The chained block hashes of one token sequence, computed lazily per block size.

    A prefix lookup walks several groups; groups of one block size share one chain.
    """

    def __init__(self, token_ids: Sequence[int], extra: bytes) -> None:
        self._tokens = token_ids
        self._extra = extra
        self._chains: dict[int, list[bytes]] = {}

    def at(self, block_size: int, index: int) -> bytes:
        """Hash of block ``index`` (which must be full) of the sequence cut in ``block_size`` blocks."""
        chain = self._chains.setdefault(block_size, [])
        while len(chain) <= index:
            i = len(chain)
            tokens = self._tokens[i * block_size:(i + 1) * block_size]
            chain.append(hash_block_tokens(chain[-1] if chain else None, tokens, self._extra))
        return chain[index]


@dataclass(frozen=True)
class _Lookup:
    """What one group's prefix cache holds of a sequence: a block id (or None) per block index.

    ``run[i]`` is the number of consecutive cached blocks ending at ``i``, so "are blocks
    ``k .. n-1`` all cached" is ``run[n - 1] >= n - k``, O(1) per candidate hit length.
    """

    blocks: list[int | None]
    run: list[int]


class FullAttentionManager:
    """One full-attention group: every block from position 0 stays needed while the request lives."""

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

    def num_skipped_blocks(self, num_tokens: int) -> int:
        """Leading blocks the newest of ``num_tokens`` tokens cannot attend to (none here)."""
        return 0

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int | None) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once in this group."""
        return self.spec.num_blocks_for(num_tokens)

    def lookup(self, hashes: _ChainedHashes, max_blocks: int) -> _Lookup:
        """Cached blocks from block 0, stopping at the first miss: a full-attention hit needs them all."""
        blocks: list[int | None] = []
        for i in range(max_blocks):
            block_id = self.pool.lookup(hashes.at(self.block_size, i))
            if block_id is None:
                break
            blocks.append(block_id)
        return _Lookup(blocks, list(range(1, len(blocks) + 1)))

    def is_hit(self, lookup: _Lookup, num_tokens: int) -> bool:
        """Whether a request can skip its first ``num_tokens`` tokens (a multiple of the block size).

        The first query it computes, at position ``num_tokens``, reads the keys of blocks
        ``num_skipped_blocks(num_tokens + 1) .. num_tokens // block_size - 1``: those must be cached.
        """
        n = num_tokens // self.block_size
        needed = n - self.num_skipped_blocks(num_tokens + 1)
        return n <= len(lookup.blocks) and (needed <= 0 or lookup.run[n - 1] >= needed)

    def hit_table(self, lookup: _Lookup, num_tokens: int) -> list[int]:
        """The table entries of a hit ``is_hit`` accepted: placeholders, then the window's blocks."""
        n = num_tokens // self.block_size
        k = min(self.num_skipped_blocks(num_tokens + 1), n)
        window = [b for b in lookup.blocks[k:n] if b is not None]
        assert len(window) == n - k, "hit_table needs a length is_hit accepted"
        return [self.placeholder] * k + window

    def first_complete_pulled_block(self, num_tokens: int) -> int:
        """First block of a pulled ``num_tokens``-token prompt that the owner surely still held whole."""
        return 0

    def needed_blocks(self, table: Sequence[int], num_tokens: int) -> list[int]:
        """The blocks a query after ``num_tokens`` tokens can still read (all of them here)."""
        return list(table[self.spec.first_needed_block(num_tokens):])


class SlidingWindowManager(FullAttentionManager):
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

    def lookup(self, hashes: _ChainedHashes, max_blocks: int) -> _Lookup:
        """Cached blocks at every index: a miss early on (an evicted block) does not end a window hit."""
        blocks = [self.pool.lookup(hashes.at(self.block_size, i)) for i in range(max_blocks)]
        run, length = [], 0
        for block_id in blocks:
            length = 0 if block_id is None else length + 1
            run.append(length)
        return _Lookup(blocks, run)


def make_group_manager(spec: KVCacheGroupSpec, pool: BlockPool, free_out_of_window: bool = True
                       ) -> FullAttentionManager:
    """The manager of one group; a sliding group that keeps every block is managed like full attention."""
    if spec.kind is AttentionKind.SLIDING_WINDOW and free_out_of_window:
        return SlidingWindowManager(spec, pool)
    return FullAttentionManager(spec, pool)


@dataclass(frozen=True)
class KVCacheGroupStats:
    num_blocks: int
    num_free: int  # includes evictable cached blocks
    num_used: int  # includes held blocks
    num_cached: int  # blocks with a hash, used or evictable
    num_evictable: int
    num_held: int  # real blocks only: placeholders are not blocks


@dataclass
class _HashCursor:
    """How far a request's table is published in the prefix cache, and the last hash (the parent).

    Blocks before ``publish_from`` are hashed (the chain runs on) but never published.
    """

    num_blocks: int = 0
    last_hash: bytes | None = None
    publish_from: int = 0


@dataclass(frozen=True)
class _GroupPlan:
    """What ``allocate_slots`` will do to one group's table; computed without changing anything.

    ``drop``: indices of the table's blocks that fell out of the window (freed, entry -> P);
    ``hit``: the prefix-hit entries appended (placeholders where even the hit is out of window);
    ``touch``: the real blocks of ``hit`` (one reference each);
    ``num_placeholders`` / ``num_new``: entries appended after, as placeholders then new blocks.
    """

    drop: list[int]
    hit: list[int]
    touch: list[int]
    num_placeholders: int
    num_new: int


class KVCacheManager:
    """Block tables of requests across KV groups, one ``BlockPool`` per group.

    ``free_out_of_window=False`` keeps every block of a sliding-window group (it is then managed
    like full attention: no placeholders, hits from token 0); for comparisons and debugging.
    """

    def __init__(self, groups: Sequence[KVCacheGroupSpec], num_blocks_per_group: Sequence[int],
                 enable_prefix_caching: bool = True, cache_salt: bytes = b"",
                 free_out_of_window: bool = True) -> None:
        if not groups:
            raise ValueError("at least one KV group is required")
        if len(groups) != len(num_blocks_per_group):
            raise ValueError(f"{len(groups)} groups but {len(num_blocks_per_group)} pool sizes")
        for index, spec in enumerate(groups):
            if spec.group_id != index:
                raise ValueError(f"group ids must be 0..{len(groups) - 1} in order, got {spec.group_id}")
        self.groups = tuple(groups)
        self.managers = [make_group_manager(spec, BlockPool(n), free_out_of_window)
                         for spec, n in zip(groups, num_blocks_per_group, strict=True)]
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_salt = cache_salt
        self.free_out_of_window = free_out_of_window
        # A hit must end on a block boundary in every group: a multiple of all block sizes.
        self._block_size_lcm = math.lcm(*(s.block_size for s in groups))
        self._cursors: dict[str, list[_HashCursor]] = {}
        self._held: dict[str, list[list[int]]] = {}

    # ---- introspection -------------------------------------------------------------------

    @property
    def hit_granularity(self) -> int:
        """A prefix hit's length is a multiple of this (every group's block size divides it)."""
        return self._block_size_lcm

    def pool(self, group_id: int) -> BlockPool:
        return self.managers[group_id].pool

    def placeholder_block_id(self, group_id: int) -> int:
        """The id that stands for a freed out-of-window block in group ``group_id``'s tables.

        Equal to that group's pool size: the engine's scratch block, which its KV cache holds.
        """
        return self.managers[group_id].placeholder

    def real_blocks(self, group_id: int, table: Sequence[int]) -> list[int]:
        """The entries of a table that are blocks (not placeholders), in order."""
        placeholder = self.managers[group_id].placeholder
        return [b for b in table if b != placeholder]

    def can_ever_fit(self, num_tokens: int, max_step_tokens: int | None = None) -> bool:
        """Whether one request of ``num_tokens`` tokens fits in the whole (empty) pool of every group.

        A sliding group holds only a window's worth of blocks plus one step's tokens, so the
        answer depends on the most tokens one step computes (None: all at once).
        """
        return all(m.max_blocks_held(num_tokens, max_step_tokens) <= m.pool.num_blocks for m in self.managers)

    @property
    def usage(self) -> float:
        """Fraction of all blocks in use (held included, evictable cached excluded)."""
        total = sum(m.pool.num_blocks for m in self.managers)
        return sum(m.pool.num_used_blocks for m in self.managers) / total

    def stats(self) -> list[KVCacheGroupStats]:
        return [self._group_stats(g) for g in range(len(self.managers))]

    def _group_stats(self, group_id: int) -> KVCacheGroupStats:
        pool = self.pool(group_id)
        return KVCacheGroupStats(
            num_blocks=pool.num_blocks, num_free=pool.num_free_blocks, num_used=pool.num_used_blocks,
            num_cached=pool.num_cached_blocks, num_evictable=pool.num_evictable_blocks,
            num_held=sum(len(tables[group_id]) for tables in self._held.values()),
        )

    # ---- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """Longest cached prefix valid in every group, as table entries per group; no refcount changes.

        At least one token is left to compute so the model still produces logits::

            block_size 4, 8 tokens, both blocks cached -> hit = 1 block (4 tokens), not 8

        A hit of ``n`` tokens needs, in a full-attention group, blocks ``0 .. n/bs - 1``; in a
        sliding group only the blocks the first computed query (position ``n``) can see, and the
        table starts with placeholders. ``n`` is the longest length valid in every group and a
        multiple of every block size, so each group's table ends exactly at it::

            full bs 4 cached 0..4; sliding bs 4, W 6, cached 2..3 only (0, 1 evicted)
            n = 16: sliding needs blocks (17 - 6) // 4 = 2 .. 3   -> hit [[f0..f3], [P, P, s2, s3]]
            n = 20: sliding needs block 4, not cached; n = 12: needs blocks 1..2, 1 missing
        """
        empty: list[list[int]] = [[] for _ in self.managers]
        if not self.enable_prefix_caching or request.num_tokens < 2:
            return empty, 0
        if request.sampling_params.prompt_logprobs is not None:
            return empty, 0  # the cache holds no logits: every prompt position is computed
        limit, lookups = self._lookup_all(request.all_token_ids)
        for num_tokens in range(limit - limit % self._block_size_lcm, 0, -self._block_size_lcm):
            if all(m.is_hit(lk, num_tokens) for m, lk in zip(self.managers, lookups, strict=True)):
                return [m.hit_table(lk, num_tokens) for m, lk in zip(self.managers, lookups, strict=True)], num_tokens
        return empty, 0

    def _lookup_all(self, tokens: list[int]) -> tuple[int, list[_Lookup]]:
        """Each group's cached blocks, and the longest hit they allow (in tokens, not yet validated).

        Full-attention groups go first: their unbroken prefix bounds the hit, so the sliding groups
        hash no further than that.
        """
        hashes = _ChainedHashes(tokens, self.cache_salt)
        limit = len(tokens) - 1
        lookups: dict[int, _Lookup] = {}
        order = sorted(range(len(self.managers)), key=lambda g: isinstance(self.managers[g], SlidingWindowManager))
        for g in order:
            m = self.managers[g]
            lookup = lookups[g] = m.lookup(hashes, limit // m.block_size)
            if not isinstance(m, SlidingWindowManager):
                limit = min(limit, len(lookup.blocks) * m.block_size)
        return limit, [lookups[g] for g in range(len(self.managers))]

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that are full and computed, so later requests hit them.

        The hash chain runs over placeholder slots too (the parent of every later block), but a
        placeholder is never published: there is no block behind it.
        """
        cursors = self._cursors.get(request.request_id)
        if not self.enable_prefix_caching or cursors is None or not request.block_ids:
            return
        tokens: list[int] | None = None
        for m, cursor, table in zip(self.managers, cursors, request.block_ids, strict=True):
            bs = m.block_size
            num_full = min(num_computed_tokens, request.num_tokens) // bs
            num_full = min(num_full, len(table))
            if cursor.num_blocks >= num_full:
                continue
            tokens = request.all_token_ids if tokens is None else tokens
            for i in range(cursor.num_blocks, num_full):
                cursor.last_hash = hash_block_tokens(cursor.last_hash, tokens[i * bs:(i + 1) * bs],
                                                     self.cache_salt)
                if table[i] != m.placeholder and i >= cursor.publish_from:
                    m.pool.cache_block(table[i], cursor.last_hash)
            cursor.num_blocks = num_full

    def reset_prefix_cache(self) -> int:
        """Drop every hash in every group; live requests republish at their next update."""
        for cursors in self._cursors.values():
            for i in range(len(cursors)):
                cursors[i] = _HashCursor(publish_from=cursors[i].publish_from)
        return sum(m.pool.reset_prefix_cache() for m in self.managers)

    # ---- allocation (check-then-act) --------------------------------------------------------

    def _plan(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Sequence[int]] | None,
              external_kv: bool) -> list[_GroupPlan]:
        """Validate, then say per group what to free, reference and allocate. Changes nothing.

        The table must address every token up to the end of this step, and a sliding group keeps
        only what the step's first query can see::

            |<- num_computed_tokens ->|<- hit prefix ->|<- num_new_tokens ->|
            |<------------------- covered by the table after ------------------>|
            |<- placeholders ->|      the first query is at num_computed + hit (or, for
                                      external KV, the window the transfer moves: see allocate_slots)
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if request.block_ids and len(request.block_ids) != len(self.managers):
            raise ValueError(f"request {request.request_id} has {len(request.block_ids)} block tables, "
                             f"expected {len(self.managers)}")
        computed = self._check_computed(request, computed_blocks)
        hit_tokens = len(computed[0]) * self.managers[0].block_size
        first_query = request.num_computed_tokens + hit_tokens
        num_tokens = first_query + num_new_tokens
        # External KV: no query runs on the new tokens; keep what the transfer writes (the window
        # of the prompt's last token, services/kv/topology.py window_start_token).
        window_end = num_tokens if external_kv else first_query + 1
        tables = request.block_ids or [[] for _ in self.managers]
        return [self._plan_group(m, t, c, m.num_skipped_blocks(window_end), num_tokens)
                for m, t, c in zip(self.managers, tables, computed, strict=True)]

    def _check_computed(self, request: Request, computed_blocks: Sequence[Sequence[int]] | None) -> list[list[int]]:
        computed = [list(c) for c in computed_blocks] if computed_blocks else [[] for _ in self.managers]
        if len(computed) != len(self.managers):
            raise ValueError(f"computed_blocks has {len(computed)} groups, expected {len(self.managers)}")
        prefix_tokens = {len(c) * m.block_size for c, m in zip(computed, self.managers, strict=True)}
        if len(prefix_tokens) != 1:
            raise ValueError("computed_blocks cover different token counts in different groups")
        if any(computed) and any(request.block_ids):
            raise ValueError(f"request {request.request_id} already has blocks; a prefix hit only "
                             "applies to its first allocation")
        num_hit = prefix_tokens.pop()
        for c, m in zip(computed, self.managers, strict=True):
            k = _num_leading(c, m.placeholder)
            if k > m.num_skipped_blocks(num_hit + 1) or m.placeholder in c[k:]:
                raise ValueError(f"computed_blocks of group {m.spec.group_id} skip blocks the window needs")
            if any(m.pool.block_hash(b) is None for b in c[k:]):
                raise ValueError("computed_blocks are no longer cached; call get_computed_blocks again")
        return computed

    @staticmethod
    def _plan_group(m: FullAttentionManager, table: Sequence[int], hit: Sequence[int], skip: int,
                    num_tokens: int) -> _GroupPlan:
        placeholder = m.placeholder
        drop = _out_of_window(table, skip, placeholder)
        hit = [placeholder if len(table) + i < skip else b for i, b in enumerate(hit)]
        length = len(table) + len(hit)
        target = m.spec.num_blocks_for(num_tokens)
        num_placeholders = max(0, min(skip, target) - length)
        num_new = max(0, target - max(length, skip))
        return _GroupPlan(drop, hit, [b for b in hit if b != placeholder], num_placeholders, num_new)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: Sequence[Sequence[int]] | None = None, *, external_kv: bool = False) -> bool:
        return self._fits(request, self._plan(request, num_new_tokens, computed_blocks, external_kv))

    def _fits(self, request: Request, plans: list[_GroupPlan]) -> bool:
        # Freeing out-of-window blocks gives back those nobody else references; reviving a
        # cached-free prefix block takes it out of the free pool.
        tables = request.block_ids or [[] for _ in self.managers]
        for m, table, p in zip(self.managers, tables, plans, strict=True):
            released = sum(1 for i in p.drop if m.pool.ref_count(table[i]) == 1)
            if m.pool.num_free_blocks + released < p.num_new + m.pool.num_to_revive(p.touch):
                return False
        return True

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[Sequence[int]] | None = None, *,
                       external_kv: bool = False) -> list[list[int]] | None:
        """Grow the request's tables for ``num_new_tokens`` more tokens (after any prefix hit).

        First, in sliding groups, frees the blocks the step's first query (position
        ``num_computed_tokens`` + hit) cannot see and puts placeholders in their entries; a new
        table gets placeholders instead of such blocks. Then references the hit blocks and
        allocates the rest. Returns the newly allocated ids per group, or None with nothing
        changed (nothing freed either) when a pool is short even after the frees.

        ``external_kv``: the new tokens' KV will be written by a transfer, not computed, so the
        sliding groups keep the window the transfer moves, ``first_needed_block(num_tokens)`` on
        (the window of the prompt's last token; the first local query sees one key less).
        """
        if not computed_blocks and not external_kv and self._already_covers(request, num_new_tokens):
            self._drop_out_of_window(request)  # the common decode step: the last block has room
            return [[] for _ in self.managers]
        plans = self._plan(request, num_new_tokens, computed_blocks, external_kv)
        if not self._fits(request, plans):
            return None
        if not request.block_ids:
            request.block_ids = [[] for _ in self.managers]
        if request.request_id not in self._cursors:
            self._cursors[request.request_id] = self._new_cursors(request, computed_blocks, num_new_tokens,
                                                                  external_kv)
        return [self._apply(m, table, p)
                for m, table, p in zip(self.managers, request.block_ids, plans, strict=True)]

    @staticmethod
    def _apply(m: FullAttentionManager, table: list[int], plan: _GroupPlan) -> list[int]:
        _free_entries(m, table, plan.drop)
        m.pool.touch(plan.touch)
        table.extend(plan.hit)
        table.extend([m.placeholder] * plan.num_placeholders)
        last = table[-1] if table and table[-1] != m.placeholder else None
        blocks = m.pool.allocate(plan.num_new, last)
        assert blocks is not None  # _fits checked every pool
        table.extend(blocks)
        return blocks

    def _already_covers(self, request: Request, num_new_tokens: int) -> bool:
        num_tokens = request.num_computed_tokens + num_new_tokens
        return (num_new_tokens >= 0 and len(request.block_ids) == len(self.managers)
                and all(len(t) * m.block_size >= num_tokens
                        for t, m in zip(request.block_ids, self.managers, strict=True)))

    def _drop_out_of_window(self, request: Request) -> None:
        """Free what the next query (position ``num_computed_tokens``) cannot see; never fails."""
        window_end = request.num_computed_tokens + 1
        for m, table in zip(self.managers, request.block_ids, strict=True):
            _free_entries(m, table, _out_of_window(table, m.num_skipped_blocks(window_end), m.placeholder))

    def _new_cursors(self, request: Request, computed_blocks: Sequence[Sequence[int]] | None,
                     num_new_tokens: int, external_kv: bool) -> list[_HashCursor]:
        hits = computed_blocks or [[] for _ in self.managers]
        cursors = [self._cursor_after_hit(m, list(hit), request) for m, hit in zip(self.managers, hits, strict=True)]
        if external_kv:
            num_tokens = request.num_computed_tokens + len(hits[0]) * self.managers[0].block_size + num_new_tokens
            for m, cursor in zip(self.managers, cursors, strict=True):
                cursor.publish_from = m.first_complete_pulled_block(num_tokens)
        return cursors

    def _cursor_after_hit(self, m: FullAttentionManager, hit: list[int], request: Request) -> _HashCursor:
        """The hit is published already; the cursor starts after it, its last hash as the parent.

        Read before any allocation: a hit block left out of an external-KV table may be evicted.
        """
        if not hit:
            return _HashCursor()
        if hit[-1] != m.placeholder:
            return _HashCursor(len(hit), m.pool.block_hash(hit[-1]))
        # A hit wholly out of the window (a window of one token): rebuild the chain from tokens.
        hashes = _ChainedHashes(request.all_token_ids, self.cache_salt)
        return _HashCursor(len(hit), hashes.at(m.block_size, len(hit) - 1))

    # ---- release -----------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Drop the request's references, tail first so its last blocks are evicted first."""
        if request.request_id in self._held:
            raise ValueError(f"request {request.request_id} is held; release it instead")
        self._free_tables(request.block_ids)
        request.block_ids = []
        self._cursors.pop(request.request_id, None)

    def _free_tables(self, tables: Sequence[Sequence[int]]) -> None:
        if not tables:  # never allocated
            return
        for g, (m, table) in enumerate(zip(self.managers, tables, strict=True)):
            m.pool.free(self.real_blocks(g, table)[::-1])

    def hold(self, request: Request, from_token: int = 0) -> None:
        """Keep a finished request's blocks referenced until ``release`` (a peer still pulls them).

        Only real blocks are held, and only from ``from_token`` (a block boundary in every group)
        on: the blocks before it are freed now (a peer reads those tokens elsewhere: the host
        tier). ``request.block_ids`` is left as is, placeholders included, so the caller can
        describe every group's table from token 0 to the peer.
        """
        if request.request_id in self._held:
            raise ValueError(f"request {request.request_id} is already held")
        if any(from_token % m.block_size for m in self.managers):
            raise ValueError(f"hold from token {from_token}: not a block boundary in every group")
        held = []
        for g, (m, table) in enumerate(zip(self.managers, request.block_ids, strict=True)):
            cut = min(from_token // m.block_size, len(table))
            m.pool.free(self.real_blocks(g, table[:cut])[::-1])
            held.append(self.real_blocks(g, table[cut:]))
        self._held[request.request_id] = held
        self._cursors.pop(request.request_id, None)

    def held_block_ids(self, request_id: str) -> list[list[int]] | None:
        """The real blocks held for ``request_id`` per group (no placeholders), or None."""
        tables = self._held.get(request_id)
        return None if tables is None else [list(t) for t in tables]

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks; False if nothing is held under that id."""
        tables = self._held.pop(request_id, None)
        if tables is None:
            return False
        self._free_tables(tables)
        return True

    @property
    def num_held_requests(self) -> int:
        return len(self._held)


def _num_leading(table: Sequence[int], placeholder: int) -> int:
    """Length of the leading run of placeholders."""
    n = 0
    while n < len(table) and table[n] == placeholder:
        n += 1
    return n


def _out_of_window(table: Sequence[int], skip: int, placeholder: int) -> list[int]:
    """Indices ``< skip`` of the table still holding blocks, ascending.

    Placeholders are a leading run, so the walk goes back from ``skip - 1`` to the first one:
    O(newly freed), not O(table).
    """
    i = min(skip, len(table)) - 1
    drop = []
    while i >= 0 and table[i] != placeholder:
        drop.append(i)
        i -= 1
    return drop[::-1]


def _free_entries(m: FullAttentionManager, table: list[int], indices: Sequence[int]) -> None:
    """Free the blocks at ``indices`` (oldest first: evicted first) and put placeholders there."""
    if not indices:
        return
    m.pool.free([table[i] for i in indices])
    for i in indices:
        table[i] = m.placeholder
