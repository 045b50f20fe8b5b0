"""What each worker's prefix caches hold, as the router knows it: the KV-aware router's index.

Workers report the blocks their caches store and remove (``KVEvents``, ``KVSnapshot``), each named by
its chained prefix key (``services.contract.prefix_keys``). The index keeps, per worker address and
per (KV group, tier), the set of those keys, and answers "how many leading tokens of this prompt does
worker W hold" in O(prompt blocks): a prompt's keys are computed once per (block size, salt) by
:class:`PromptKeys` and reused for every worker; each group's hit is its run of leading keys present.

    prompt  [b0 b1 b2 b3 b4 | tail]       keys k0..k4 (chained: k2 names b0..b2)
    worker  {k0, k1, k2, k7}              leading run k0 k1 k2 -> 3 blocks cached, b3 onwards computed

Several groups (a hybrid model's full-attention and sliding-window groups): the engine's hit is the
longest prefix every group can serve (``engine/kv_cache/prefix_hit.py``). The index uses the
full-attention groups only (the shortest of their runs), and assumes a sliding group holds the few
blocks its window needs when the full groups hold the prefix: an approximation that can overestimate a
hit whose window blocks were evicted first (the engine then computes a little more than predicted).

Entries belong to one engine epoch. A batch from another epoch, a worker removed by discovery, or a
broken event stream drops them (the worker is cache-unknown until a snapshot resyncs it).

Predicted entries: when the router sends a prompt to a worker it records the prompt's keys as
predicted there, so that sibling choices, batched prompts and the next turn of a conversation find
the worker before its STORED events arrive. They expire ``predicted_ttl_s`` after they were made
unless a STORED event for the same key confirms them. They are this router's own guesses; another
router replica has its own (and converges from the same events).

Cache room (:meth:`PrefixIndex.cache_room`): where a prompt no worker holds should go. Per worker the
index keeps its device-tier keys (confirmed and predicted) in the order they were last stored or routed
to, with that time: a worker whose pool has room for the prompt's blocks evicts nothing, and among full
ones the worker whose least recently used key is oldest evicts what the fleet needs least (the fleet's
pools then behave like one LRU cache). Uses another router replica routes there are seen only through
STORED events, so a replica's recency is approximate; the engine still evicts by its own LRU.

Memory is bounded: one LRU over every key of every worker (confirmed and predicted); past
``capacity_keys`` the least recently stored or used keys are forgotten (a forgotten key is a missed
hit, never a wrong one). Pure: no I/O and no clock; callers pass ``now_s``.
"""

from __future__ import annotations

import enum
import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.contract.prefix_keys import hash_request_blocks
from services.proto_gen.pdserve.v1 import worker_pb2

DEVICE = worker_pb2.KV_TIER_DEVICE
HOST = worker_pb2.KV_TIER_HOST
_PREDICTED = (-1, DEVICE)  # the slot of predicted keys in the LRU (no group: they are device-tier guesses)


class CacheState(enum.StrEnum):
    """How much the index knows about a worker's caches."""

    SYNCED = "synced"  # a snapshot was loaded and events are applied in order
    UNKNOWN = "unknown"  # not synced yet, or the stream broke: resyncing (confirmed entries dropped)
    UNSUPPORTED = "unsupported"  # the worker predates KVEvents: routed cache-blind


class BatchResult(enum.StrEnum):
    APPLIED = "applied"
    GAP = "gap"  # an event number was skipped: the index no longer matches the worker
    EPOCH_CHANGED = "epoch_changed"  # another engine or epoch answers at this address
    NOT_SYNCED = "not_synced"  # no snapshot loaded for the worker


@dataclass(frozen=True)
class Load:
    """A worker's load as its engine last reported it (``WorkerLoad``)."""

    num_running: int = 0
    num_waiting: int = 0
    waiting_prefill_tokens: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    prefill_tokens_per_s: float = 0.0  # 0 until measured

    @classmethod
    def of(cls, load: worker_pb2.WorkerLoad) -> Load:
        return cls(load.num_running, load.num_waiting, load.waiting_prefill_tokens, load.kv_blocks_free,
                   load.kv_blocks_total, load.prefill_tokens_per_s)


