"""The prefill worker's release loop, without gRPC or NIXL: a fake exporter, engine and clock.

Pinned blocks are freed once every reader notified, or when their lease runs out (counted), never
twice; notifications that free nothing are counted by reason, once each.
"""

from __future__ import annotations

import asyncio
import threading
import time

from services.common.metrics import WorkerMetrics
from services.prefill.release import ReleaseLoop, run_current


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    def __init__(self) -> None:
        self.released: list[str] = []

    async def release_held_kv(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True


class FakeExporter:
    """Tickets out, by request id; ``read`` marks one as read by all its readers."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.handed_out: dict[str, float] = {}
        self.read_by_all: list[str] = []
        self.refused = {"unknown": 0, "duplicate": 0}
        self.expire_calls: list[float] = []
        self.poll_threads: list[int] = []
        self.poll_s = 0.0

    def hand_out(self, rid: str) -> None:
        self.handed_out[rid] = self.clock()

    def collect_notifications(self) -> list[dict[str, list[bytes]]]:
        self.poll_threads.append(threading.get_ident())
        time.sleep(self.poll_s)  # the NIXL call moving a TCP reader's data
        notes, self.read_by_all = [{"reader": [rid.encode() for rid in self.read_by_all]}], []
        return notes

    def released(self, notes: list[dict[str, list[bytes]]]) -> list[str]:
        done = [rid for rid in (m.decode() for n in notes for m in n.get("reader", [])) if rid in self.handed_out]
        for rid in done:
            del self.handed_out[rid]
        return done

    def expire(self, lease_s: float) -> list[str]:
        self.expire_calls.append(lease_s)
        expired = sorted(rid for rid, t in self.handed_out.items() if t <= self.clock() - lease_s)
        for rid in expired:
            del self.handed_out[rid]
        return expired

    def refused_notifications(self) -> dict[str, int]:
        return dict(self.refused)

    num_staged = 0
    num_staging_full = 0

    @property
    def num_outstanding(self) -> int:
        return len(self.handed_out)


def _loop(lease_s: float = 8.0) -> tuple[ReleaseLoop, FakeEngine, FakeExporter, FakeClock, WorkerMetrics]:
    clock, engine, metrics = FakeClock(), FakeEngine(), WorkerMetrics("prefill")
    exporter = FakeExporter(clock)
    return ReleaseLoop(engine, exporter, metrics, lease_s, clock=clock), engine, exporter, clock, metrics


def _value(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"role": "prefill", **labels})
    assert value is not None, f"no {name} sample with {labels}"  # a missing series is not 0
    return value


def test_blocks_read_by_every_reader_are_freed_at_the_next_tick() -> None:
    loop, engine, exporter, _, metrics = _loop()
    exporter.hand_out("a")
    exporter.hand_out("b")
    asyncio.run(loop.tick())
    assert engine.released == []  # nobody has read yet
    exporter.read_by_all.append("b")
    asyncio.run(loop.tick())
    assert engine.released == ["b"] and list(exporter.handed_out) == ["a"]
    assert _value(metrics, "pdserve_kv_lease_expiries_total") == 0


def test_an_unread_ticket_is_freed_when_its_lease_expires_and_counted() -> None:
    loop, engine, exporter, clock, metrics = _loop(lease_s=8.0)
    exporter.hand_out("never-pulled")
    clock.now += 2.5  # past the check period (min(1 s, lease / 4)) but inside the lease
    asyncio.run(loop.tick())
    assert exporter.expire_calls == [8.0] and engine.released == []
    clock.now += 6.0  # 8.5 s after the hand-out
    asyncio.run(loop.tick())
    assert engine.released == ["never-pulled"]
    assert _value(metrics, "pdserve_kv_lease_expiries_total") == 1


def test_leases_are_checked_once_per_period_not_every_tick() -> None:
    loop, _, exporter, clock, _ = _loop(lease_s=2.0)  # period: min(1 s, 2 s / 4) = 0.5 s
    for _ in range(5):
        clock.now += 0.1
        asyncio.run(loop.tick())
    assert exporter.expire_calls == []
    clock.now += 0.1  # 0.6 s since the loop started
    asyncio.run(loop.tick())
    asyncio.run(loop.tick())
    assert exporter.expire_calls == [2.0]
    clock.now += 30.0  # a long lease still checks every second at least
    asyncio.run(loop.tick())
    assert exporter.expire_calls == [2.0, 2.0]


def test_a_ticket_read_after_its_lease_expired_is_not_freed_twice() -> None:
    loop, engine, exporter, clock, _ = _loop(lease_s=1.0)
    exporter.hand_out("late")
    clock.now += 1.5
    asyncio.run(loop.tick())
    exporter.read_by_all.append("late")  # the reader's notification arrives after the lease freed it
    asyncio.run(loop.tick())
    assert engine.released == ["late"]


def test_refused_notifications_are_counted_by_reason_once_each() -> None:
    loop, engine, exporter, clock, metrics = _loop(lease_s=4.0)
    exporter.refused["unknown"] = 2
    exporter.refused["duplicate"] = 1
    asyncio.run(loop.tick())  # counted with the lease check, not before its period
    assert _value(metrics, "pdserve_kv_refused_total", kind="notification", reason="unknown") == 0
    clock.now += 1.5
    asyncio.run(loop.tick())
    exporter.refused["unknown"] = 5
    clock.now += 1.5
    asyncio.run(loop.tick())
    clock.now += 1.5
    asyncio.run(loop.tick())  # nothing new: nothing added
    assert _value(metrics, "pdserve_kv_refused_total", kind="notification", reason="unknown") == 5
    assert _value(metrics, "pdserve_kv_refused_total", kind="notification", reason="duplicate") == 1
    assert engine.released == []


def test_staged_tickets_and_staging_misses_are_counted_once_each() -> None:
    loop, _, exporter, _, metrics = _loop()
    assert _value(metrics, "pdserve_kv_staged_total", outcome="staged") == 0
    exporter.num_staged, exporter.num_staging_full = 3, 1
    asyncio.run(loop.tick())
    asyncio.run(loop.tick())  # nothing new: nothing added
    exporter.num_staged = 4
    asyncio.run(loop.tick())
    assert _value(metrics, "pdserve_kv_staged_total", outcome="staged") == 4
    assert _value(metrics, "pdserve_kv_staged_total", outcome="full") == 1


def test_run_current_ticks_until_stopped_and_follows_a_new_loop() -> None:
    """The daemon's task ticks whichever loop is current: after a role switch's new epoch replaces the loop
    (and its exporter), the new one's reads are freed and the old one is ticked no more."""
    old_loop, old_engine, old_exporter, _, _ = _loop()
    new_loop, new_engine, new_exporter, _, _ = _loop()
    current = [old_loop]

    async def wait_for(engine: FakeEngine) -> None:
        for _ in range(200):
            if engine.released:
                return
            await asyncio.sleep(0.005)

    async def run_briefly() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_current(lambda: current[0], stop))
        old_exporter.hand_out("a")
        old_exporter.read_by_all.append("a")
        await wait_for(old_engine)
        current[0] = new_loop
        new_exporter.hand_out("b")
        new_exporter.read_by_all.append("b")
        old_exporter.hand_out("c")
        old_exporter.read_by_all.append("c")
        await wait_for(new_engine)
        stop.set()
        await asyncio.wait_for(task, timeout=1.0)

    asyncio.run(run_briefly())
    assert old_engine.released == ["a"] and new_engine.released == ["b"]


