"""The worker skeleton (services/worker/daemon.py) with a real engine, gRPC server and NIXL agent:
a background task that raises takes the worker down (health NOT_SERVING, a non-None failure), and
the teardown still runs, instead of the loop dying unnoticed while the worker looks healthy."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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