@dataclass(frozen=True)
class CacheRoom:
    """What caching a prompt's blocks on a worker would evict: nothing (``free_blocks`` left after it, >= 0),
    or keys last used ``evict_age_s`` ago. Ordered: more room, then older victims, rank higher."""

    free_blocks: int = 0  # pool blocks left after the prompt's (negative: it must evict that many)
    evict_age_s: float = 0.0  # seconds since the least recently used key was used (when it must evict)

    @property
    def rank(self) -> tuple[int, float]:
        return (1, self.free_blocks) if self.free_blocks >= 0 else (0, self.evict_age_s)


UNKNOWN_ROOM = CacheRoom(-1, 0.0)  # a worker whose pool size or cache is unknown: never preferred for room


@dataclass(frozen=True)
class CacheHit:
    """A prompt's cached prefix on one worker: device-tier tokens (predicted entries included), host-tier
    tokens beyond those, and how many of the device tokens its own events confirm."""

    device_tokens: int = 0
    host_tokens: int = 0
    state: CacheState = CacheState.UNKNOWN
    confirmed_tokens: int = 0  # device tokens reported by KV events (no predicted entry among them)

    @property
    def tokens(self) -> int:
        return self.device_tokens + self.host_tokens


class PromptKeys:
    """A prompt's chained block keys, computed once per (block size, salt) and shared by every lookup."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._keys: dict[tuple[int, bytes], list[bytes]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def keys(self, block_size: int, salt: bytes) -> list[bytes]:
        cached = self._keys.get((block_size, salt))
        if cached is None:
            cached = self._keys[(block_size, salt)] = hash_request_blocks(self.token_ids, block_size, salt)
        return cached

    def warm(self, specs: Iterable[tuple[int, bytes]]) -> PromptKeys:
        """Compute the keys of every (block size, salt) now: a long prompt's keys take milliseconds, which
        the caller spends off the event loop (with its tokenizing) rather than in the pair choice."""
        for block_size, salt in specs:
            self.keys(block_size, salt)
        return self


def full_attention_groups(compat_fields: Mapping[str, str]) -> frozenset[int] | None:
    """The KV groups whose leading run bounds a prefix hit (``kv_groups`` of the compat fields: each entry
    starts with its attention kind); None when the fields do not say (then every group counts)."""
    try:
        groups = json.loads(compat_fields["kv_groups"])
        return frozenset(g for g, entry in enumerate(groups) if entry[0] != "sliding_window")
    except (KeyError, TypeError, ValueError, IndexError):
        return None


@dataclass
class _Group:
    block_size: int
    keys: set[bytes] = field(default_factory=set)


@dataclass
class _Worker:
    engine_id: str = ""
    epoch: int = 0
    state: CacheState = CacheState.UNKNOWN
    groups: dict[tuple[int, int], _Group] = field(default_factory=dict)  # (group id, tier) -> its keys
    predicted: dict[bytes, float] = field(default_factory=dict)  # key -> expiry (monotonic seconds)
    predicted_block_size: int = 0
    # Device-tier keys (confirmed or predicted) by when they were last stored or routed to, oldest first.
    recency: OrderedDict[bytes, float] = field(default_factory=OrderedDict)
    next_seq: int = 1
    last_batch_s: float | None = None
    load: Load | None = None


_LRUKey = tuple[str, tuple[int, int], bytes]  # (address, (group id, tier) or _PREDICTED, key)


class PrefixIndex:
    """Per worker and tier, the keys its prefix caches hold; bounded by one LRU over all of them."""

    def __init__(self, capacity_keys: int = 1_000_000, predicted_ttl_s: float = 10.0) -> None:
        if capacity_keys < 1:
            raise ValueError(f"capacity_keys must be >= 1, got {capacity_keys}")
        if not predicted_ttl_s > 0:
            raise ValueError(f"predicted_ttl_s must be > 0, got {predicted_ttl_s}")
        self.capacity_keys = capacity_keys
        self.predicted_ttl_s = predicted_ttl_s
        self.num_evicted = 0  # keys forgotten for capacity since the start
        self._workers: dict[str, _Worker] = {}
        self._lru: OrderedDict[_LRUKey, None] = OrderedDict()

    # ---- what the subscriber reports ---------------------------------------------------------------

    def load_snapshot(self, address: str, snapshot: worker_pb2.KVSnapshotResponse, now_s: float) -> None:
        """Make the worker's entries exactly the snapshot's; events numbered after ``snapshot.seq`` follow.

        Predicted entries survive a resync within the same epoch (they are still this router's guesses).
        """
        old = self._workers.get(address)
        same_epoch = old is not None and (old.engine_id, old.epoch) == (snapshot.engine_id, snapshot.epoch)
        self._drop_confirmed(address) if same_epoch else self.drop(address)
        worker = self._workers.setdefault(address, _Worker())
        worker.engine_id, worker.epoch = snapshot.engine_id, snapshot.epoch
        worker.state, worker.next_seq = CacheState.SYNCED, snapshot.seq + 1
        worker.last_batch_s = now_s
        if snapshot.HasField("load"):
            worker.load = Load.of(snapshot.load)
        for event in snapshot.stored:
            self._apply(address, worker, event, now_s)
        self._bound()

    def apply_batch(self, address: str, batch: worker_pb2.KVEventBatch, now_s: float) -> BatchResult:
        """Apply a batch's events not yet reflected; a gap or another epoch marks the worker unknown."""
        worker = self._workers.get(address)
        if worker is None or worker.state is not CacheState.SYNCED:
            return BatchResult.NOT_SYNCED
        if (batch.engine_id, batch.epoch) != (worker.engine_id, worker.epoch):
            self.drop(address)
            self._workers[address] = _Worker()
            return BatchResult.EPOCH_CHANGED
        if batch.first_seq > worker.next_seq:
            self.mark_unknown(address)
            return BatchResult.GAP
        for event in batch.events[worker.next_seq - batch.first_seq:]:
            self._apply(address, worker, event, now_s)
        worker.next_seq = max(worker.next_seq, batch.first_seq + len(batch.events))
        worker.last_batch_s = now_s
        if batch.HasField("load"):
            worker.load = Load.of(batch.load)
        self._bound()
        return BatchResult.APPLIED

    def mark_unknown(self, address: str) -> None:
        """The worker's stream broke (or has a gap): forget what it reported until a snapshot resyncs it."""
        self._drop_confirmed(address)
        worker = self._workers.setdefault(address, _Worker())
        worker.state, worker.last_batch_s = CacheState.UNKNOWN, None

    def mark_unsupported(self, address: str) -> None:
        """The worker has no KVEvents RPC: route it cache-blind."""
        self._drop_confirmed(address)
        worker = self._workers.setdefault(address, _Worker())
        worker.state, worker.last_batch_s = CacheState.UNSUPPORTED, None

    def drop(self, address: str) -> None:
        """Forget everything about a worker (removed by discovery, or a new engine epoch answers there)."""
        self._drop_confirmed(address)
        worker = self._workers.pop(address, None)
        if worker is not None:
            for key in worker.predicted:
                self._lru.pop((address, _PREDICTED, key), None)

    # ---- what routing reads ------------------------------------------------------------------------

    def block_sizes(self, address: str) -> set[int]:
        """The block sizes a lookup or prediction on the worker keys prompts by (its groups', its predictions')."""
        worker = self._workers.get(address)
        if worker is None:
            return set()
        sizes = {group.block_size for group in worker.groups.values()}
        return sizes | {worker.predicted_block_size} if worker.predicted_block_size else sizes

    def lookup(self, address: str, epoch: int, salt: bytes, prompt: PromptKeys,
               groups: frozenset[int] | None, now_s: float) -> CacheHit:
        """The prompt's cached prefix on the worker whose current epoch (from its ``Info``) is ``epoch``.

        Entries of another epoch count for nothing (a worker restarted in place before its stream said so).
        At least one prompt token is always left to compute, as in the engine.
        """
        worker = self._workers.get(address)
        if worker is None:
            return CacheHit()
        if worker.engine_id and worker.epoch != epoch:
            return CacheHit(state=CacheState.UNKNOWN)
        limit = len(prompt) - 1
        device, confirmed = self._tier_prefix(worker, DEVICE, salt, prompt, groups, limit, now_s)
        host, _ = self._tier_prefix(worker, HOST, salt, prompt, groups, limit, now_s)
        return CacheHit(device, max(host - device, 0), worker.state, confirmed)

    def cache_room(self, address: str, epoch: int, num_blocks: int, now_s: float) -> CacheRoom:
        """What caching ``num_blocks`` more blocks on the worker would evict (module docstring); unknown
        (never preferred) until the worker, of ``epoch``, reports its pool size."""
        worker = self._workers.get(address)
        if (worker is None or worker.state is not CacheState.SYNCED or worker.load is None
                or not worker.load.kv_blocks_total or worker.epoch != epoch):
            return UNKNOWN_ROOM
        groups = max(sum(1 for slot in worker.groups if slot[1] == DEVICE), 1)
        free = worker.load.kv_blocks_total - groups * (len(worker.recency) + num_blocks)
        if free >= 0 or not worker.recency:
            return CacheRoom(free, math.inf if free < 0 else 0.0)
        return CacheRoom(free, now_s - next(iter(worker.recency.values())))

    def predict(self, address: str, epoch: int, salt: bytes, block_size: int, prompt: PromptKeys,
                now_s: float) -> None:
        """The router sent ``prompt`` to the worker: its blocks will be cached there (until the TTL, unless
        a STORED event confirms them). Keys it already reports are touched in the LRU instead."""
        if block_size < 1:
            return
        worker = self._workers.setdefault(address, _Worker())
        if worker.engine_id and worker.epoch != epoch:
            return  # its entries are stale; the subscriber resyncs it
        if worker.predicted_block_size != block_size:
            for key in worker.predicted:
                self._lru.pop((address, _PREDICTED, key), None)
            worker.predicted.clear()
            worker.predicted_block_size = block_size
        expiry = now_s + self.predicted_ttl_s
        confirmed = [(slot, g.keys) for slot, g in worker.groups.items()
                     if slot[1] == DEVICE and g.block_size == block_size]
        for key in prompt.keys(block_size, salt):
            _touch(worker, key, now_s)
            touched = False
            for slot, keys in confirmed:
                if key in keys:
                    self._lru.move_to_end((address, slot, key))
                    touched = True
            if not touched:
                worker.predicted[key] = expiry
                self._lru[(address, _PREDICTED, key)] = None
                self._lru.move_to_end((address, _PREDICTED, key))
        self._bound()

    def expire(self, now_s: float) -> int:
        """Drop predicted entries past their TTL; how many."""
        gone = 0
        for address, worker in self._workers.items():
            stale = [key for key, expiry in worker.predicted.items() if expiry <= now_s]
            for key in stale:
                del worker.predicted[key]
                self._lru.pop((address, _PREDICTED, key), None)
                _forget_if_gone(worker, key)
            gone += len(stale)
        return gone

    def state(self, address: str) -> CacheState:
        worker = self._workers.get(address)
        return worker.state if worker is not None else CacheState.UNKNOWN

    def load(self, address: str, epoch: int) -> Load | None:
        """The worker's last reported load, if it is of that epoch."""
        worker = self._workers.get(address)
        if worker is None or worker.load is None or (worker.engine_id and worker.epoch != epoch):
            return None
        return worker.load

    def last_batch_s(self, address: str) -> float | None:
        worker = self._workers.get(address)
        return worker.last_batch_s if worker is not None else None

    def addresses(self) -> list[str]:
        return list(self._workers)

    def num_keys(self) -> dict[str, int]:
        """Keys held, confirmed (reported by events) and predicted (this router's guesses)."""
        predicted = sum(len(w.predicted) for w in self._workers.values())
        return {"confirmed": len(self._lru) - predicted, "predicted": predicted}

    def worker_states(self) -> dict[str, int]:
        counts = dict.fromkeys((s.value for s in CacheState), 0)
        for worker in self._workers.values():
            counts[worker.state.value] += 1
        return counts

    # ---- inside ------------------------------------------------------------------------------------

    def _tier_prefix(self, worker: _Worker, tier: int, salt: bytes, prompt: PromptKeys,
                     groups: frozenset[int] | None, limit: int, now_s: float) -> tuple[int, int]:
        """Tokens of the longest prefix every counted group of the tier holds (device: predicted keys too),
        and of the part of it events reported (no predicted key up to there)."""
        slots = [g for slot, g in worker.groups.items() if slot[1] == tier and (groups is None or slot[0] in groups)]
        predicted = worker.predicted if tier == DEVICE else {}
        if not slots:
            if not predicted:
                return 0, 0
            slots = [_Group(worker.predicted_block_size)]
        best: tuple[int, int] | None = None
        for group in slots:
            use_predicted = bool(predicted) and group.block_size == worker.predicted_block_size
            run = confirmed = 0
            for key in prompt.keys(group.block_size, salt)[:max(limit, 0) // group.block_size]:
                if key in group.keys:
                    confirmed += run == confirmed
                elif not (use_predicted and predicted.get(key, 0.0) > now_s):
                    break
                run += 1
            tokens = (run * group.block_size, confirmed * group.block_size)
            best = tokens if best is None else (min(best[0], tokens[0]), min(best[1], tokens[1]))
        return best or (0, 0)

    def _apply(self, address: str, worker: _Worker, event: worker_pb2.KVCacheEvent, now_s: float) -> None:
        slot = (event.group_id, event.tier)
        if event.kind == worker_pb2.KVCacheEvent.CLEARED:
            group = worker.groups.pop(slot, None)
            for key in group.keys if group is not None else ():
                self._lru.pop((address, slot, key), None)
                _forget_if_gone(worker, key)
            return
        if event.block_size < 1:
            return  # malformed: a key with no tokens names nothing
        group = worker.groups.get(slot)
        if group is None or group.block_size != event.block_size:
            if group is not None:  # the worker changed the group's block size: its old keys mean nothing
                worker.groups.pop(slot)
                for key in group.keys:
                    self._lru.pop((address, slot, key), None)
                    _forget_if_gone(worker, key)
            group = worker.groups[slot] = _Group(event.block_size)
        if event.kind == worker_pb2.KVCacheEvent.STORED:
            self._store(address, worker, slot, group, event.block_keys, now_s)
        else:
            for key in event.block_keys:
                group.keys.discard(key)
                self._lru.pop((address, slot, key), None)
                _forget_if_gone(worker, key)

    def _store(self, address: str, worker: _Worker, slot: tuple[int, int], group: _Group,
               keys: Iterable[bytes], now_s: float) -> None:
        device = slot[1] == DEVICE
        confirms = device and group.block_size == worker.predicted_block_size
        for key in keys:
            group.keys.add(key)
            lru_key = (address, slot, key)
            self._lru[lru_key] = None
            self._lru.move_to_end(lru_key)
            if device:
                _touch(worker, key, now_s)
            if confirms and worker.predicted.pop(key, None) is not None:
                self._lru.pop((address, _PREDICTED, key), None)

    def _drop_confirmed(self, address: str) -> None:
        worker = self._workers.get(address)
        if worker is None:
            return
        for slot, group in worker.groups.items():
            for key in group.keys:
                self._lru.pop((address, slot, key), None)
        worker.groups.clear()
        for key in [k for k in worker.recency if k not in worker.predicted]:
            del worker.recency[key]

    def _bound(self) -> None:
        while len(self._lru) > self.capacity_keys:
            (address, slot, key), _ = self._lru.popitem(last=False)
            self.num_evicted += 1
            worker = self._workers.get(address)
            if worker is None:
                continue
            if slot == _PREDICTED:
                worker.predicted.pop(key, None)
            elif (group := worker.groups.get(slot)) is not None:
                group.keys.discard(key)
            _forget_if_gone(worker, key)


def _touch(worker: _Worker, key: bytes, now_s: float) -> None:
    """The key was stored or routed to on the worker now: the most recently used of its device keys."""
    worker.recency[key] = now_s
    worker.recency.move_to_end(key)


def _forget_if_gone(worker: _Worker, key: bytes) -> None:
    """Drop the key from the worker's recency once no device group and no prediction holds it."""
    if key in worker.predicted or any(key in g.keys for slot, g in worker.groups.items() if slot[1] == DEVICE):
        return
    worker.recency.pop(key, None)
