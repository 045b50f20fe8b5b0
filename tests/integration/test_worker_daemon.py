"""The worker skeleton (services/worker/daemon.py) with a real engine, gRPC server and NIXL agent:
a background task that raises, or an engine thread that died, takes the worker down (serve() returns
its failure, so the daemon exits non-zero), instead of the worker looking healthy while it cannot
free leases or run a step."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.worker.config import WorkerConfig
from services.worker.daemon import Role, WorkerContext, serve


def test_a_failed_background_task_takes_the_worker_down(capsys) -> None:
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=16))
    started = asyncio.Event()
    seen: dict[str, object] = {}

    async def failing_loop(stop: asyncio.Event) -> None:
        await started.wait()
        raise RuntimeError("lease loop broke")

    def attach(context: WorkerContext) -> list:
        seen["context"] = context
        return [failing_loop]

    role = Role("prefill", ("pdserve.v1.PrefillWorker",), attach, stats_interval_s=0.05)

    async def run() -> str | None:
        serving = asyncio.create_task(serve(WorkerConfig(), engine, role))
        while '"ready": true' not in capsys.readouterr().out:  # serve() prints its ready line once serving
            assert not serving.done(), "serve() returned before it was ready"
            await asyncio.sleep(0.02)
        address = seen["context"].address
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = (await health.Check(health_pb2.HealthCheckRequest(service=""))).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        started.set()
        return await asyncio.wait_for(serving, timeout=30)

    try:
        failure = asyncio.run(run())
    finally:
        engine.close()
    assert failure is not None and "lease loop broke" in failure


def test_an_engine_thread_that_died_takes_the_worker_down(capsys) -> None:
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=16))
    contexts: list[WorkerContext] = []
    role = Role("decode", ("pdserve.v1.DecodeWorker",), lambda context: contexts.append(context) or [],
                stats_interval_s=0.05)

    def broken_step():
        raise RuntimeError("step broke")

    async def run() -> str | None:
        serving = asyncio.create_task(serve(WorkerConfig(), engine, role))
        while '"ready": true' not in capsys.readouterr().out:
            assert not serving.done(), "serve() returned before it was ready"
            await asyncio.sleep(0.02)
        engine.step = broken_step
        await contexts[0].aengine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        return await asyncio.wait_for(serving, timeout=30)

    try:
        failure = asyncio.run(run())
    finally:
        engine.close()
    assert failure is not None and "step broke" in failure
