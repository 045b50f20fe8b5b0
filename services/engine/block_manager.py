"""Paged-KV bookkeeping: which block ids each request's tables hold, and the prefix cache.

Pure Python, no torch: the model runner reads ``request.block_ids`` and writes the tensors.

Three layers, each owning the one below:

- ``BlockPool``: one group's blocks, reference counts, the free pool and the hash -> block map.
- ``FullAttentionManager`` / ``SlidingWindowManager``: how one KV group's table grows and where
  its prefix-cache hits are (one instance per group).
- ``KVCacheManager``: the request-level API the scheduler calls, across all groups, in
  check-then-act pairs (``can_allocate`` / ``allocate_slots``): a failed call changes nothing.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.engine.request import Request
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


class FullAttentionManager:
    """One full-attention group: every block from position 0 stays needed while the request lives."""

    def __init__(self, spec: KVCacheGroupSpec, pool: BlockPool) -> None:
        self.spec = spec
        self.pool = pool

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def find_cached_prefix(self, token_ids: Sequence[int], max_blocks: int, extra: bytes) -> list[int]:
        """Blocks holding the longest cached run of full blocks from position 0 (at most max_blocks).

        Hashes are chained, so the walk stops at the first miss and costs O(hit + 1) hashes.
        """
        hits: list[int] = []
        parent = None
        bs = self.block_size
        for i in range(max_blocks):
            parent = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs], extra)
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_new_blocks(self, num_table_blocks: int, num_tokens: int) -> int:
        """Blocks to add to a table of ``num_table_blocks`` so it addresses ``num_tokens`` tokens."""
        return max(0, self.spec.num_blocks_for(num_tokens) - num_table_blocks)

    def needed_blocks(self, table: Sequence[int], num_tokens: int) -> list[int]:
        """The blocks a query after ``num_tokens`` tokens can still read (all of them here)."""
        return list(table[self.spec.first_needed_block(num_tokens):])


class SlidingWindowManager(FullAttentionManager):
    """A sliding-window group: allocates and prefix-caches exactly like full attention.

    Blocks that fell out of the window are kept allocated until the request is freed: the table
    stays a plain list of ints, prefix hits stay valid from position 0, and a transfer clips to
    ``needed_blocks()`` (``spec.first_needed_block``). Returning them to the pool early would need a
    shared placeholder block in the table; not done yet.
    """


def make_group_manager(spec: KVCacheGroupSpec, pool: BlockPool) -> FullAttentionManager:
    if spec.kind is AttentionKind.SLIDING_WINDOW:
        return SlidingWindowManager(spec, pool)
    return FullAttentionManager(spec, pool)


@dataclass(frozen=True)
class KVCacheGroupStats:
    num_blocks: int
    num_free: int  # includes evictable cached blocks
    num_used: int  # includes held blocks
    num_cached: int  # blocks with a hash, used or evictable
    num_evictable: int
    num_held: int


@dataclass
class _HashCursor:
    """How far a request's table is published in the prefix cache, and the last hash (the parent)."""

    num_blocks: int = 0
    last_hash: bytes | None = None


