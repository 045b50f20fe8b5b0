"""AsyncEngine: the engine thread's outputs reach each request's stream in order."""

from __future__ import annotations

import asyncio

from services.contract.sampling_params import SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_first_token_of_external_kv_comes_first_and_aborts_free_everything() -> None:
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=64))

    async def main() -> tuple:
        aengine = AsyncEngine(engine)
        aengine.start()
        streams = []
        try:
            for i in range(20):  # the race this guards against was timing dependent
                rid = f"r{i}"
                request = await aengine.add_request_with_external_kv(rid, [5, 6, 7, 8, 9], PARAMS)
                assert request is not None
                await aengine.complete_external_kv(rid, 1234)
                streams.append([t async for out in aengine.outputs(rid) for t in out.new_token_ids])
            # A consumer that walks away aborts its request: nothing stays running or allocated.
            await aengine.add_request("walk-away", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
            async for _ in aengine.outputs("walk-away"):
                break
            await asyncio.sleep(0.2)
            return streams, await aengine.call(lambda e: (e.has_unfinished_requests(), e.kv_manager.pool(0)))
        finally:
            await aengine.stop()

    streams, (busy, pool) = asyncio.run(main())
    assert all(s[0] == 1234 and len(s) == 6 for s in streams)
    assert not busy and pool.num_free_blocks == pool.num_blocks


def _count_steps(engine: LLMEngine) -> list[int]:
    """Wrap ``engine.step`` so that ``steps[0]`` counts its calls."""
    steps = [0]
    step = engine.step

    def counting_step():
        steps[0] += 1
        return step()

    engine.step = counting_step
    return steps


def test_a_request_waiting_for_its_kv_leaves_the_engine_thread_idle() -> None:
    """While a pull fills a request's blocks there is nothing to step: the engine thread waits for a
    command instead of stepping in a loop (which held the GIL: every thread hop of the daemon's pull
    then waited ~5 ms for the interpreter's switch interval)."""
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=64))
    steps = _count_steps(engine)

    async def main() -> list[int]:
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            assert await aengine.add_request_with_external_kv("pulling", [5, 6, 7, 8, 9], PARAMS) is not None
            before = steps[0]
            await asyncio.sleep(0.3)
            idle_steps = steps[0] - before
            await aengine.complete_external_kv("pulling", 1234)  # the command wakes it: the request runs
            tokens = [t async for out in aengine.outputs("pulling") for t in out.new_token_ids]
            return [idle_steps, len(tokens)]
        finally:
            await aengine.stop()

    idle_steps, num_tokens = asyncio.run(main())
    assert idle_steps <= 1  # at most the step already under way
    assert num_tokens == 6


def test_a_waiting_request_that_does_not_fit_leaves_the_engine_thread_idle() -> None:
    """Nothing runs and the waiting request needs blocks a pending pull holds: steps schedule nothing
    until a command frees blocks, so the thread waits for one instead of stepping in a loop."""
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=4, max_model_len=64))
    steps = _count_steps(engine)

    async def main() -> tuple[int, list[int], list[int]]:
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            assert await aengine.add_request_with_external_kv("pulling", list(range(5, 45)), PARAMS) is not None
            await aengine.add_request("waiting", list(range(50, 80)), PARAMS)  # 2 blocks; 1 is free
            await asyncio.sleep(0.2)
            before = steps[0]
            await asyncio.sleep(0.3)
            idle_steps = steps[0] - before
            await aengine.complete_external_kv("pulling", 1234)
            first = [t async for out in aengine.outputs("pulling") for t in out.new_token_ids]
            second = [t async for out in aengine.outputs("waiting") for t in out.new_token_ids]
            return idle_steps, first, second
        finally:
            await aengine.stop()

    idle_steps, first, second = asyncio.run(main())
    assert idle_steps <= 1
    assert len(first) == 6 and len(second) == 6  # the waiting request ran once the pulled one finished
