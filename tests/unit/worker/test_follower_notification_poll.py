"""A follower TP rank polls its NIXL agent for notifications quickly while transfers may be under way and slowly
once idle (``follower_kv_service.notification_poll_s``): an idle TP worker should not keep a CPU core busy."""

from __future__ import annotations

from services.worker.follower_kv_service import (
    IDLE_AFTER_S,
    IDLE_POLL_S,
    NOTIFICATION_POLL_S,
    notification_poll_s,
)


def test_polls_fast_after_activity_and_slowly_once_idle() -> None:
    assert NOTIFICATION_POLL_S < IDLE_POLL_S <= 0.1  # a notification is never held back long
    active_at = 100.0
    assert notification_poll_s(active_at, active_at) == NOTIFICATION_POLL_S
    assert notification_poll_s(active_at + IDLE_AFTER_S - 0.01, active_at) == NOTIFICATION_POLL_S
    assert notification_poll_s(active_at + IDLE_AFTER_S + 0.01, active_at) == IDLE_POLL_S
