"""KV events: what the prefix caches store and remove, numbered on the engine thread, for a router's index.

Each pool (a device group's ``BlockPool``, a host-tier group's span pool) records through its own
``PoolEvents``, which knows the pool's (group, tier, block size). Nothing is built while nobody
listens: ``KVEventLog.enabled`` is checked before anything else. Consecutive keys of one kind from
one pool, recorded in one engine iteration, share one event (a prompt's blocks published in one
step are one STORED event, in prefix order)::

    engine thread                                 publisher (event loop)
    pool.cache_block -> record(STORED, k1)  seq 7
    pool.cache_block -> record(STORED, k2)  (joins 7)
    pool._evict      -> record(REMOVED, k0) seq 8
    seal()  (end of the loop iteration)  -> outbound [7, 8] -> take() -> batches to subscribers

Sequence numbers start at 1 for the engine's life (one epoch of its worker) and count events only
while enabled. Sealed events wait in a bounded outbound queue; when it is full a sealed batch is
dropped whole and its numbers are skipped, so every subscriber sees the gap and resyncs. A snapshot
(``snapshot_keys``) runs on the engine thread after a ``seal``: it reflects every event numbered up to
``last_seq`` and none after.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: Keys the outbound queue may hold before sealed events are dropped (a gap): a stalled publisher
#: must not grow the engine's memory without bound.
MAX_OUTBOUND_KEYS = 1 << 20


class KVTier(enum.IntEnum):
    """Where a cache lives; the values are ``pdserve.v1.KVTier``'s."""

    DEVICE = 0
    HOST = 1


class KVEventKind(enum.IntEnum):
    """What happened; the values are ``pdserve.v1.KVCacheEvent.Kind``'s."""

    STORED = 0
    REMOVED = 1
    CLEARED = 2  # every key of the (group, tier) is gone; no keys


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: KVEventKind
    group_id: int
    tier: KVTier
    block_size: int  # tokens one key covers (a host span: the span's tokens)
    block_keys: tuple[bytes, ...]


@dataclass(frozen=True)
class KVCacheContents:
    """Every key one (group, tier) holds now: one entry of a snapshot."""

    group_id: int
    tier: KVTier
    block_size: int
    block_keys: tuple[bytes, ...]


class _OpenEvent:
    """An event of this iteration that later keys of the same kind and pool may still join."""

    __slots__ = ("seq", "kind", "pool", "keys")

    def __init__(self, seq: int, kind: KVEventKind, pool: PoolEvents, keys: list[bytes]) -> None:
        self.seq, self.kind, self.pool, self.keys = seq, kind, pool, keys

    def sealed(self) -> KVEvent:
        p = self.pool
        return KVEvent(self.seq, self.kind, p.group_id, p.tier, p.block_size, tuple(self.keys))


class KVEventLog:
    """One engine's event numbering and outbound queue; ``record``/``seal`` on the engine thread only.

    ``enabled`` is set from any thread (the publisher: while it has subscribers); a plain attribute,
    read once per recorded key.
    """

    def __init__(self, max_outbound_keys: int = MAX_OUTBOUND_KEYS) -> None:
        if max_outbound_keys < 1:
            raise ValueError(f"max_outbound_keys must be >= 1, got {max_outbound_keys}")
        self.enabled = False
        self.max_outbound_keys = max_outbound_keys
        self._next_seq = 1
        self._open: list[_OpenEvent] = []
        self._lock = threading.Lock()  # guards the outbound queue: sealed here, taken by the publisher
        self._outbound: deque[KVEvent] = deque()
        self._outbound_keys = 0
        self.num_dropped = 0  # events dropped because the outbound queue was full

    @property
    def last_seq(self) -> int:
        """The number of the newest event recorded (0: none yet)."""
        return self._next_seq - 1

    def pool(self, group_id: int, tier: KVTier, block_size: int) -> PoolEvents:
        """The recorder one pool uses."""
        return PoolEvents(self, group_id, tier, block_size)

    def record(self, kind: KVEventKind, pool: PoolEvents, key: bytes | None) -> None:
        """One key stored or removed (``key`` None: the pool cleared); joins the open event when it can."""
        last = self._open[-1] if self._open else None
        if key is not None and last is not None and last.kind is kind and last.pool is pool:
            last.keys.append(key)
            return
        self._open.append(_OpenEvent(self._next_seq, kind, pool, [] if key is None else [key]))
        self._next_seq += 1

    def seal(self) -> None:
        """Close this iteration's events and queue them for the publisher (dropped whole when full)."""
        if not self._open:
            return
        events = [e.sealed() for e in self._open]
        self._open = []
        num_keys = sum(len(e.block_keys) for e in events)
        with self._lock:
            if self._outbound_keys + num_keys > self.max_outbound_keys:
                self.num_dropped += len(events)
                dropped = True
            else:
                self._outbound.extend(events)
                self._outbound_keys += num_keys
                dropped = False
        if dropped:
            log.warning("KV events %d..%d dropped: the outbound queue holds %d keys already (subscribers resync)",
                        events[0].seq, events[-1].seq, self._outbound_keys)

    def take(self) -> list[KVEvent]:
        """Every sealed event, oldest first (any thread: the publisher's)."""
        with self._lock:
            events = list(self._outbound)
            self._outbound.clear()
            self._outbound_keys = 0
        return events


class PoolEvents:
    """One pool's recorder: the pool calls it only after checking ``on``."""

    __slots__ = ("log", "group_id", "tier", "block_size")

    def __init__(self, log: KVEventLog, group_id: int, tier: KVTier, block_size: int) -> None:
        self.log, self.group_id, self.tier, self.block_size = log, group_id, tier, block_size

    @property
    def on(self) -> bool:
        return self.log.enabled

    def stored(self, key: bytes) -> None:
        self.log.record(KVEventKind.STORED, self, key)

    def removed(self, key: bytes) -> None:
        self.log.record(KVEventKind.REMOVED, self, key)

    def cleared(self) -> None:
        self.log.record(KVEventKind.CLEARED, self, None)

    def contents(self, keys: Iterable[bytes]) -> KVCacheContents:
        return KVCacheContents(self.group_id, self.tier, self.block_size, tuple(keys))

