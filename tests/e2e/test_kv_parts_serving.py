"""End to end: a prompt's KV sent per prefill chunk (the default) or in one piece (``--no-kv-parts``), through
real routers, one prefill and one decode worker.

The prefill worker computes in chunks of 8 tokens, so the longer prompts are handed out in several part
tickets, which the router relays into the decode worker's ``GenerateParts``; a short one is one chunk and
goes the old way. Greedy tokens must equal a colocated engine's with per-chunk sending on and off, every
request is served disaggregated (nothing recomputed), and afterwards nothing is left pinned or reserved.
"""

from __future__ import annotations

import time

import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.launch.spawn import start_router, stop_router
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import PREFILL_ARGS, completion_tokens, info, metric_total, random_prompt, stack

pytestmark = pytest.mark.slow

CHUNK = 8
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("ckpt"))
    return str(directory)


def test_greedy_tokens_equal_colocated_with_kv_parts_on_and_off(checkpoint: str) -> None:
    # The reference prefills in the same chunks as the prefill worker (the KV is then the same to the bit).
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", dtype="float32", num_kv_blocks=256,
                                    max_num_batched_tokens=CHUNK, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def prompts(seed: int) -> list[list[int]]:
        """Fresh prompts (no worker's cache holds them), two sharing a prefix, one of a single chunk."""
        base = random_prompt(seed, 45)
        return [base, base[:24] + random_prompt(seed + 1, 17), random_prompt(seed + 2, 33), random_prompt(seed + 3, 5)]

    with stack(checkpoint, 1, 1, prefill_args=(*PREFILL_ARGS, "--max-num-batched-tokens", str(CHUNK))) as s:
        (p,), (d,) = s.prefill, s.decode
        one_piece = start_router(checkpoint, [p.address], [d.address], "--no-kv-parts")
        stages = ("last_pull", "resume", "first_step")
        joins_before = [metric_total(d, "pdserve_kv_join_stage_seconds_count", f'stage="{s}"') for s in stages]
        try:
            for seed, (url, per_chunk) in enumerate(((one_piece.url, False), (s.url, True))):
                before = metric_total(p, "pdserve_requests_total", 'outcome="kv_part"')
                pulls_before = metric_total(d, "pdserve_kv_transfer_seconds_count")
                coalesced_before = metric_total(d, "pdserve_kv_parts_coalesced_total")
                for stream in (True, False):
                    batch = prompts(100 * seed + 10 * stream)
                    reference = [engine.generate([prompt], params)[0].token_ids for prompt in batch]
                    got = [completion_tokens(url, prompt, MAX_TOKENS, stream) for prompt in batch]
                    assert got == reference, (url, stream)
                parts = metric_total(p, "pdserve_requests_total", 'outcome="kv_part"') - before
                # 45 tokens: 5 parts; the sharer computes 24.. (2 parts); 33: 4; 5: none. Twice (streamed or not).
                assert parts == (2 * (5 + 2 + 4) if per_chunk else 0), parts
                # Every ticket is read: each part and each request's final (or whole) ticket, the short prompt's one.
                # A pull reads one, or with it the parts that queued behind the pull before (each counted once).
                pulls = metric_total(d, "pdserve_kv_transfer_seconds_count") - pulls_before
                coalesced = metric_total(d, "pdserve_kv_parts_coalesced_total") - coalesced_before
                assert pulls + coalesced == parts + 2 * 4, (pulls, coalesced)
                assert per_chunk or coalesced == 0
        finally:
            stop_router(one_piece)
        assert metric_total(d, "pdserve_local_recompute_fallbacks_total") == 0
        # Every request's way from its last ticket to its first decode token is timed once, stage by stage
        # (the router's start-up probe pulls too, before the routers are used).
        for stage, before in zip(stages, joins_before, strict=True):
            joins = metric_total(d, "pdserve_kv_join_stage_seconds_count", f'stage="{stage}"') - before
            assert joins == 2 * 2 * 4, (stage, joins)
        assert metric_total(d, "pdserve_kv_transfer_failures_total") == 0
        deadline = time.monotonic() + 10
        while info(p).kv_blocks_pinned and time.monotonic() < deadline:
            time.sleep(0.1)
        assert info(p).kv_blocks_pinned == 0
        assert (info(d).num_running, info(d).num_waiting) == (0, 0)
