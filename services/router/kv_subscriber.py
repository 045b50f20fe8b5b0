"""Keeps the prefix index fresh: one task per worker reading its KV events, resyncing by snapshot.

Each task runs one session after another::

    KVEvents ──► first batch (the subscription is live) ──► KVSnapshot ──► index = snapshot
        └─► every batch: events numbered after what the index reflects are applied, the load kept
    gap / another epoch / RESOURCE_EXHAUSTED (too slow) / stream error or end / no batch for stale_s:
        worker cache-unknown (its reported entries dropped) ──► back-off ──► a new session
    UNIMPLEMENTED (a worker that predates KVEvents): cache-blind, asked again every unsupported_retry_s

Subscribing before the snapshot means no event can fall between them: the snapshot reflects every event
up to its ``seq``, and the stream carries each one after (those at or below ``seq`` are skipped).
Discovery calls :meth:`KVSubscriptions.sync` after each round: a task starts for each listed worker and
stops, with the worker's entries dropped, when discovery no longer lists it. Each router replica
subscribes to every worker on its own.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import grpc

from services.proto_gen.pdserve.v1 import worker_pb2
from services.router.metrics import RouterMetrics
from services.router.pairing import Role
from services.router.prefix_index import BatchResult, CacheState, PrefixIndex

log = logging.getLogger(__name__)


class KVSource(Protocol):
    """The two RPCs a subscriber makes (``WorkerPool``'s)."""

    def kv_events(self, role: Role, address: str) -> grpc.aio.UnaryStreamCall: ...

    async def kv_snapshot(self, role: Role, address: str, timeout_s: float) -> worker_pb2.KVSnapshotResponse: ...


class _Resync(Exception):
    """A session ended and the worker must be resynced; ``reason`` is the metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


class KVSubscriptions:
    """A subscriber task per worker discovery lists, feeding one prefix index."""

    def __init__(self, index: PrefixIndex, source: KVSource, *, stale_s: float = 10.0,
                 snapshot_timeout_s: float = 10.0, backoff_s: float = 0.5, backoff_max_s: float = 10.0,
                 unsupported_retry_s: float = 60.0, metrics: RouterMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._index = index
        self._source = source
        self._stale_s = stale_s
        self._snapshot_timeout_s = snapshot_timeout_s
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._unsupported_retry_s = unsupported_retry_s
        self._metrics = metrics
        self._clock = clock
        self._tasks: dict[tuple[Role, str], asyncio.Task[None]] = {}

    @property
    def subscribed(self) -> list[tuple[Role, str]]:
        return list(self._tasks)

    def sync(self, workers: Iterable[tuple[Role, str]]) -> None:
        """Subscribe to each listed (role, address) not yet subscribed; stop and forget the others."""
        wanted = set(workers)
        for key in [k for k in self._tasks if k not in wanted]:
            self._tasks.pop(key).cancel()
            self._index.drop(key[1])
        for role, address in sorted(wanted - self._tasks.keys()):
            self._tasks[(role, address)] = asyncio.create_task(self._run(role, address),
                                                               name=f"pdserve-kv-events-{address}")
        self._index.expire(self._clock())

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- one worker --------------------------------------------------------------------------------

    async def _run(self, role: Role, address: str) -> None:
        """Sessions until cancelled; between two, the worker is cache-unknown and the task backs off (from the
        first wait again after a session that got as far as a snapshot)."""
        backoff_s = self._backoff_s
        last_reason = ""
        while True:
            synced: list[bool] = []
            try:
                await self._session(role, address, synced)
            except _Resync as exc:
                reason, detail = exc.reason, str(exc)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    if self._index.state(address) is not CacheState.UNSUPPORTED:
                        log.warning("%s worker %s predates KVEvents: routed without knowing its cache", role,
                                    address)
                    self._index.mark_unsupported(address)
                    await asyncio.sleep(self._unsupported_retry_s)
                    continue
                reason = "resource_exhausted" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "stream_error"
                detail = f"{exc.code().name}: {exc.details()}"
            self._index.mark_unknown(address)
            if self._metrics is not None:
                self._metrics.kv_resyncs.labels(reason).inc()
            if synced:
                backoff_s = self._backoff_s
            log.log(logging.INFO if reason == last_reason else logging.WARNING,
                    "%s worker %s KV events: %s (%s); cache unknown, resubscribing in %.1f s", role, address, reason,
                    detail, backoff_s)
            last_reason = reason
            await asyncio.sleep(backoff_s * random.uniform(0.8, 1.2))
            backoff_s = min(backoff_s * 2, self._backoff_max_s)

    async def _session(self, role: Role, address: str, synced: list[bool]) -> None:
        """Subscribe, snapshot, apply batches until something breaks (raised); ``synced`` gets an entry once
        the snapshot is loaded."""
        call = self._source.kv_events(role, address)
        try:
            batch = await self._read(call)  # proves the subscription is live before the snapshot is taken
            snapshot = await self._source.kv_snapshot(role, address, self._snapshot_timeout_s)
            self._index.load_snapshot(address, snapshot, self._clock())
            synced.append(True)
            log.info("%s worker %s KV index synced: engine %s epoch %d at event %d", role, address,
                     snapshot.engine_id, snapshot.epoch, snapshot.seq)
            while True:
                self._apply(address, batch)
                batch = await self._read(call)
        finally:
            call.cancel()

    async def _read(self, call: grpc.aio.UnaryStreamCall) -> worker_pb2.KVEventBatch:
        try:
            batch = await asyncio.wait_for(call.read(), self._stale_s)
        except TimeoutError:
            raise _Resync("stale", f"no batch within {self._stale_s:g} s") from None
        if batch is grpc.aio.EOF:
            raise _Resync("stream_ended", "the worker ended the stream")
        return batch

    def _apply(self, address: str, batch: worker_pb2.KVEventBatch) -> None:
        result = self._index.apply_batch(address, batch, self._clock())
        if result is BatchResult.GAP:
            raise _Resync("gap", f"batch starts at event {batch.first_seq}, a number was skipped")
        if result is BatchResult.EPOCH_CHANGED:
            raise _Resync("epoch_changed", f"engine {batch.engine_id} epoch {batch.epoch} answers now")
        if result is BatchResult.NOT_SYNCED:  # cannot happen after a snapshot; resync rather than guess
            raise _Resync("stream_error", "batch for a worker without a snapshot")
        if self._metrics is not None:
            self._metrics.kv_event_batches.inc()
            self._metrics.kv_events.inc(len(batch.events))
