"""NotificationTracker: the owner's count of reader notifications per handed-out request (pure logic, no NIXL)."""

from __future__ import annotations

import pytest

from services.kv.owner.notifications import NotificationTracker, TrackerStats


def test_tracker_expires_and_ignores_unknown_keys() -> None:
    now = [100.0]
    tracker = NotificationTracker(clock=lambda: now[0])
    tracker.expect(b"a", 1)
    tracker.expect(b"b", 2)
    now[0] += 10
    tracker.expect(b"c", 1)
    assert tracker.feed({"r0": [b"b"]}) == []
    assert sorted(tracker.expire(older_than_s=5)) == [b"a", b"b"]
    assert tracker.feed({"r1": [b"b", b"zzz"], "r0": [b"c"]}) == [b"c"]
    assert tracker.stats() == TrackerStats(num_pending=0, num_completed=1, num_expired=2, num_unknown=2,
                                           num_duplicate=0)
    with pytest.raises(ValueError, match="num_readers"):
        tracker.expect(b"d", 0)
    tracker.expect(b"d", 1)
    with pytest.raises(ValueError, match="already expected"):
        tracker.expect(b"d", 1)


def test_key_completes_once_after_every_distinct_reader() -> None:
    tracker = NotificationTracker()
    tracker.expect(b"k", 2)
    assert tracker.feed({"r0": [b"k", b"k"]}) == []  # the same reader twice: a duplicate
    assert tracker.feed({"r1": [b"k"]}) == [b"k"]
    assert tracker.feed({"r1": [b"k"]}) == []  # late: the key is gone
    assert tracker.stats() == TrackerStats(num_pending=0, num_completed=1, num_expired=0, num_unknown=1,
                                           num_duplicate=1)


def test_discarded_key_no_longer_completes() -> None:
    tracker = NotificationTracker()
    tracker.expect(b"k", 1)
    assert tracker.discard(b"k") is True
    assert tracker.discard(b"k") is False
    assert tracker.feed({"r0": [b"k"]}) == []
    assert tracker.stats().num_unknown == 1
