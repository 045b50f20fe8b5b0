"""Prefill and decode daemons as real processes: Prefill -> ticket -> Generate streams the rest.

Greedy tokens must equal the same engine run colocated; a prefill worker killed between its answer
and the pull must not lose the request; every pinned block is freed once the decode side pulled.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.contract.sampling_params import SamplingParams
from services.contract.wire import sampling_to_proto
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.launch.spawn import daemons, start_daemon, stop_daemon
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import make_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Prefill and decode deliberately differ in KV layout and block size: both are reconciled.
PREFILL_ARGS = ("--kv-layout", "cross_layer", "--block-size", "4", "--num-kv-blocks", "256", "--kv-lease-s", "60")
DECODE_ARGS = ("--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "128")


def _prompts() -> list[list[int]]:
    base = [(11 * i + 5) % 300 + 3 for i in range(40)]
    return [base[:n] + [7 + k] * (k % 3) for k, n in enumerate((9, 17, 23, 33, 40, 40, 12, 28))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("ckpt"))
    return str(directory)


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> dict[tuple[int, ...], list[int]]:
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", dtype="float32", num_kv_blocks=256))
    prompts = _prompts()
    return {tuple(p): o.token_ids for p, o in zip(prompts, engine.generate(prompts, GREEDY), strict=True)}


async def _disaggregated(prefill_addr: str, decode_addr: str, rid: str, prompt: list[int],
                         params: SamplingParams = GREEDY, kill_prefill=None) -> tuple[list[int], list]:
    async with grpc.aio.insecure_channel(prefill_addr) as pc, grpc.aio.insecure_channel(decode_addr) as dc:
        first = await worker_pb2_grpc.PrefillWorkerStub(pc).Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(params), reader_tp_size=1))
        assert first.HasField("ticket") and not first.finished
        if kill_prefill is not None:
            kill_prefill()
        chunks = []
        async for chunk in worker_pb2_grpc.DecodeWorkerStub(dc).Generate(worker_pb2.GenerateRequest(
                request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(params), ticket=first.ticket)):
            chunks.append(chunk)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens[0] == first.first_token_id
    assert chunks[-1].finished
    return tokens, chunks


async def _info(address: str, role: str) -> worker_pb2.WorkerInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(ch)
        return await stub.Info(worker_pb2.InfoRequest())


def _wait_unpinned(address: str, timeout_s: float = 10.0) -> worker_pb2.WorkerInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        info = asyncio.run(_info(address, "prefill"))
        if info.kv_blocks_pinned == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def test_disaggregated_tokens_equal_colocated(checkpoint: str, reference) -> None:
    with daemons(("prefill", checkpoint, PREFILL_ARGS), ("decode", checkpoint, DECODE_ARGS)) as (p, d):
        pinfo, dinfo = asyncio.run(_info(p.address, "prefill")), asyncio.run(_info(d.address, "decode"))
        assert pinfo.compat_hash == dinfo.compat_hash and (pinfo.block_size, dinfo.block_size) == (4, 8)

        async def run_all():
            return await asyncio.gather(*[
                _disaggregated(p.address, d.address, f"req-{i}", prompt) for i, prompt in enumerate(_prompts())
            ])

        results = asyncio.run(run_all())  # eight requests at once, several sharing prefixes
        for prompt, (tokens, chunks) in zip(_prompts(), results, strict=True):
            assert tokens == reference[tuple(prompt)]
            assert not any(c.recomputed_locally for c in chunks)
        assert _wait_unpinned(p.address).kv_blocks_pinned == 0  # every reader notified: all unpinned

        # A request without a ticket is prefilled by the decode worker itself.
        async def direct():
            async with grpc.aio.insecure_channel(d.address) as dc:
                prompt = _prompts()[3]
                stream = worker_pb2_grpc.DecodeWorkerStub(dc).Generate(worker_pb2.GenerateRequest(
                    request_id="direct", prompt_token_ids=prompt, params=sampling_to_proto(GREEDY)))
                return prompt, [t async for c in stream for t in c.token_ids]

        prompt, tokens = asyncio.run(direct())
        assert tokens == reference[tuple(prompt)]


def test_prefill_killed_before_the_pull_recomputes_locally(checkpoint: str, reference) -> None:
    prefill = start_daemon("prefill", checkpoint, *PREFILL_ARGS)
    try:
        with daemons(("decode", checkpoint, DECODE_ARGS)) as (d,):
            prompt = _prompts()[4]
            tokens, chunks = asyncio.run(_disaggregated(prefill.address, d.address, "orphan", prompt,
                                                        kill_prefill=prefill.kill))
            assert tokens == reference[tuple(prompt)]
            assert chunks[0].recomputed_locally
    finally:
        stop_daemon(prefill)


def test_bad_requests_are_refused_and_change_nothing(checkpoint: str, reference) -> None:
    with daemons(("prefill", checkpoint, PREFILL_ARGS), ("decode", checkpoint, DECODE_ARGS)) as (p, d):
        async def bad():
            async with grpc.aio.insecure_channel(p.address) as pc, grpc.aio.insecure_channel(d.address) as dc:
                prefill, decode = worker_pb2_grpc.PrefillWorkerStub(pc), worker_pb2_grpc.DecodeWorkerStub(dc)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await prefill.Prefill(worker_pb2.PrefillRequest(
                        request_id="x", prompt_token_ids=[5, 6], params=worker_pb2.SamplingParams(max_tokens=0)))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await prefill.Prefill(worker_pb2.PrefillRequest(
                        request_id="y", prompt_token_ids=[], params=sampling_to_proto(GREEDY)))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in e.value.details()
                # A forged ticket (block ids far outside the prefill worker's pool) is never read:
                # the decode worker refuses it and prefills the prompt itself.
                first = await prefill.Prefill(worker_pb2.PrefillRequest(
                    request_id="f", prompt_token_ids=_prompts()[1], params=sampling_to_proto(GREEDY)))
                forged = worker_pb2.GenerateRequest(request_id="f", prompt_token_ids=_prompts()[1],
                                                    params=sampling_to_proto(GREEDY), ticket=first.ticket)
                forged.ticket.groups[0].block_ids[0] = 1 << 30
                chunks = [c async for c in decode.Generate(forged)]
                await prefill.Release(worker_pb2.ReleaseRequest(request_id="f"))
                return chunks

        chunks = asyncio.run(bad())
        assert chunks[0].recomputed_locally
        assert [t for c in chunks for t in c.token_ids] == reference[tuple(_prompts()[1])]
        info = _wait_unpinned(p.address)
        assert info.kv_blocks_pinned == 0 and info.num_running == 0 and info.num_waiting == 0


def test_sigterm_drains_in_flight_work_and_serves_late_generates(checkpoint: str, reference) -> None:
    """SIGTERM drains the decode role as a role switch does (tests/e2e/test_drain.py has the migration past the
    bound): NOT_SERVING at once, yet a Generate a router sends before it noticed is still served."""
    decode = start_daemon("decode", checkpoint, *DECODE_ARGS)
    try:
        prompt = _prompts()[2]
        long_params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

        async def drain_during_stream():
            async with grpc.aio.insecure_channel(decode.address) as ch:
                stub = worker_pb2_grpc.DecodeWorkerStub(ch)
                stream = stub.Generate(worker_pb2.GenerateRequest(
                    request_id="long", prompt_token_ids=prompt, params=sampling_to_proto(long_params)))
                tokens = []
                async for chunk in stream:
                    tokens += chunk.token_ids
                    if len(tokens) == 3:
                        decode.proc.send_signal(signal.SIGTERM)
                        await asyncio.sleep(0.3)
                        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                        late = [t async for c in stub.Generate(worker_pb2.GenerateRequest(
                            request_id="late", prompt_token_ids=prompt, params=sampling_to_proto(GREEDY)))
                            for t in c.token_ids]
                        assert late == reference[tuple(prompt)]  # a late request is served, not refused...
                return tokens  # ...and the one in flight runs to its end

        tokens = asyncio.run(drain_during_stream())
        assert len(tokens) == 300 and tokens[:12] == reference[tuple(prompt)]
        assert decode.proc.wait(timeout=30) == 0
    finally:
        stop_daemon(decode)


def test_unpulled_kv_is_freed_when_its_lease_expires(checkpoint: str) -> None:
    args = [a for a in PREFILL_ARGS if a not in ("--kv-lease-s", "60")] + ["--kv-lease-s", "1"]
    with daemons(("prefill", checkpoint, tuple(args))) as (p,):
        async def prefill_only():
            async with grpc.aio.insecure_channel(p.address) as ch:
                return await worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
                    request_id="never-pulled", prompt_token_ids=_prompts()[3], params=sampling_to_proto(GREEDY)))

        first = asyncio.run(prefill_only())
        assert first.HasField("ticket")
        assert asyncio.run(_info(p.address, "prefill")).kv_blocks_pinned > 0
        assert _wait_unpinned(p.address, timeout_s=10).kv_blocks_pinned == 0  # nobody pulled: the lease freed it
        metrics = httpx.get(f"http://127.0.0.1:{p.metrics_port}/metrics", timeout=10).text
        assert 'pdserve_kv_lease_expiries_total{role="prefill"} 1.0' in metrics
