"""KV events from real worker daemons over real gRPC: the keys a router computes, the snapshot's number,
a clean end on SIGTERM, and a worker restarted in place (new epoch, numbering from 1)."""

from __future__ import annotations

import asyncio

import grpc

from services.contract.prefix_keys import cache_salt_for, hash_request_blocks
from services.contract.sampling_params import SamplingParams
from services.contract.wire import sampling_to_proto
from services.launch.spawn import daemons, start_daemon, stop_daemon
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import make_checkpoint

BLOCK = 4
ARGS = ("--block-size", str(BLOCK), "--num-kv-blocks", "128")
PROMPT = [(11 * i + 5) % 300 + 3 for i in range(30)]  # 7 full blocks
PARAMS = sampling_to_proto(SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
STORED = worker_pb2.KVCacheEvent.STORED


def _stub(channel: grpc.aio.Channel, role: str):
    return (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)


async def _stored_keys_after(address: str, role: str, run) -> tuple[worker_pb2.WorkerInfo, worker_pb2.KVEventBatch,
                                                                    list[bytes], worker_pb2.KVSnapshotResponse]:
    """Subscribe, wait for the first message, run a request, collect STORED device keys; then a snapshot."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = _stub(channel, role)
        info = await stub.Info(worker_pb2.InfoRequest())
        stream = stub.KVEvents(worker_pb2.KVEventsRequest())
        hello = await asyncio.wait_for(stream.read(), 10)
        await run(stub)
        want = len(PROMPT) // BLOCK
        keys: list[bytes] = []
        next_seq = hello.first_seq
        while len(keys) < want:
            batch = await asyncio.wait_for(stream.read(), 10)
            assert (batch.engine_id, batch.epoch) == (info.engine_id, info.epoch)
            assert batch.first_seq == next_seq  # no gap
            next_seq += len(batch.events)
            keys += [k for e in batch.events if e.kind == STORED and e.tier == worker_pb2.KV_TIER_DEVICE
                     for k in e.block_keys]
        snapshot = await stub.KVSnapshot(worker_pb2.KVSnapshotRequest())
        assert snapshot.seq >= next_seq - 1
        stream.cancel()
        return info, hello, keys, snapshot


def _expected(info: worker_pb2.WorkerInfo) -> list[bytes]:
    return hash_request_blocks(PROMPT, info.block_size, cache_salt_for(info.compat_hash))


async def _prefill(stub) -> None:
    response = await stub.Prefill(worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=PROMPT, params=PARAMS,
                                                            reader_tp_size=1))
    await stub.Release(worker_pb2.ReleaseRequest(request_id="r"))
    assert response.HasField("ticket")


async def _generate(stub) -> None:
    async for _ in stub.Generate(worker_pb2.GenerateRequest(request_id="g", prompt_token_ids=PROMPT, params=PARAMS)):
        pass


def test_workers_publish_the_routers_keys_and_a_restart_starts_a_new_epoch(tmp_path) -> None:
    checkpoint = str(make_checkpoint("llama", tmp_path)[0])
    with daemons(("prefill", checkpoint, ARGS), ("decode", checkpoint, ARGS)) as (p, d):
        info, hello, keys, snapshot = asyncio.run(_stored_keys_after(p.address, "prefill", _prefill))
        assert hello.first_seq == 1 and not hello.events and hello.load.kv_blocks_total > 0
        assert keys == _expected(info)
        (device,) = [c for c in snapshot.stored if c.tier == worker_pb2.KV_TIER_DEVICE]
        assert set(_expected(info)) <= set(device.block_keys) and device.block_size == BLOCK
        assert (snapshot.engine_id, snapshot.epoch) == (info.engine_id, info.epoch)

        dinfo, _, dkeys, _ = asyncio.run(_stored_keys_after(d.address, "decode", _generate))
        assert dkeys[:len(_expected(dinfo))] == _expected(dinfo)  # decode publishes too (its output blocks follow)
        assert dinfo.compat_hash == info.compat_hash and dkeys[0] == keys[0]  # same identity: same keys
        port = p.port

        async def ended_by_sigterm() -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(p.address) as channel:
                stream = _stub(channel, "prefill").KVEvents(worker_pb2.KVEventsRequest())
                await stream.read()
                assert await asyncio.to_thread(stop_daemon, p) == 0
                while await asyncio.wait_for(stream.read(), 10) is not grpc.aio.EOF:
                    pass
                return await stream.code()

        assert asyncio.run(ended_by_sigterm()) == grpc.StatusCode.OK  # the stream ended, not cut

    restarted = start_daemon("prefill", checkpoint, *ARGS, "--port", str(port))
    try:
        info2, hello2, keys2, snapshot2 = asyncio.run(_stored_keys_after(restarted.address, "prefill", _prefill))
        assert info2.epoch > info.epoch and hello2.epoch == info2.epoch
        assert hello2.first_seq == 1 and keys2 == keys  # numbering restarts; the keys are the model's
        assert snapshot2.seq < snapshot.seq + 50 and snapshot2.epoch == info2.epoch
    finally:
        stop_daemon(restarted)
