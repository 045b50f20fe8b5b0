"""When a prefill worker frees the KV it pinned for readers: all read, or the lease ran out.

A prefill's blocks stay pinned after its ticket is handed out, until every reading rank's NIXL
notification arrived (``KVExporter.collect_notifications``, then ``released``) or, if some never come
(the decode worker died, the router gave up), until the lease expires: then they are freed anyway and counted in
``pdserve_kv_lease_expiries_total``. Notifications that free nothing (forged, late or repeated)
are counted in ``pdserve_kv_refused_total``. ``Release``/``Abort`` RPCs free blocks directly and
are not this module's business.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from services.common.metrics import WorkerMetrics

log = logging.getLogger(__name__)

#: How often the loop polls for notifications while tickets are out: a freed block is usable again within this.
POLL_INTERVAL_S = 0.005
#: ... and with none out. An idle prefill worker polling (a thread hop and a NIXL call) every 5 ms, its stats loop
#: at the same pace, used 10-12% of a CPU core; with this at 50 ms, 5%, and with the stats at 50 ms too, 2%
#: (SmolLM2 on the CPU build machine: bench/RESULTS.md). A ticket handed out during the longer sleep has its
#: reader's notification taken up to that much later: its blocks are freed later, no request waits for it.
IDLE_POLL_INTERVAL_S = 0.05


class Notifications(Protocol):
    """The exporter side of a release (``KVExporter`` has it)."""

    def collect_notifications(self) -> list[dict[str, list[bytes]]]: ...

    def released(self, notes: list[dict[str, list[bytes]]]) -> list[str]: ...

    def expire(self, lease_s: float) -> list[str]: ...

    def refused_notifications(self) -> dict[str, int]: ...

    num_outstanding: int  # tickets handed out whose readers have not all notified
    num_staged: int  # tickets gathered into staging areas, and those worth it that found no room
    num_staging_full: int


class HeldKV(Protocol):
    """The engine side of a release (``AsyncEngine`` has it)."""

    async def release_held_kv(self, request_id: str) -> bool: ...


class ReleaseLoop:
    """Frees pinned blocks as readers finish (notifications) or leases run out.

    :meth:`tick` is one pass; :func:`run_current` repeats it every :meth:`poll_interval_s`. Leases are
    checked at most every ``min(1 s, lease_s / 4)``: often enough that a block outlives its lease by a
    quarter at most.
    """

    def __init__(self, engine: HeldKV, exporter: Notifications, metrics: WorkerMetrics, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._exporter = exporter
        self._metrics = metrics
        self._lease_s = lease_s
        self._clock = clock
        self._last_expiry = clock()
        self._refused = dict.fromkeys(exporter.refused_notifications(), 0)  # totals already counted
        self._staged = {"staged": 0, "full": 0}

    def poll_interval_s(self) -> float:
        """Short while tickets are out (a freed block is usable again soon), long while none is."""
        return POLL_INTERVAL_S if self._exporter.num_outstanding else IDLE_POLL_INTERVAL_S

    async def tick(self) -> None:
        """Free what every reader has read; every lease period, what was never read, and count refusals.

        The notifications are polled on a thread: over UCX's TCP transport a reader's data moves inside that
        NIXL call (up to ~70 ms per call measured on an H100 serving 1 GiB parts), which on the event loop
        would hold every RPC of this worker, its health answers included."""
        notes = await asyncio.to_thread(self._exporter.collect_notifications)
        for rid in self._exporter.released(notes):
            await self._engine.release_held_kv(rid)
        self._count_staged()
        if self._clock() - self._last_expiry > min(1.0, self._lease_s / 4):
            self._last_expiry = self._clock()
            await self._expire()
            self._count_refused()

    async def _expire(self) -> None:
        for rid in self._exporter.expire(self._lease_s):
            log.warning("request %s: KV lease of %.0fs expired before it was pulled", rid, self._lease_s)
            self._metrics.lease_expiries.labels("prefill").inc()
            await self._engine.release_held_kv(rid)

    def _count_staged(self) -> None:
        for outcome, total in (("staged", self._exporter.num_staged), ("full", self._exporter.num_staging_full)):
            if total > self._staged[outcome]:
                self._metrics.kv_staged.labels("prefill", outcome).inc(total - self._staged[outcome])
                self._staged[outcome] = total

    def _count_refused(self) -> None:
        for reason, total in self._exporter.refused_notifications().items():
            if total > self._refused[reason]:
                log.info("refused %d NIXL notifications (%s): they name no ticket held here",
                         total - self._refused[reason], reason)
                self._metrics.kv_refused.labels("prefill", "notification", reason).inc(total - self._refused[reason])
                self._refused[reason] = total


async def run_current(current: Callable[[], ReleaseLoop], stop: asyncio.Event) -> None:
    """Tick the current release loop until ``stop`` is set. ``current`` is asked on every pass: a role switch
    back to prefill starts a new epoch with a new exporter, and its loop takes over from the next pass."""
    while not stop.is_set():
        loop = current()
        await loop.tick()
        await asyncio.sleep(loop.poll_interval_s())
