"""The host KV tier in one engine (CPU): stores as blocks are computed, loads back on a hit, and the
races the seed's review found (a block reused while its store is in flight, eviction during a
load, a request aborted mid-load). Greedy tokens must equal an engine with no host tier. The model
is a small random checkpoint whose tokens depend on the whole context
(``tests/unit/test_context_checkpoint.py``): with ``dummy:tiny``, whose tokens follow the last
prompt token only, a wrong or missing KV block would go unnoticed.

The GPU machine runs this file with ``PDSERVE_TEST_DEVICE=cuda``: pinned host memory, the copy
stream and its events instead of the CPU path."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from services.common.metrics import WorkerMetrics
from services.contract.sampling_params import SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.offload.copier import block_planes, block_runs
from services.kv.spec.layout import LayoutKind
from tests.checkpoints import make_checkpoint

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Ids below the checkpoint's vocabulary (320); no two of these prompts share a first token, so none
# hits another's prefix.
PROMPT = [(7 * i + 3) % 300 + 10 for i in range(300)]
OTHER = [(11 * i + 5) % 300 + 10 for i in range(300)]
UNSEEN = [(13 * i + 1) % 300 + 10 for i in range(300)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))
    return str(directory)


def _engine(model: str, num_kv_blocks: int = 24, factor: int = 2, offload_bytes: int | None = 1 << 24,
            **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device=DEVICE, dtype="float32", num_kv_blocks=num_kv_blocks,
                                  kv_offload_bytes=offload_bytes, kv_offload_block_factor=factor, **kw))


def _reference(model: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=model, device=DEVICE, dtype="float32", num_kv_blocks=128, **kw))
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


def _settle(engine: LLMEngine, timeout_s: float = 10.0) -> None:
    """Take in every copy in flight (stores of finished requests, loads)."""
    tier = engine.host_tier
    deadline = time.monotonic() + timeout_s
    while tier.stats().store_queue_depth or tier.stats().loads_in_flight or tier.has_completions:
        engine.scheduler.take_finished_loads()
        assert time.monotonic() < deadline, "host tier copies did not finish"
        time.sleep(0.005)


class _Gate:
    """Holds the copier's next jobs until opened: the window in which the races happen."""

    def __init__(self, engine: LLMEngine) -> None:
        self.open_event = threading.Event()
        copier = engine.host_tier._copier
        real_copy = copier._copy

        def gated(job):
            self.open_event.wait(timeout=30)
            real_copy(job)

        copier._copy = gated

    def open(self) -> None:
        self.open_event.set()


def _assert_no_block_in_use(engine: LLMEngine) -> None:
    for s in engine.kv_manager.stats():
        assert s.num_used == 0 and s.num_held == 0, s
    assert engine.host_tier.stats().spans_used == 0


def test_block_runs_merge_where_both_sides_continue() -> None:
    assert block_runs([40, 41, 42, 43, 7, 8], [96, 97, 98, 99, 100, 101]) == [(40, 96, 4), (7, 100, 2)]
    assert block_runs([1, 2, 3], [5, 9, 10]) == [(1, 5, 1), (2, 9, 2)]
    with pytest.raises(ValueError):
        block_runs([1], [1, 2])


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_block_planes_address_whole_blocks(model: str, kind: LayoutKind) -> None:
    engine = _engine(model, kv_layout=kind)
    layout, buffers = engine.kv_layout, engine.kv_cache.buffers
    planes = block_planes(layout, buffers)
    assert len(planes) == len(buffers)
    planes[0][:, 3].fill_(7.0)  # block 3 of the first buffer, every plane
    k, v = engine.kv_cache.views[0]
    assert bool((k[3] == 7).all()) and bool((v[3] == 7).all()) and not bool((k[2] == 7).any())
    engine.close()


