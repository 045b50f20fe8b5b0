"""Owner-side bookkeeping of NIXL notifications: which handed-out requests all their readers have read.

Pure logic (no NIXL): the exporter feeds it what ``TransferAgent.poll_notifications`` returned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrackerStats:
    num_pending: int
    num_completed: int
    num_expired: int
    num_unknown: int
    num_duplicate: int


@dataclass
class _Expected:
    num_readers: int
    created_at: float
    readers: set[str] = field(default_factory=set)


class NotificationTracker:
    """Which handed-out requests have been read by all their readers, so blocks are freed exactly once.

    With TP mismatch several reading ranks pull from one owner rank; each sends one notification
    (the request key) when its READ completes. Call ``expect`` before handing out the ticket.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._expected: dict[bytes, _Expected] = {}
        self._completed = self._expired = self._unknown = self._duplicate = 0

    def expect(self, key: bytes, num_readers: int) -> None:
        if num_readers < 1:
            raise ValueError(f"num_readers must be >= 1, got {num_readers}")
        if key in self._expected:
            raise ValueError(f"key {key!r} is already expected")
        self._expected[key] = _Expected(num_readers, self._clock())

    def feed(self, notifications: Mapping[str, Iterable[bytes]]) -> list[bytes]:
        """Count notifications (peer -> messages); return keys that just reached their reader count."""
        done = []
        for peer, messages in notifications.items():
            for key in messages:
                if self._count(peer, bytes(key)):
                    done.append(bytes(key))
        return done

    def _count(self, peer: str, key: bytes) -> bool:
        entry = self._expected.get(key)
        if entry is None:
            self._unknown += 1
            log.debug("notification %r from %s matches no pending request", key, peer)
            return False
        if peer in entry.readers:
            self._duplicate += 1
            log.debug("duplicate notification %r from %s", key, peer)
            return False
        entry.readers.add(peer)
        if len(entry.readers) < entry.num_readers:
            return False
        del self._expected[key]
        self._completed += 1
        return True

    def expire(self, older_than_s: float) -> list[bytes]:
        """Forget and return keys expected more than ``older_than_s`` ago and never completed."""
        cutoff = self._clock() - older_than_s
        old = [k for k, e in self._expected.items() if e.created_at <= cutoff]
        for key in old:
            del self._expected[key]
        self._expired += len(old)
        return old

    def discard(self, key: bytes) -> bool:
        """Stop tracking a key (its request was aborted); later notifications count as unknown."""
        return self._expected.pop(key, None) is not None

    def stats(self) -> TrackerStats:
        return TrackerStats(len(self._expected), self._completed, self._expired, self._unknown, self._duplicate)
