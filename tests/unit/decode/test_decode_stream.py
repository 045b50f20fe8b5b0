"""The decode servicer's stream with a real engine: a caller that leaves while the ticket's first token
is out (before the engine's own stream began) aborts the request, so nothing runs on for nobody."""

from __future__ import annotations

import asyncio

from services.common.metrics import WorkerMetrics
from services.contract.sampling_params import SamplingParams
from services.decode.pull_policy import StartedRequest
from services.decode.server import DecodeServicer
from services.engine.async_engine import AsyncEngine
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine


def test_leaving_after_the_tickets_first_token_aborts_the_request() -> None:
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=64))

    async def run() -> tuple[int, bool]:
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            servicer = DecodeServicer(None, aengine, None, None, "decode-test", 0, WorkerMetrics("decode"))
            await aengine.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=10_000, temperature=0.0,
                                                                        ignore_eos=True))
            stream = servicer._stream("r", 4, StartedRequest(emit_first=(7,), recomputed_locally=True), 0.0)
            first = await anext(stream)
            await stream.aclose()  # the caller went away after the first chunk
            left = await aengine.call(lambda e: e.has_unfinished_requests())
            return list(first.token_ids), left
        finally:
            await aengine.stop()

    try:
        first, left = asyncio.run(run())
    finally:
        engine.close()
    assert first == [7]
    assert not left, "the request kept running after its caller left"
