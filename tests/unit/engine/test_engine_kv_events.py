"""KV events through a whole engine (CPU): the salt a worker sets, the device and host tiers' STORED keys
equal to what a router computes, a snapshot consistent with the numbering, and the load fields."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.contract.prefix_keys import cache_salt_for, hash_request_blocks
from services.contract.sampling_params import SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.engine_config import EngineConfig
from services.engine.kv_cache.events import KVEventKind, KVTier
from services.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 300 + 10 for i in range(37)]
SALT = cache_salt_for("0123abcd")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return str(directory)


def _engine(model: str, **kw) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, **kw))
    engine.set_cache_salt(SALT)
    engine.kv_events.enabled = True
    return engine


def _settle(engine: LLMEngine, timeout_s: float = 10.0) -> None:
    tier = engine.host_tier
    deadline = time.monotonic() + timeout_s
    while tier.stats().store_queue_depth or tier.has_completions:
        engine.scheduler.take_finished_loads()
        assert time.monotonic() < deadline, "host tier copies did not finish"
        time.sleep(0.005)


def _stored(engine: LLMEngine, tier: KVTier) -> list[bytes]:
    engine.kv_events.seal()
    return [k for e in engine.kv_events.take() if e.kind is KVEventKind.STORED and e.tier is tier
            for k in e.block_keys]


def test_device_keys_are_the_routers_keys_and_the_snapshot_matches_the_numbering(model: str) -> None:
    engine = _engine(model)
    engine.generate([PROMPT], GREEDY)
    stored = _stored(engine, KVTier.DEVICE)
    expected = hash_request_blocks(PROMPT, 4, SALT)  # 9 full prompt blocks
    assert stored[:len(expected)] == expected
    seq, contents = engine.kv_snapshot()
    assert seq == engine.kv_events.last_seq >= 1
    (device,) = contents
    assert (device.tier, device.group_id, device.block_size) == (KVTier.DEVICE, 0, 4)
    assert set(expected) <= set(device.block_keys) and set(device.block_keys) == set(stored)


def test_host_tier_spans_are_stored_with_the_span_size(model: str) -> None:
    engine = _engine(model, kv_offload_bytes=1 << 24, kv_offload_block_factor=2)
    engine.generate([PROMPT], GREEDY)
    _settle(engine)
    assert _stored(engine, KVTier.HOST)[:4] == hash_request_blocks(PROMPT, 8, SALT)
    _, contents = engine.kv_snapshot()
    host = [c for c in contents if c.tier is KVTier.HOST]
    assert len(host) == 1 and host[0].block_size == 8
    assert set(hash_request_blocks(PROMPT, 8, SALT)) <= set(host[0].block_keys)


def test_salt_is_refused_once_requests_ran(model: str) -> None:
    engine = _engine(model)
    engine.generate([PROMPT], GREEDY)
    with pytest.raises(ValueError, match="salt"):
        engine.set_cache_salt(b"late")


def test_load_counts_pending_prompt_tokens_and_measures_the_prefill_rate(model: str) -> None:
    engine = _engine(model)
    assert engine.prefill_rate.tokens_per_s == 0.0
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", PROMPT[:20], GREEDY)
    assert engine.scheduler.num_prefill_tokens_pending == len(PROMPT) + 20
    engine.generate([PROMPT[:9]], GREEDY)  # runs a and b too
    assert engine.prefill_rate.tokens_per_s > 0.0
    assert engine.scheduler.num_prefill_tokens_pending == 0

    async def main() -> int:
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            assert aengine.stats.prefill_tokens_per_s == engine.prefill_rate.tokens_per_s
            return (await aengine.kv_snapshot())[0]
        finally:
            await aengine.stop()

    assert asyncio.run(main()) == engine.kv_events.last_seq