@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("kind", list(LayoutKind))
def test_host_hit_after_device_eviction_is_token_identical(model: str, factor: int, kind: LayoutKind) -> None:
    expected = _reference(model, [PROMPT, OTHER], kv_layout=kind)
    engine = _engine(model, factor=factor, kv_layout=kind)
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == expected[0]
    _settle(engine)
    assert engine.generate([OTHER], GREEDY)[0].token_ids == expected[1]  # pushes PROMPT out of the device pool
    _settle(engine)
    again = engine.generate([PROMPT], GREEDY)[0]
    assert again.token_ids == expected[0]
    stats, prefix = engine.host_tier.stats(), engine.scheduler.prefix_stats
    span = 16 * factor
    host_tokens = again.num_cached_tokens - prefix.device_hit_tokens
    assert prefix.host_hits == 1 and host_tokens > 0
    assert again.num_cached_tokens == (len(PROMPT) - 1) // span * span  # every full span but the last token's
    assert stats.bytes_loaded > 0 and stats.bytes_stored > 0
    _settle(engine)
    _assert_no_block_in_use(engine)
    engine.close()


@pytest.mark.parametrize("hybrid", ["dummy:gemma3-tiny", "dummy:gemma2-tiny"])
def test_sliding_window_groups_hit_from_the_host_tier(hybrid: str) -> None:
    """Hybrids: full groups load every span, sliding groups only the window's; spans that slid out
    before they were whole are not stored. (Unlike dummy:tiny, these dummies' tokens depend on the
    context.)"""
    expected = _reference(hybrid, [PROMPT, OTHER])
    engine = _engine(hybrid, num_kv_blocks=24, factor=2, max_num_batched_tokens=64)
    outs = [engine.generate([p], GREEDY)[0].token_ids for p in (PROMPT, OTHER)]
    _settle(engine)
    again = engine.generate([PROMPT], GREEDY)[0]
    assert outs == expected and again.token_ids == expected[0]
    assert engine.scheduler.prefix_stats.host_hits == 1 and again.num_cached_tokens > 0
    _settle(engine)
    _assert_no_block_in_use(engine)
    engine.close()


def test_a_block_freed_while_its_store_is_in_flight_is_not_reused_until_the_copy_ends(model: str) -> None:
    engine = _engine(model, num_kv_blocks=24, factor=2)
    gate = _Gate(engine)
    request = engine.add_request("a", PROMPT, GREEDY)
    while not request.finished:
        engine.step()
    stored = [b for st in engine.host_tier._jobs[0].stores for b in st.device_blocks]
    snapshot = {b: engine.kv_cache.views[0][0][b].clone() for b in stored}
    pool = engine.kv_manager.pool(0)
    assert all(pool.ref_count(b) == 1 for b in stored)  # the request is gone: only the store holds them
    # Every block that is free is taken and overwritten; the ones being stored cannot be among them.
    taker = engine.add_request("b", OTHER[:pool.num_free_blocks * 16 - 1], SamplingParams(max_tokens=1))
    while not taker.finished:
        engine.step()
    assert taker.status.value != "finished_aborted"
    assert all(torch.equal(engine.kv_cache.views[0][0][b], snapshot[b]) for b in stored)
    gate.open()
    _settle(engine)
    assert all(pool.ref_count(b) == 0 for b in stored)
    engine.kv_manager.reset_prefix_cache()  # the device copies are forgotten: only the host tier has them
    again = engine.generate([PROMPT], GREEDY)[0]  # loaded from what the store copied
    assert again.token_ids == _reference(model, [PROMPT])[0]
    assert engine.scheduler.prefix_stats.host_hits >= 1
    engine.close()


