"""KV events out of a worker: the engine's prefix-cache changes, batched, to every subscriber (a router's index).

Both daemons serve ``KVEvents`` (a stream of ``KVEventBatch``) and ``KVSnapshot`` through
``KVEventsRPCs``; one ``KVEventPublisher`` per daemon does the work::

    engine thread: pools record -> KVEventLog.seal() each loop iteration (numbered, bounded)
    publisher.run (every interval_s): log.take() -> batches of <= max_batch_keys keys, each with the
        load -> every subscriber's queue (bounded: one that is full is cut off, RESOURCE_EXHAUSTED)
    idle for heartbeat_s: a batch with only the load (first_seq: the next number)

A subscriber's first message is sent at once: a heartbeat whose ``first_seq`` is the first number
its stream will carry. A router subscribes, waits for that message, then asks ``KVSnapshot``: the
snapshot reflects every event up to its ``seq``, so it applies the stream's events after ``seq``;
any other jump in the numbers (events dropped at the engine, see ``kv_cache/events.py``) means
resync. The engine records events only while at least one subscriber is connected.

A role switch gives the worker a new epoch (:meth:`KVEventPublisher.restart`): every stream ends, and the
numbering starts from 1 again for the new epoch (the engine's own numbers continue; the publisher subtracts
where the epoch began), so a subscriber resubscribes and snapshots as it does for a restarted worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

import grpc

from services.common.metrics import KV_EVENT_KINDS, WorkerMetrics
from services.engine.async_engine import AsyncEngine, EngineStats
from services.engine.kv_cache.events import KVCacheContents, KVEvent, KVEventKind
from services.proto_gen.pdserve.v1 import worker_pb2

log = logging.getLogger(__name__)

BATCH_INTERVAL_S = 0.02
HEARTBEAT_S = 1.0
MAX_BATCH_KEYS = 4096  # a batch closes after the event that reaches it (events are never split)
SUBSCRIBER_QUEUE_BATCHES = 256  # a subscriber this far behind is cut off


def load_to_proto(stats: EngineStats) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(
        num_running=stats.num_running, num_waiting=stats.num_waiting,
        waiting_prefill_tokens=stats.waiting_prefill_tokens, kv_blocks_free=stats.kv_blocks_free,
        kv_blocks_total=stats.kv_blocks_total, prefill_tokens_per_s=stats.prefill_tokens_per_s)


def event_to_proto(kind: KVEventKind, group_id: int, tier: int, block_size: int,
                   keys: Sequence[bytes]) -> worker_pb2.KVCacheEvent:
    return worker_pb2.KVCacheEvent(kind=int(kind), group_id=group_id, tier=int(tier), block_size=block_size,
                                   block_keys=keys)


def _batches(events: list[KVEvent], max_keys: int) -> list[list[KVEvent]]:
    """Consecutive runs of whole events, each closed once it holds ``max_keys`` keys."""
    batches: list[list[KVEvent]] = [[]]
    num_keys = 0
    for event in events:
        if num_keys >= max_keys:
            batches.append([])
            num_keys = 0
        batches[-1].append(event)
        num_keys += len(event.block_keys)
    return batches


class _End:
    """Put in a subscriber's queue: its stream ends (``overflowed``: with RESOURCE_EXHAUSTED)."""


_END = _End()


