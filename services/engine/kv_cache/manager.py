"""The request-level KV-cache API the scheduler calls: block tables across all groups, and the prefix cache.

Pure Python, no torch: the model runner reads ``request.block_ids`` and writes the tensors.
Calls come in check-then-act pairs (``can_allocate`` / ``allocate_slots``): a failed call changes
nothing. Each group's table follows its ``GroupManager`` (``group_managers.py``, where the
sliding-window placeholders are explained) over its ``BlockPool`` (``block_pool.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.engine.kv_cache.block_hash import BlockHashChains
from services.engine.kv_cache.block_pool import BlockPool
from services.engine.kv_cache.events import KVCacheContents, KVEventLog, KVTier
from services.engine.kv_cache.group_managers import GroupManager, make_group_manager
from services.engine.kv_cache.prefix_hit import find_prefix_hit
from services.engine.kv_cache.state_slots import StateSlots
from services.engine.kv_cache.table_plan import (
    GroupPlan,
    apply_plan,
    free_entries,
    num_leading_placeholders,
    out_of_window,
    plan_fits,
    plan_group,
)
from services.engine.request import Request
from services.kv.spec.groups import KVCacheGroupSpec


@dataclass(frozen=True)
class KVCacheGroupStats:
    num_blocks: int
    num_free: int  # includes evictable cached blocks
    num_used: int  # includes held blocks
    num_cached: int  # blocks with a hash, used or evictable
    num_evictable: int
    num_held: int  # real blocks only: placeholders are not blocks


@dataclass
class _PublishCursor:
    """How far a request's table is published in the prefix cache, per group.

    Blocks before ``publish_from`` are never published (their hashes still chain the later ones).
    """

    num_blocks: int = 0
    publish_from: int = 0


class KVCacheManager:
    """Block tables of requests across KV groups, one ``BlockPool`` per group.

    ``free_out_of_window=False`` keeps every block of a sliding-window group (it is then managed
    like full attention: no placeholders, hits from token 0); for comparisons and debugging.

    ``block_hashes``: the request hash chains to read and extend, shared with another cache of the
    same salt (the host tier passes the device manager's); a new one by default.

    ``events``: the engine's KV event log; each group's pool reports its prefix cache's changes there
    as ``tier`` (the host tier's span manager passes ``KVTier.HOST``). None: no events.

    ``num_state_slots`` (a model with state layers, e.g. Granite-4.0-H's Mamba2): each request also
    gets one of that many state slots (``state_slots.py``) with its first allocation, given back with
    its blocks. Such a request gets no prefix-cache hit: a hit would need the state at the end of the
    prefix, which is not snapshotted (vLLM keeps Mamba prefix caching behind a flag for that reason).
    """

    def __init__(self, groups: Sequence[KVCacheGroupSpec], num_blocks_per_group: Sequence[int],
                 enable_prefix_caching: bool = True, cache_salt: bytes = b"",
                 free_out_of_window: bool = True, block_hashes: BlockHashChains | None = None,
                 events: KVEventLog | None = None, tier: KVTier = KVTier.DEVICE, num_state_slots: int = 0) -> None:
        if not groups:
            raise ValueError("at least one KV group is required")
        if len(groups) != len(num_blocks_per_group):
            raise ValueError(f"{len(groups)} groups but {len(num_blocks_per_group)} pool sizes")
        for index, spec in enumerate(groups):
            if spec.group_id != index:
                raise ValueError(f"group ids must be 0..{len(groups) - 1} in order, got {spec.group_id}")
        if block_hashes is not None and block_hashes.cache_salt != cache_salt:
            raise ValueError("block_hashes were made with another cache salt")
        self.groups = tuple(groups)
        self.events = events
        self.tier = tier
        self.managers: list[GroupManager] = [
            make_group_manager(spec, BlockPool(n, events and events.pool(spec.group_id, tier, spec.block_size)),
                               free_out_of_window)
            for spec, n in zip(groups, num_blocks_per_group, strict=True)]
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_salt = cache_salt
        self.block_hashes = block_hashes if block_hashes is not None else BlockHashChains(cache_salt)
        self.free_out_of_window = free_out_of_window
        # A hit must end on a block boundary in every group: a multiple of all block sizes.
        self._block_size_lcm = math.lcm(*(s.block_size for s in groups))
        self._cursors: dict[str, list[_PublishCursor]] = {}
        self._held: dict[str, list[list[int]]] = {}
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self._held_state: dict[str, int] = {}  # hold key -> the state slot held with its blocks

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
        """Longest cached prefix valid in every group, as table entries per group, and its length in
        tokens (``prefix_hit.find_prefix_hit``); no refcount changes."""
        if not self.enable_prefix_caching or request.num_tokens < 2 or self.state_slots is not None:
            return [[] for _ in self.managers], 0
        if request.sampling_params.prompt_logprobs is not None:
            return [[] for _ in self.managers], 0  # the cache holds no logits: every prompt position is computed
        return find_prefix_hit(self.managers, self.block_hashes.of(request), request.num_tokens,
                               self._block_size_lcm)

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that are full and computed, so later requests hit them.

        The hashes come from the request's chain (``block_hashes``), which runs over placeholder
        slots too (the parent of every later block), but a placeholder is never published: there
        is no block behind it.
        """
        cursors = self._cursors.get(request.request_id)
        if not self.enable_prefix_caching or cursors is None or not request.block_ids:
            return
        hashes = self.block_hashes.of(request)
        for m, cursor, table in zip(self.managers, cursors, request.block_ids, strict=True):
            num_full = min(num_computed_tokens, request.num_tokens) // m.block_size
            num_full = min(num_full, len(table))
            for i in range(max(cursor.num_blocks, cursor.publish_from), num_full):
                if table[i] != m.placeholder:
                    m.pool.cache_block(table[i], hashes.at(m.block_size, i))
            cursor.num_blocks = max(cursor.num_blocks, num_full)

    def hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Extend the request's hash chains over its full blocks of ``num_tokens`` tokens, publishing nothing.

        For a pulled prompt, while its KV is on the way: publishing the blocks when it lands
        (``cache_full_blocks``) then only files them. Hashing a 32k-token prompt's 2,048 blocks took 4-7 ms
        of Python on the build machine, which otherwise stands between the last pull and the request's first
        decode step.
        """
        if not self.enable_prefix_caching or self._cursors.get(request.request_id) is None:
            return
        hashes = self.block_hashes.of(request)
        for block_size in sorted({m.block_size for m in self.managers}):
            num_full = min(num_tokens, request.num_tokens) // block_size
            if num_full:
                hashes.at(block_size, num_full - 1)

    def contents(self) -> list[KVCacheContents]:
        """Every key each group's prefix cache holds (a KV snapshot's part; needs an event log)."""
        if self.events is None:
            raise ValueError("this KV cache manager has no event log")
        return [m.pool.events.contents(m.pool.cached_hashes()) for m in self.managers]

    def set_cache_salt(self, cache_salt: bytes) -> None:
        """Key the prefix cache with another salt: only while it is empty and no request has blocks
        (every key already computed would name other content)."""
        if self._cursors or self._held or any(m.pool.num_cached_blocks or m.pool.num_used_blocks
                                              for m in self.managers):
            raise ValueError("the cache salt can only change while the KV cache is empty")
        self.cache_salt = cache_salt
        self.block_hashes.set_salt(cache_salt)

    def reset_prefix_cache(self) -> int:
        """Drop every hash in every group; live requests republish at their next update."""
        for cursors in self._cursors.values():
            for i in range(len(cursors)):
                cursors[i] = _PublishCursor(publish_from=cursors[i].publish_from)
        return sum(m.pool.reset_prefix_cache() for m in self.managers)

    # ---- allocation (check-then-act) --------------------------------------------------------

    def _plan(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Sequence[int]] | None,
              external_kv: bool) -> list[GroupPlan]:
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
        # of the prompt's last token, services/kv/spec/topology.py window_start_token).
        window_end = num_tokens if external_kv else first_query + 1
        tables = request.block_ids or [[] for _ in self.managers]
        return [plan_group(m, t, c, m.num_skipped_blocks(window_end), num_tokens)
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
            k = num_leading_placeholders(c, m.placeholder)
            if k > m.num_skipped_blocks(num_hit + 1) or m.placeholder in c[k:]:
                raise ValueError(f"computed_blocks of group {m.spec.group_id} skip blocks the window needs")
            if any(m.pool.block_hash(b) is None for b in c[k:]):
                raise ValueError("computed_blocks are no longer cached; call get_computed_blocks again")
        return computed

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: Sequence[Sequence[int]] | None = None, *, external_kv: bool = False) -> bool:
        return self._fits(request, self._plan(request, num_new_tokens, computed_blocks, external_kv))

    def _fits(self, request: Request, plans: list[GroupPlan]) -> bool:
        tables = request.block_ids or [[] for _ in self.managers]
        return all(plan_fits(m, table, p) for m, table, p in zip(self.managers, tables, plans, strict=True))

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

        A request of a state model without a state slot gets one too (None when none is free).
        """
        if self.state_slots is None or request.state_slot is not None:
            return self._allocate_blocks(request, num_new_tokens, computed_blocks, external_kv)
        if not self.state_slots.num_free:
            return None
        new = self._allocate_blocks(request, num_new_tokens, computed_blocks, external_kv)
        if new is not None:
            request.state_slot = self.state_slots.take()
        return new

    def _allocate_blocks(self, request: Request, num_new_tokens: int,
                         computed_blocks: Sequence[Sequence[int]] | None, external_kv: bool) -> list[list[int]] | None:
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
        return [apply_plan(m, table, p)
                for m, table, p in zip(self.managers, request.block_ids, plans, strict=True)]

    def _already_covers(self, request: Request, num_new_tokens: int) -> bool:
        num_tokens = request.num_computed_tokens + num_new_tokens
        return (num_new_tokens >= 0 and len(request.block_ids) == len(self.managers)
                and all(len(t) * m.block_size >= num_tokens
                        for t, m in zip(request.block_ids, self.managers, strict=True)))

    def _drop_out_of_window(self, request: Request) -> None:
        """Free what the next query (position ``num_computed_tokens``) cannot see; never fails."""
        window_end = request.num_computed_tokens + 1
        for m, table in zip(self.managers, request.block_ids, strict=True):
            free_entries(m, table, out_of_window(table, m.num_skipped_blocks(window_end), m.placeholder))

    def _new_cursors(self, request: Request, computed_blocks: Sequence[Sequence[int]] | None,
                     num_new_tokens: int, external_kv: bool) -> list[_PublishCursor]:
        """The hit is published already: each group's cursor starts after it."""
        hits = computed_blocks or [[] for _ in self.managers]
        cursors = [_PublishCursor(len(hit)) for hit in hits]
        if external_kv:
            num_tokens = request.num_computed_tokens + len(hits[0]) * self.managers[0].block_size + num_new_tokens
            for m, cursor in zip(self.managers, cursors, strict=True):
                cursor.publish_from = m.first_complete_pulled_block(num_tokens)
        return cursors

    # ---- release -----------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Drop the request's references, tail first so its last blocks are evicted first."""
        if request.request_id in self._held:
            raise ValueError(f"request {request.request_id} is held; release it instead")
        self._free_tables(request.block_ids)
        request.block_ids = []
        self._cursors.pop(request.request_id, None)
        self._give_back_state(request)

    def _give_back_state(self, request: Request) -> None:
        if request.state_slot is not None:
            self.state_slots.give_back(request.state_slot)
            request.state_slot = None

    def _free_tables(self, tables: Sequence[Sequence[int]]) -> None:
        if not tables:  # never allocated
            return
        for g, (m, table) in enumerate(zip(self.managers, tables, strict=True)):
            m.pool.free(self.real_blocks(g, table)[::-1])

    def hold(self, request: Request, from_token: int = 0, key: str | None = None) -> None:
        """Keep a finished request's blocks referenced until ``release`` (a peer still pulls them, or
        a READ that could not be cancelled may still write them: then under another ``key`` than the
        request id, which a new request may take at once).

        Only real blocks are held, and only from ``from_token`` (a block boundary in every group)
        on: the blocks before it are freed now (a peer reads those tokens elsewhere: the host
        tier). ``request.block_ids`` is left as is, placeholders included, so the caller can
        describe every group's table from token 0 to the peer.
        """
        key = request.request_id if key is None else key
        if key in self._held:
            raise ValueError(f"request {key} is already held")
        if any(from_token % m.block_size for m in self.managers):
            raise ValueError(f"hold from token {from_token}: not a block boundary in every group")
        held = []
        for g, (m, table) in enumerate(zip(self.managers, request.block_ids, strict=True)):
            cut = min(from_token // m.block_size, len(table))
            m.pool.free(self.real_blocks(g, table[:cut])[::-1])
            held.append(self.real_blocks(g, table[cut:]))
        self._held[key] = held
        self._cursors.pop(request.request_id, None)
        if request.state_slot is not None:  # a peer reads the state after the prompt (or a late READ writes it)
            self._held_state[key] = request.state_slot

    def pin(self, key: str, tables: Sequence[Sequence[int]]) -> None:
        """One more reference on each real block of ``tables`` (per group), kept under ``key`` (added to what
        it holds already) until ``release(key)``: blocks a peer reads while the request that computed them runs
        on (a part ticket's), which its preemption or abort must not hand to another request meanwhile."""
        real = [self.real_blocks(g, table) for g, table in enumerate(tables)]
        for m, ids in zip(self.managers, real, strict=True):
            m.pool.touch(ids)
        held = self._held.setdefault(key, [[] for _ in self.managers])
        for kept, ids in zip(held, real, strict=True):
            kept.extend(ids)

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
        slot = self._held_state.pop(request_id, None)
        if slot is not None:
            self.state_slots.give_back(slot)
        return True

    @property
    def num_held_requests(self) -> int:
        return len(self._held)

