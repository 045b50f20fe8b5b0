"""The KV event subscriber against a real grpc.aio server that serves scripted batches and snapshots."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
import pytest

from services.contract.prefix_keys import cache_salt_for, hash_request_blocks
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.router.kv_subscriber import KVSubscriptions
from services.router.metrics import RouterMetrics
from services.router.pairing import PairingPolicy, Role
from services.router.prefix_index import CacheState, PrefixIndex, PromptKeys
from services.router.workers import WorkerPool

pytestmark = pytest.mark.anyio

SALT = cache_salt_for("h1")
PROMPT = list(range(50, 83))  # 33 tokens: 8 blocks of 4
KEYS = hash_request_blocks(PROMPT, 4, SALT)
Item = worker_pb2.KVEventBatch | grpc.StatusCode


def stored(keys: list[bytes]) -> worker_pb2.KVCacheEvent:
    return worker_pb2.KVCacheEvent(kind=worker_pb2.KVCacheEvent.STORED, group_id=0, block_size=4, block_keys=keys)


def batch(first_seq: int, *events: worker_pb2.KVCacheEvent, epoch: int = 1) -> worker_pb2.KVEventBatch:
    return worker_pb2.KVEventBatch(engine_id="e1", epoch=epoch, first_seq=first_seq, events=events,
                                   load=worker_pb2.WorkerLoad(num_running=2, prefill_tokens_per_s=900.0))


def snapshot(seq: int, keys: list[bytes], epoch: int = 1) -> worker_pb2.KVSnapshotResponse:
    return worker_pb2.KVSnapshotResponse(engine_id="e1", epoch=epoch, seq=seq, stored=[stored(keys)])


class ScriptedKV(worker_pb2_grpc.PrefillWorkerServicer):
    """Session ``i`` of ``KVEvents`` serves ``sessions[i]`` (a status code ends it with that error), then stays
    open; snapshot call ``i`` answers ``snapshots[i]`` (the last ones repeat)."""

    def __init__(self, sessions: list[list[Item]], snapshots: list[worker_pb2.KVSnapshotResponse]) -> None:
        self.sessions = sessions
        self.snapshots = snapshots
        self.num_subscribed = 0
        self.num_snapshots = 0

    async def KVEvents(self, request, context):  # noqa: N802
        script = self.sessions[min(self.num_subscribed, len(self.sessions) - 1)]
        self.num_subscribed += 1
        for item in script:
            if isinstance(item, grpc.StatusCode):
                await context.abort(item, "scripted")
            yield item
        await asyncio.Event().wait()

    async def KVSnapshot(self, request, context):  # noqa: N802
        answer = self.snapshots[min(self.num_snapshots, len(self.snapshots) - 1)]
        self.num_snapshots += 1
        return answer


class Unimplemented(worker_pb2_grpc.PrefillWorkerServicer):
    """A worker that predates KVEvents (the generated base answers UNIMPLEMENTED)."""


@asynccontextmanager
async def serving(servicer: worker_pb2_grpc.PrefillWorkerServicer,
                  **options) -> AsyncIterator[tuple[str, PrefixIndex, KVSubscriptions, RouterMetrics]]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    index = PrefixIndex()
    pool = WorkerPool()
    metrics = RouterMetrics(PairingPolicy(), index=index)
    subscriptions = KVSubscriptions(index, pool, backoff_s=0.01, backoff_max_s=0.05, metrics=metrics,
                                    **{"stale_s": 5.0, **options})
    try:
        subscriptions.sync([(Role.PREFILL, address)])
        yield address, index, subscriptions, metrics
    finally:
        await subscriptions.close()
        await pool.close_all()
        await server.stop(0)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def cached(index: PrefixIndex, address: str) -> int:
    return index.lookup(address, 1, SALT, PromptKeys(PROMPT), None, 0.0).device_tokens


def resyncs(metrics: RouterMetrics, reason: str) -> float:
    return metrics.kv_resyncs.labels(reason)._value.get()


async def test_subscribes_snapshots_and_applies_events_after_the_snapshot() -> None:
    # The snapshot already reflects event 1; the stream repeats it, then adds event 2.
    kv = ScriptedKV([[batch(1), batch(1, stored(KEYS[:2])), batch(2, stored(KEYS[2:5]))]], [snapshot(1, KEYS[:2])])
    async with serving(kv) as (address, index, _, metrics):
        await until(lambda: cached(index, address) == 20)
        assert index.state(address) is CacheState.SYNCED
        assert index.load(address, 1).prefill_tokens_per_s == 900.0
        assert metrics.kv_event_batches._value.get() == 3
        assert b"pdserve_router_kv_index_workers{state=\"synced\"} 1.0" in metrics.render()


async def test_a_gap_resyncs_from_a_new_snapshot() -> None:
    kv = ScriptedKV([[batch(1), batch(1, stored(KEYS[:2])), batch(4, stored(KEYS[2:6]))],  # 2 and 3 missing
                     [batch(5)]],
                    [snapshot(0, []), snapshot(4, KEYS[:7])])
    async with serving(kv) as (address, index, _, metrics):
        await until(lambda: cached(index, address) == 28)
        assert (kv.num_subscribed, kv.num_snapshots) == (2, 2) and resyncs(metrics, "gap") == 1


async def test_a_slow_subscribers_cut_off_stream_is_resubscribed() -> None:
    kv = ScriptedKV([[batch(1), grpc.StatusCode.RESOURCE_EXHAUSTED], [batch(3)]],
                    [snapshot(0, KEYS[:1]), snapshot(2, KEYS[:3])])
    async with serving(kv) as (address, index, _, metrics):
        await until(lambda: cached(index, address) == 12)
        assert resyncs(metrics, "resource_exhausted") == 1


async def test_a_silent_stream_is_stale_and_the_cache_unknown_meanwhile() -> None:
    kv = ScriptedKV([[batch(1)]], [snapshot(0, KEYS[:3])])
    async with serving(kv, stale_s=0.2) as (address, index, _, metrics):
        await until(lambda: resyncs(metrics, "stale") >= 1)
        await until(lambda: cached(index, address) == 12)  # resynced after it
        assert kv.num_subscribed >= 2


async def test_a_new_epoch_on_the_stream_drops_the_old_entries_and_resyncs() -> None:
    kv = ScriptedKV([[batch(1), batch(1, epoch=2)], [batch(1, epoch=2)]],
                    [snapshot(0, KEYS[:6]), snapshot(0, KEYS[:1], epoch=2)])
    async with serving(kv) as (address, index, _, metrics):
        await until(lambda: resyncs(metrics, "epoch_changed") == 1)
        await until(lambda: index.lookup(address, 2, SALT, PromptKeys(PROMPT), None, 0.0).device_tokens == 4)
        assert cached(index, address) == 0  # epoch 1's entries are gone


async def test_a_worker_without_kv_events_is_routed_cache_blind() -> None:
    async with serving(Unimplemented()) as (address, index, _, _metrics):
        await until(lambda: index.state(address) is CacheState.UNSUPPORTED)


async def test_a_worker_discovery_drops_loses_its_task_and_entries() -> None:
    kv = ScriptedKV([[batch(1)]], [snapshot(0, KEYS[:3])])
    async with serving(kv) as (address, index, subscriptions, _):
        await until(lambda: cached(index, address) == 12)
        subscriptions.sync([])
        assert subscriptions.subscribed == [] and index.addresses() == [] and cached(index, address) == 0