class KVCacheManager:
    """Block tables of requests across KV groups, one ``BlockPool`` per group."""

    def __init__(self, groups: Sequence[KVCacheGroupSpec], num_blocks_per_group: Sequence[int],
                 enable_prefix_caching: bool = True, cache_salt: bytes = b"") -> None:
        if not groups:
            raise ValueError("at least one KV group is required")
        if len(groups) != len(num_blocks_per_group):
            raise ValueError(f"{len(groups)} groups but {len(num_blocks_per_group)} pool sizes")
        for index, spec in enumerate(groups):
            if spec.group_id != index:
                raise ValueError(f"group ids must be 0..{len(groups) - 1} in order, got {spec.group_id}")
        self.groups = tuple(groups)
        self.managers = [make_group_manager(spec, BlockPool(n))
                         for spec, n in zip(groups, num_blocks_per_group, strict=True)]
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_salt = cache_salt
        # A hit must end on a block boundary in every group: a multiple of all block sizes.
        self._block_size_lcm = math.lcm(*(s.block_size for s in groups))
        self._cursors: dict[str, list[_HashCursor]] = {}
        self._held: dict[str, list[list[int]]] = {}

    # ---- introspection -------------------------------------------------------------------

    def pool(self, group_id: int) -> BlockPool:
        return self.managers[group_id].pool

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one request of ``num_tokens`` tokens fits in the whole (empty) pool of every group."""
        return all(m.num_new_blocks(0, num_tokens) <= m.pool.num_blocks for m in self.managers)

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
        """Longest cached prefix per group and the tokens it covers; no refcount changes.

        At least one token is left to compute so the model still produces logits::

            block_size 4, 8 tokens, both blocks cached -> hit = 1 block (4 tokens), not 8
            (only blocks within the first num_tokens - 1 tokens are looked up)

        With several groups the hit is the shortest one, cut to a multiple of every block size
        so each group's table ends exactly at it (sizes 4 and 8: hits of 12 and 16 tokens -> 8).
        """
        empty: list[list[int]] = [[] for _ in self.managers]
        if not self.enable_prefix_caching or request.num_tokens < 2:
            return empty, 0
        tokens = request.all_token_ids
        hits = [m.find_cached_prefix(tokens, (len(tokens) - 1) // m.block_size, self.cache_salt)
                for m in self.managers]
        num_tokens = min(len(h) * m.block_size for h, m in zip(hits, self.managers, strict=True))
        num_tokens -= num_tokens % self._block_size_lcm
        return [h[:num_tokens // m.block_size] for h, m in zip(hits, self.managers, strict=True)], num_tokens

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that are full and computed, so later requests hit them."""
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
                m.pool.cache_block(table[i], cursor.last_hash)
            cursor.num_blocks = num_full

    def reset_prefix_cache(self) -> int:
        """Drop every hash in every group; live requests republish at their next update."""
        for cursors in self._cursors.values():
            for i in range(len(cursors)):
                cursors[i] = _HashCursor()
        return sum(m.pool.reset_prefix_cache() for m in self.managers)

    # ---- allocation (check-then-act) --------------------------------------------------------

    def _plan(self, request: Request, num_new_tokens: int,
              computed_blocks: Sequence[Sequence[int]] | None) -> tuple[list[list[int]], list[int]]:
        """Validate, then return (prefix-hit blocks, new blocks needed) per group. Changes nothing.

        The table must address every token up to the end of this step::

            |<- num_computed_tokens ->|<- hit prefix ->|<- num_new_tokens ->|
            |<------------------- covered by the table after ------------------>|
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if request.block_ids and len(request.block_ids) != len(self.managers):
            raise ValueError(f"request {request.request_id} has {len(request.block_ids)} block tables, "
                             f"expected {len(self.managers)}")
        computed = [list(c) for c in computed_blocks] if computed_blocks else [[] for _ in self.managers]
        if len(computed) != len(self.managers):
            raise ValueError(f"computed_blocks has {len(computed)} groups, expected {len(self.managers)}")
        prefix_tokens = {len(c) * m.block_size for c, m in zip(computed, self.managers, strict=True)}
        if len(prefix_tokens) != 1:
            raise ValueError("computed_blocks cover different token counts in different groups")
        if any(computed) and any(request.block_ids):
            raise ValueError(f"request {request.request_id} already has blocks; a prefix hit only "
                             "applies to its first allocation")
        for c, m in zip(computed, self.managers, strict=True):
            if any(m.pool.block_hash(b) is None for b in c):
                raise ValueError("computed_blocks are no longer cached; call get_computed_blocks again")
        num_tokens = request.num_computed_tokens + prefix_tokens.pop() + num_new_tokens
        tables = request.block_ids or [[] for _ in self.managers]
        needed = [m.num_new_blocks(len(t) + len(c), num_tokens)
                  for m, t, c in zip(self.managers, tables, computed, strict=True)]
        return computed, needed

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: Sequence[Sequence[int]] | None = None) -> bool:
        computed, needed = self._plan(request, num_new_tokens, computed_blocks)
        return self._fits(computed, needed)

    def _fits(self, computed: list[list[int]], needed: list[int]) -> bool:
        # Reviving a cached-free prefix block takes it out of the free pool too.
        return all(m.pool.num_free_blocks >= n + m.pool.num_to_revive(c)
                   for m, c, n in zip(self.managers, computed, needed, strict=True))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[Sequence[int]] | None = None) -> list[list[int]] | None:
        """Grow the request's tables for ``num_new_tokens`` more tokens (after any prefix hit).

        Takes a reference on the hit blocks, then allocates the rest. Returns the newly
        allocated ids per group, or None with nothing changed when a pool is short.
        """
        if not computed_blocks and self._already_covers(request, num_new_tokens):
            return [[] for _ in self.managers]  # the common decode step: the last block has room
        computed, needed = self._plan(request, num_new_tokens, computed_blocks)
        if not self._fits(computed, needed):
            return None
        if not request.block_ids:
            request.block_ids = [[] for _ in self.managers]
        if request.request_id not in self._cursors:
            self._cursors[request.request_id] = [self._cursor_after_hit(m, c)
                                                 for m, c in zip(self.managers, computed, strict=True)]
        new_blocks = []
        for m, table, hit, n in zip(self.managers, request.block_ids, computed, needed, strict=True):
            m.pool.touch(hit)
            table.extend(hit)
            blocks = m.pool.allocate(n, table[-1] if table else None)
            assert blocks is not None  # _fits checked every pool
            table.extend(blocks)
            new_blocks.append(blocks)
        return new_blocks

    def _already_covers(self, request: Request, num_new_tokens: int) -> bool:
        num_tokens = request.num_computed_tokens + num_new_tokens
        return (num_new_tokens >= 0 and len(request.block_ids) == len(self.managers)
                and all(len(t) * m.block_size >= num_tokens
                        for t, m in zip(request.block_ids, self.managers, strict=True)))

    @staticmethod
    def _cursor_after_hit(manager: FullAttentionManager, hit: list[int]) -> _HashCursor:
        if not hit:
            return _HashCursor()
        return _HashCursor(len(hit), manager.pool.block_hash(hit[-1]))

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
        for m, table in zip(self.managers, tables, strict=True):
            m.pool.free(table[::-1])

    def hold(self, request: Request) -> None:
        """Keep a finished request's blocks referenced until ``release`` (a peer still pulls them).

        ``request.block_ids`` is left as is so the caller can describe the blocks to the peer.
        """
        if request.request_id in self._held:
            raise ValueError(f"request {request.request_id} is already held")
        self._held[request.request_id] = [list(t) for t in request.block_ids]
        self._cursors.pop(request.request_id, None)

    def held_block_ids(self, request_id: str) -> list[list[int]] | None:
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
