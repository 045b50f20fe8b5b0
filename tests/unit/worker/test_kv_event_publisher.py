"""The worker's KV event publisher (services/worker/kv_events.py) over a bare event log (no engine, no torch):
on only while subscribed, batching, the bound on a slow subscriber, gaps, heartbeats, the clean end."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.common.metrics import WorkerMetrics
from services.engine.async_engine import EngineStats
from services.engine.kv_cache.events import KVEventLog, KVTier
from services.worker.kv_events import KVEventPublisher, Subscriber, _End

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


STATS = EngineStats(num_running=1, num_waiting=2, num_waiting_for_kv=0, num_held=0, kv_blocks_total=64,
                    kv_blocks_free=40, kv_blocks_held=0, waiting_prefill_tokens=300, prefill_tokens_per_s=1234.5)


def _publisher(log: KVEventLog | None = None, **kw) -> tuple[KVEventPublisher, KVEventLog, WorkerMetrics]:
    log = log or KVEventLog()
    metrics = WorkerMetrics("prefill")
    aengine = SimpleNamespace(engine=SimpleNamespace(kv_events=log), stats=STATS)
    return KVEventPublisher(aengine, "prefill@x", 77, metrics, **kw), log, metrics


def _store(log: KVEventLog, *keys: bytes, group: int = 0) -> None:
    pool = log.pool(group, KVTier.DEVICE, 4)
    for key in keys:
        if log.enabled:
            pool.stored(key)
    log.seal()


def _drain(sub: Subscriber) -> list:
    items = []
    while not sub.queue.empty():
        items.append(sub.queue.get_nowait())
    return items


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


async def test_events_are_on_only_while_someone_subscribes_and_the_first_message_is_a_heartbeat():
    publisher, log, metrics = _publisher()
    _store(log, _key(0))
    assert not log.enabled and log.last_seq == 0  # nobody listens: nothing is recorded
    sub = publisher.subscribe()
    assert log.enabled and metrics.kv_event_subscribers.labels("prefill")._value.get() == 1
    (hello,) = _drain(sub)
    assert (hello.engine_id, hello.epoch, hello.first_seq, len(hello.events)) == ("prefill@x", 77, 1, 0)
    assert (hello.load.waiting_prefill_tokens, hello.load.kv_blocks_free, hello.load.prefill_tokens_per_s) == \
        (300, 40, 1234.5)
    _store(log, _key(1), _key(2))
    publisher.publish()
    (batch,) = _drain(sub)
    assert batch.first_seq == 1 and [list(e.block_keys) for e in batch.events] == [[_key(1), _key(2)]]
    assert batch.events[0].tier == KVTier.DEVICE and batch.events[0].block_size == 4
    assert metrics.kv_events.labels("prefill", "stored")._value.get() == 1
    publisher.unsubscribe(sub)
    assert not log.enabled and metrics.kv_event_subscribers.labels("prefill")._value.get() == 0


async def test_events_are_batched_whole_up_to_the_key_bound():
    publisher, log, _ = _publisher(max_batch_keys=3)
    sub = publisher.subscribe()
    _drain(sub)
    for group in range(4):  # four events of two keys each, one engine iteration each
        _store(log, _key(2 * group), _key(2 * group + 1), group=group)
    publisher.publish()
    batches = _drain(sub)
    assert [(b.first_seq, len(b.events)) for b in batches] == [(1, 2), (3, 2)]
    assert [e.group_id for b in batches for e in b.events] == [0, 1, 2, 3]


async def test_a_late_subscriber_starts_at_the_next_number_and_sees_the_same_stream():
    publisher, log, _ = _publisher()
    first = publisher.subscribe()
    _store(log, _key(1))
    publisher.publish()
    second = publisher.subscribe()
    assert _drain(second)[0].first_seq == 2  # its first message names the next number
    _store(log, _key(2))
    publisher.publish()
    assert [b.first_seq for b in _drain(first)] == [1, 1, 2]
    assert [b.first_seq for b in _drain(second)] == [2]


async def test_a_slow_subscriber_is_cut_off_and_the_others_go_on():
    publisher, log, metrics = _publisher(max_queue_batches=2)
    slow, fast = publisher.subscribe(), publisher.subscribe()  # one queued heartbeat each
    for i in range(3):
        _drain(fast)
        _store(log, _key(i))
        publisher.publish()
    assert slow.overflowed and isinstance(_drain(slow)[-1], _End)
    assert not fast.overflowed and publisher.num_subscribers == 1
    assert metrics.kv_event_streams_dropped.labels("prefill", "slow_subscriber")._value.get() == 1


async def test_events_dropped_at_the_engine_show_as_a_gap():
    publisher, log, metrics = _publisher(KVEventLog(max_outbound_keys=2))
    sub = publisher.subscribe()
    _drain(sub)
    _store(log, _key(1))  # seq 1
    _store(log, _key(2), _key(3))  # seq 2: 3 keys would be queued, over the bound: dropped
    publisher.publish()
    _store(log, _key(4))  # seq 3
    publisher.publish()
    assert [b.first_seq for b in _drain(sub)] == [1, 3]
    assert metrics.kv_events_dropped.labels("prefill")._value.get() == 1


async def test_heartbeats_while_idle_and_a_clean_end_on_stop():
    publisher, log, _ = _publisher(interval_s=0.01, heartbeat_s=0.05)
    stop = asyncio.Event()
    runner = asyncio.create_task(publisher.run(stop))
    sub = publisher.subscribe()
    await asyncio.sleep(0.3)
    beats = _drain(sub)
    assert len(beats) >= 3 and all(not b.events and b.first_seq == 1 for b in beats)
    stop.set()
    await asyncio.wait_for(runner, 5)
    assert isinstance(await sub.queue.get(), _End) and not sub.overflowed
    assert not log.enabled
    with pytest.raises(RuntimeError, match="stopping"):
        publisher.subscribe()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="interval_s"):
        _publisher(interval_s=0)


async def test_a_new_epoch_ends_every_stream_and_numbers_its_events_from_one():
    """A role switch (``restart``): subscribers see their stream end, resubscribe, and the new epoch's batches
    and snapshots start at 1 while the engine's own numbering goes on."""
    publisher, log, _ = _publisher()
    sub = publisher.subscribe()
    _store(log, _key(0), _key(1))
    publisher.publish()
    assert log.last_seq >= 1  # the old epoch's numbers
    publisher.restart(78)
    assert isinstance(_drain(sub)[-1], _End) and publisher.num_subscribers == 0 and not log.enabled
    again = publisher.subscribe()
    (hello,) = _drain(again)
    assert (hello.epoch, hello.first_seq) == (78, 1)
    _store(log, _key(2))
    publisher.publish()
    (batch,) = _drain(again)
    assert (batch.epoch, batch.first_seq, len(batch.events)) == (78, 1, 1)