def test_a_slow_notification_poll_never_holds_the_event_loop() -> None:
    """Over UCX's TCP transport a reader's data moves inside the owner's NIXL notification poll (tens of ms):
    the poll runs on a thread, and the loop's other work (health answers, new prefills) goes on meanwhile."""
    loop, engine, exporter, _, _ = _loop()
    exporter.poll_s = 0.3
    exporter.hand_out("a")
    exporter.read_by_all.append("a")

    async def main() -> list[float]:
        gaps, stop = [], asyncio.Event()

        async def ticker() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(ticker())
        await loop.tick()
        stop.set()
        await beat
        return gaps

    gaps = asyncio.run(main())
    assert engine.released == ["a"]
    assert exporter.poll_threads and threading.get_ident() not in exporter.poll_threads
    assert len(gaps) >= 10 and max(gaps) < 0.1, gaps


def test_polls_often_while_tickets_are_out_and_rarely_while_none_is() -> None:
    """An idle prefill worker should not keep a CPU core busy polling; one with tickets out frees blocks soon."""
    from services.prefill.release import IDLE_POLL_INTERVAL_S, POLL_INTERVAL_S

    loop, _, exporter, _, _ = _loop()
    assert POLL_INTERVAL_S < IDLE_POLL_INTERVAL_S <= 0.1
    assert loop.poll_interval_s() == IDLE_POLL_INTERVAL_S
    exporter.hand_out("r1")
    assert loop.poll_interval_s() == POLL_INTERVAL_S
    exporter.read_by_all.append("r1")
    asyncio.run(loop.tick())
    assert loop.poll_interval_s() == IDLE_POLL_INTERVAL_S
