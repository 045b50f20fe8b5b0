"""End to end with DeepSeek-V3 (multi-head latent attention): router + prefill + decode processes over real NIXL.

A small random DeepSeek-V3 checkpoint (one cached latent row of kv_lora_rank + qk_rope_head_dim per token
and layer, an MLA KV group) must give the colocated engine's greedy tokens, in both layouts, with different
block sizes on the two sides, and between TP sizes (1 -> 2, 2 -> 1). Every request is pulled (the decode
worker's transfer bytes grow with each, nothing is recomputed locally), and the bytes pulled are the ideal:
one latent row per token and layer of each prompt per decode rank (the row is replicated, never split by
head), no V plane, nothing more.
"""

from __future__ import annotations

import pytest

from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.kv.spec.groups import AttentionKind
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import (
    TP_PAIRS,
    colocated_greedy,
    completion_tokens,
    info,
    metric_total,
    random_prompt,
    stack,
    worker_tp,
)

MAX_TOKENS = 8
# (prefill args, decode args): both layouts on each side, block-size ratios in both directions.
PAIRS = {
    "P-cross16-D-per8": (
        ("--kv-layout", "cross_layer", "--block-size", "16", "--num-kv-blocks", "256", "--dtype", "float32"),
        ("--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "256", "--dtype", "float32"),
    ),
    "P-per4-D-cross16": (
        ("--kv-layout", "per_layer", "--block-size", "4", "--num-kv-blocks", "512", "--dtype", "float32",
         "--max-num-batched-tokens", "24"),  # chunked prefill on the prefill worker
        ("--kv-layout", "cross_layer", "--block-size", "16", "--num-kv-blocks", "256", "--dtype", "float32"),
    ),
}
# TP pairs (stack.TP_PAIRS): every decode rank reads the whole (replicated) row once, from one prefill rank.
PAIRS |= TP_PAIRS


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))
    return str(directory)


@pytest.fixture(scope="module")
def colocated(model: str):
    return colocated_greedy(model, MAX_TOKENS)


@pytest.fixture(scope="module")
def row_bytes_per_token(model: str) -> int:
    """One latent row per layer of one token, from the engine's own layout (3 layers of 40 fp32 elements)."""
    layout = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=4)).kv_layout
    (group,) = layout.groups
    assert group.kind is AttentionKind.MLA and layout.num_kv_planes(0) == 1
    per_token = layout.block_bytes(0) // group.block_size
    assert per_token == len(group.layer_ids) * (32 + 8) * 4
    return per_token


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_mla_disaggregated_equals_colocated_and_pulls_one_row_per_token(model: str, colocated,
                                                                       row_bytes_per_token: int, pair: str) -> None:
    prefill_args, decode_args = PAIRS[pair]
    row_bytes_per_token *= worker_tp(decode_args)  # one row per token and layer for each decode rank
    # Lengths on every block boundary of both sides (16 divides them), so the ideal is exact; distinct
    # random prompts, so neither side's prefix cache serves any of them.
    prompts = [random_prompt(100 + i, n) for i, n in enumerate((16, 48, 64, 32))]
    with stack(model, prefill_args=prefill_args, decode_args=decode_args) as s:
        decode = s.decode[0]
        total_pulled = 0
        for i, prompt in enumerate(prompts):
            before = metric_total(decode, "pdserve_kv_transfer_bytes_total")
            assert completion_tokens(s.url, prompt, MAX_TOKENS, stream=bool(i % 2)) == colocated(prompt), i
            pulled = metric_total(decode, "pdserve_kv_transfer_bytes_total") - before
            assert pulled == len(prompt) * row_bytes_per_token, (i, pulled)  # this request was pulled, exactly
            total_pulled += pulled
        assert total_pulled == sum(map(len, prompts)) * row_bytes_per_token
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0  # really disaggregated
        # A prompt that ends mid-block: still pulled, its last block at most padded to the finer block size.
        prompt = random_prompt(7, 37)
        before = metric_total(decode, "pdserve_kv_transfer_bytes_total")
        assert completion_tokens(s.url, prompt, MAX_TOKENS, stream=False) == colocated(prompt)
        pulled = metric_total(decode, "pdserve_kv_transfer_bytes_total") - before
        assert 37 * row_bytes_per_token <= pulled <= 40 * row_bytes_per_token, pulled
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0
        assert info(s.prefill[0]).kv_blocks_pinned == 0
