"""End to end with Qwen3-MoE: router + prefill + decode processes over real NIXL.

A small random Qwen3-MoE checkpoint (``tests/checkpoints.py``: routed experts in two of three layers, q/k norms)
must give the colocated engine's greedy tokens with different block sizes and layouts on the two sides and
between TP sizes (1 -> 2, 2 -> 1: the experts' widths split on a TP worker). Every request is pulled, none
recomputed, and the bytes pulled are the ideal: K and V of every layer for each prompt token (the two KV heads
split over two decode ranks, not replicated), nothing more. The experts change nothing on the wire: this checks
that it stays so.
"""

from __future__ import annotations

import pytest

from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import TP_PAIRS, colocated_greedy, completion_tokens, info, metric_total, random_prompt, stack

MAX_TOKENS = 8
PAIRS = {
    "P-per4-D-cross16": (
        ("--kv-layout", "per_layer", "--block-size", "4", "--num-kv-blocks", "512", "--dtype", "float32",
         "--max-num-batched-tokens", "24"),  # chunked prefill on the prefill worker
        ("--kv-layout", "cross_layer", "--block-size", "16", "--num-kv-blocks", "256", "--dtype", "float32"),
    ),
    **TP_PAIRS,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))
    return str(directory)


@pytest.fixture(scope="module")
def colocated(model: str):
    return colocated_greedy(model, MAX_TOKENS)


@pytest.fixture(scope="module")
def kv_bytes_per_token(model: str) -> int:
    """K and V of every layer for one token (3 layers x 2 planes x 2 heads x 16 fp32 elements)."""
    layout = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=4)).kv_layout
    (group,) = layout.groups
    per_token = layout.block_bytes(0) // group.block_size
    assert per_token == 3 * 2 * 2 * 16 * 4
    return per_token


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_moe_disaggregated_equals_colocated_and_pulls_the_ideal(model: str, colocated, kv_bytes_per_token: int,
                                                                pair: str) -> None:
    prefill_args, decode_args = PAIRS[pair]
    prompts = [random_prompt(300 + i, n) for i, n in enumerate((16, 48, 32))]  # whole blocks on both sides
    with stack(model, prefill_args=prefill_args, decode_args=decode_args) as s:
        decode = s.decode[0]
        for i, prompt in enumerate(prompts):
            before = metric_total(decode, "pdserve_kv_transfer_bytes_total")
            assert completion_tokens(s.url, prompt, MAX_TOKENS, stream=bool(i % 2)) == colocated(prompt), i
            pulled = metric_total(decode, "pdserve_kv_transfer_bytes_total") - before
            assert pulled == len(prompt) * kv_bytes_per_token, (i, pulled)
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0  # really disaggregated
        assert info(s.prefill[0]).kv_blocks_pinned == 0