class Subscriber:
    """One ``KVEvents`` stream: a bounded queue of batches the publisher fills."""

    def __init__(self, max_batches: int) -> None:
        self.queue: asyncio.Queue[worker_pb2.KVEventBatch | _End] = asyncio.Queue(max_batches + 1)
        self.max_batches = max_batches
        self.overflowed = False

    def offer(self, batch: worker_pb2.KVEventBatch) -> bool:
        """Queue a batch; False (and the stream is ended) when the subscriber is ``max_batches`` behind."""
        if self.queue.qsize() >= self.max_batches:
            self.overflowed = True
            self.end()
            return False
        self.queue.put_nowait(batch)
        return True

    def end(self) -> None:
        """End the stream after nothing more: what is queued is dropped."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(_END)


class KVEventPublisher:
    """Drains the engine's KV events and fans them out; records only while someone subscribes."""

    def __init__(self, aengine: AsyncEngine, engine_id: str, epoch: int, metrics: WorkerMetrics, *,
                 interval_s: float = BATCH_INTERVAL_S, heartbeat_s: float = HEARTBEAT_S,
                 max_batch_keys: int = MAX_BATCH_KEYS, max_queue_batches: int = SUBSCRIBER_QUEUE_BATCHES) -> None:
        if interval_s <= 0 or heartbeat_s <= 0 or max_batch_keys < 1 or max_queue_batches < 1:
            raise ValueError("interval_s and heartbeat_s must be > 0, max_batch_keys and max_queue_batches >= 1")
        self.aengine = aengine
        self.log = aengine.engine.kv_events
        self.engine_id = engine_id
        self.epoch = epoch
        self.metrics = metrics
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.max_batch_keys = max_batch_keys
        self.max_queue_batches = max_queue_batches
        self._subscribers: list[Subscriber] = []
        self._someone = asyncio.Event()  # set while there are subscribers: run() idles without
        self._next_seq = 1  # the engine's number of the next event to publish
        self._base_seq = 0  # the engine's last number before this epoch: published numbers are relative to it
        self._last_sent = time.monotonic()
        self._num_dropped = 0  # the engine log's drops already counted
        self.closed = False

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    # ---- subscribers ---------------------------------------------------------------------------
    def subscribe(self) -> Subscriber:
        """A new stream; its first batch (a heartbeat naming the next number) is queued at once."""
        if self.closed:
            raise RuntimeError("the worker is stopping")
        if not self._subscribers:
            self.log.enabled = True  # before reading the numbering: any event after it is delivered
            self._next_seq = max(self._next_seq, self.log.last_seq + 1)
            self._someone.set()
        sub = Subscriber(self.max_queue_batches)
        sub.offer(self._batch([]))
        self._subscribers.append(sub)
        self._count_subscribers()
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        if sub in self._subscribers:
            self._subscribers.remove(sub)
            self._count_subscribers()
        if not self._subscribers:
            self.log.enabled = False
            self._someone.clear()

    def _count_subscribers(self) -> None:
        self.metrics.kv_event_subscribers.labels(self.metrics.role).set(len(self._subscribers))

    def restart(self, epoch: int) -> None:
        """A new epoch (a role switch): end every stream, number the new epoch's events from 1."""
        for sub in list(self._subscribers):
            sub.end()
            self.unsubscribe(sub)
        self.epoch = epoch
        self._base_seq = max(self.log.last_seq, self._next_seq - 1)
        self._next_seq = self._base_seq + 1

    def close(self) -> None:
        """The worker stops: every stream ends cleanly (OK), later subscriptions are refused."""
        self.closed = True
        for sub in list(self._subscribers):
            sub.end()
            self.unsubscribe(sub)

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Every ``interval_s`` while someone subscribes: publish the sealed events, or a heartbeat."""
        while not stop.is_set():
            if not self._someone.is_set():
                await _first_of(self._someone.wait(), stop.wait())
                continue
            self.publish()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
        self.close()

    def publish(self) -> None:
        """One tick: the events sealed since the last, in batches; a heartbeat when idle long enough."""
        events = [e for e in self.log.take() if e.seq >= self._next_seq]
        self._count_dropped()
        if not events:
            if self._subscribers and time.monotonic() - self._last_sent >= self.heartbeat_s:
                self._fan_out(self._batch([]))
            return
        for chunk in _batches(events, self.max_batch_keys):
            self._fan_out(self._batch(chunk))
            for event in chunk:
                self.metrics.kv_events.labels(self.metrics.role, KV_EVENT_KINDS[event.kind]).inc()
        self._next_seq = events[-1].seq + 1

    def _count_dropped(self) -> None:
        dropped = self.log.num_dropped - self._num_dropped
        if dropped > 0:
            self.metrics.kv_events_dropped.labels(self.metrics.role).inc(dropped)
            self._num_dropped = self.log.num_dropped

    def _batch(self, events: list[KVEvent]) -> worker_pb2.KVEventBatch:
        return worker_pb2.KVEventBatch(
            engine_id=self.engine_id, epoch=self.epoch,
            first_seq=(events[0].seq if events else self._next_seq) - self._base_seq,
            events=[event_to_proto(e.kind, e.group_id, e.tier, e.block_size, e.block_keys) for e in events],
            load=load_to_proto(self.aengine.stats))

    def _fan_out(self, batch: worker_pb2.KVEventBatch) -> None:
        self._last_sent = time.monotonic()
        for sub in list(self._subscribers):
            if not sub.offer(batch):
                log.warning("a KV event subscriber fell %d batches behind: its stream is ended", sub.max_batches)
                self.metrics.kv_event_streams_dropped.labels(self.metrics.role, "slow_subscriber").inc()
                self.unsubscribe(sub)

    # ---- snapshot ------------------------------------------------------------------------------
    async def snapshot(self) -> worker_pb2.KVSnapshotResponse:
        """Every key cached now (taken on the engine thread) and the last event number it reflects."""
        seq, contents = await self.aengine.kv_snapshot()
        return worker_pb2.KVSnapshotResponse(engine_id=self.engine_id, epoch=self.epoch,
                                             seq=max(seq - self._base_seq, 0),
                                             stored=[_stored(c) for c in contents],
                                             load=load_to_proto(self.aengine.stats))


def _stored(contents: KVCacheContents) -> worker_pb2.KVCacheEvent:
    return event_to_proto(KVEventKind.STORED, contents.group_id, contents.tier, contents.block_size,
                          contents.block_keys)


async def _first_of(*waits: Coroutine[Any, Any, object]) -> None:
    """Wait until one of ``waits`` finishes; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


class KVEventsRPCs:
    """``KVEvents`` and ``KVSnapshot`` for either worker servicer (mixed in before the generated base)."""

    kv_events: KVEventPublisher | None = None  # None: answered UNIMPLEMENTED (a servicer built without one)

    async def KVEvents(self, request: worker_pb2.KVEventsRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.KVEventBatch]:
        if self.kv_events is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker publishes no KV events")
        try:
            sub = self.kv_events.subscribe()
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        try:
            while True:
                item = await sub.queue.get()
                if isinstance(item, _End):
                    break
                yield item
        finally:
            self.kv_events.unsubscribe(sub)
        if sub.overflowed:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the subscriber fell {sub.max_batches} KV event batches behind; resubscribe and "
                                "take a snapshot")

    async def KVSnapshot(self, request: worker_pb2.KVSnapshotRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> worker_pb2.KVSnapshotResponse:
        if self.kv_events is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker publishes no KV events")
        return await self.kv_events.snapshot()