def test_eviction_during_a_load_skips_the_spans_being_loaded(model: str) -> None:
    # A host tier of exactly PROMPT's spans: any store while it loads would have to evict them.
    per_span = 2 * sum(_engine(model, offload_bytes=None).kv_layout.block_bytes(g.group_id) for g in
                       _engine(model, offload_bytes=None).kv_layout.groups)
    engine = _engine(model, num_kv_blocks=48, factor=2, offload_bytes=per_span * (len(PROMPT) // 32 + 1))
    expected = _reference(model, [PROMPT, OTHER])
    engine.generate([PROMPT], GREEDY)
    _settle(engine)
    engine.generate([OTHER], GREEDY)  # its stores evict PROMPT's spans (least recently used first)
    _settle(engine)
    engine.generate([PROMPT], GREEDY)  # a device hit; what was evicted is stored again
    _settle(engine)
    engine.kv_manager.reset_prefix_cache()  # only the host tier has PROMPT now
    gate = _Gate(engine)
    loading = engine.add_request("p", PROMPT, GREEDY)
    engine.step()
    assert loading.status.value == "loading_kv"
    loading_spans = engine.host_tier._jobs[max(engine.host_tier._jobs)].host_spans[0]
    hashes = {s: engine.host_tier.spans.pool(0).block_hash(s) for s in loading_spans}
    # A prompt with no hit anywhere (nothing of it waits on the gated copier) computes and stores
    # spans while the load waits.
    competitor = engine.add_request("o", UNSEEN, GREEDY)
    while not competitor.finished:
        engine.step()
    assert all(engine.host_tier.spans.pool(0).block_hash(s) == h for s, h in hashes.items())
    assert engine.host_tier.stats().stores_skipped > 0  # no span was free to take: the stores gave way
    gate.open()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "p" and o.finished]
        time.sleep(0.001)
    assert outputs[0].token_ids == expected[0]
    _settle(engine)
    _assert_no_block_in_use(engine)
    engine.close()


def test_a_request_aborted_mid_load_leaves_nothing_pinned(model: str) -> None:
    engine = _engine(model, num_kv_blocks=24, factor=2)
    engine.generate([PROMPT], GREEDY)
    _settle(engine)
    engine.generate([OTHER], GREEDY)
    _settle(engine)
    gate = _Gate(engine)
    request = engine.add_request("p", PROMPT, GREEDY)
    engine.step()
    assert request.status.value == "loading_kv" and engine.scheduler.num_loading == 1
    targets = list(request.block_ids[0])
    assert engine.abort_request("p")
    pool = engine.kv_manager.pool(0)
    assert engine.scheduler.num_loading == 0
    assert all(pool.ref_count(b) >= 1 for b in targets[request.num_computed_tokens // 16:])  # the copy holds them
    gate.open()
    _settle(engine)
    _assert_no_block_in_use(engine)
    assert not engine.has_unfinished_requests()
    engine.close()


def test_a_failed_load_computes_the_prompt_instead(model: str) -> None:
    engine = _engine(model, num_kv_blocks=24, factor=2)
    expected = _reference(model, [PROMPT])[0]
    engine.generate([PROMPT], GREEDY)
    _settle(engine)
    engine.generate([OTHER], GREEDY)
    _settle(engine)
    copier = engine.host_tier._copier

    def broken(job):
        raise RuntimeError("copy failed")

    copier._copy = broken
    out = engine.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == expected
    _assert_no_block_in_use(engine)
    engine.close()


def test_the_host_tier_needs_prefix_caching_and_a_span_of_room(model: str) -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(model="dummy:tiny", device=DEVICE, kv_offload_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="factor"):
        EngineConfig(model="dummy:tiny", device=DEVICE, kv_offload_bytes=1 << 20, kv_offload_block_factor=0)
    with pytest.raises(ValueError, match="holds no span"):
        _engine(model, offload_bytes=1024)


def test_worker_metrics_follow_the_engine_counts(model: str) -> None:
    async def run() -> None:
        engine = _engine(model, factor=2)
        aengine = AsyncEngine(engine)
        aengine.start()
        metrics = WorkerMetrics("prefill")
        for i, prompt in enumerate((PROMPT, OTHER, PROMPT)):
            await aengine.add_request(f"r{i}", prompt, GREEDY)
            async for _ in aengine.outputs(f"r{i}"):
                pass
            for _ in range(400):  # the copies wake the engine thread, which takes them in
                if not aengine.stats.host_tier.store_queue_depth:
                    break
                await asyncio.sleep(0.005)
        metrics.set_engine_stats(aengine.stats)
        metrics.set_engine_stats(aengine.stats)  # totals, not increments: a second call adds nothing
        await aengine.stop()
        engine.close()
        value = metrics.registry.get_sample_value
        assert value("pdserve_kv_prefix_lookups_total", {"role": "prefill", "tier": "host", "result": "hit"}) == 1
        assert value("pdserve_kv_prefix_cached_tokens_total", {"role": "prefill", "tier": "host"}) > 0
        assert value("pdserve_kv_offload_bytes_total", {"role": "prefill", "direction": "load"}) > 0
        assert value("pdserve_kv_offload_bytes_total", {"role": "prefill", "direction": "store"}) > 0
        assert value("pdserve_kv_offload_spans", {"role": "prefill", "state": "cached"}) > 0
        assert value("pdserve_kv_offload_queue_depth", {"role": "prefill", "kind": "store"}) == 0

    import asyncio

    asyncio.run(run())
