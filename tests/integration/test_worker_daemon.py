"""The worker skeleton (services/worker/daemon.py) with a real engine, gRPC server and NIXL agent:
a background task that raises, or an engine thread that died, takes the worker down (serve() returns
its failure, so the daemon exits non-zero), instead of the worker looking healthy while it cannot
free leases or run a step."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.worker.config import WorkerConfig
from services.worker.daemon import Role, WorkerContext, serve


def _run_worker(role: Role, break_it, capsys) -> str | None:
    """Serve a dummy engine under ``role``, break it with ``break_it(engine, context)`` once it serves,
    and return the failure serve() ends with (it must end within 30 s)."""
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=16))
    contexts: list[WorkerContext] = []
    attach = role.attach
    role = dataclasses.replace(role, attach=lambda context: contexts.append(context) or attach(context))

    async def run() -> str | None:
        serving = asyncio.create_task(serve(WorkerConfig(), engine, role))
        while '"ready": true' not in capsys.readouterr().out:  # serve() prints its ready line once serving
            assert not serving.done(), "serve() returned before it was ready"
            await asyncio.sleep(0.02)
        await break_it(engine, contexts[0])
        return await asyncio.wait_for(serving, timeout=30)

    try:
        return asyncio.run(run())
    finally:
        engine.close()


def test_a_failed_background_task_takes_the_worker_down(capsys) -> None:
    started = asyncio.Event()

    async def failing_loop(stop: asyncio.Event) -> None:
        await started.wait()
        raise RuntimeError("lease loop broke")

    async def break_it(engine: LLMEngine, context: WorkerContext) -> None:
        async with grpc.aio.insecure_channel(context.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = (await health.Check(health_pb2.HealthCheckRequest(service=""))).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        started.set()

    role = Role("prefill", ("pdserve.v1.PrefillWorker",), lambda context: [failing_loop], stats_interval_s=0.05)
    failure = _run_worker(role, break_it, capsys)
    assert failure is not None and "lease loop broke" in failure


def test_an_engine_thread_that_died_takes_the_worker_down(capsys) -> None:
    def broken_step():
        raise RuntimeError("step broke")

    async def break_it(engine: LLMEngine, context: WorkerContext) -> None:
        engine.step = broken_step
        await context.aengine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))

    role = Role("decode", ("pdserve.v1.DecodeWorker",), lambda context: [], stats_interval_s=0.05)
    failure = _run_worker(role, break_it, capsys)
    assert failure is not None and "step broke" in failure
