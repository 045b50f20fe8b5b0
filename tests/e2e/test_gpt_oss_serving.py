"""End to end with gpt-oss: router + prefill + decode processes over real NIXL.

A small random gpt-oss checkpoint (``tests/checkpoints.py``: sliding-window and full layers alternating, learned
sinks, biased experts in every layer) must give the colocated engine's greedy tokens with different block sizes
and layouts on the two sides, with the prefill worker handing its KV out per chunk, and between TP sizes (1 -> 2,
2 -> 1: heads with their sinks and every expert's width split on a TP worker). Every request is pulled, none
recomputed, and the bytes pulled are the ideal (``stack.ideal_pull_bytes``): the full group for every prompt
token, the sliding group only over the last window -- clipped on the pull, though the prompts are several windows
long.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.stack import (
    TP_PAIRS,
    colocated_greedy,
    completion_tokens,
    ideal_pull_bytes,
    info,
    metric_total,
    random_prompt,
    stack,
)

MAX_TOKENS = 8
PAIRS = {
    "P-per4-chunked-D-cross16": (
        ("--kv-layout", "per_layer", "--block-size", "4", "--num-kv-blocks", "512", "--dtype", "float32",
         "--max-num-batched-tokens", "24"),  # chunked prefill: KV handed out per chunk
        ("--kv-layout", "cross_layer", "--block-size", "16", "--num-kv-blocks", "256", "--dtype", "float32"),
    ),
    **TP_PAIRS,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))
    return str(directory)


@pytest.fixture(scope="module")
def colocated(model: str):
    return colocated_greedy(model, MAX_TOKENS)


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_gpt_oss_disaggregated_equals_colocated_and_pulls_the_window(model: str, colocated, pair: str) -> None:
    prefill_args, decode_args = PAIRS[pair]
    window = int(json.loads((Path(model) / "config.json").read_text())["sliding_window"])
    prompts = [random_prompt(400 + i, n) for i, n in enumerate((3 * window, 5 * window + 7, window // 2))]
    with stack(model, prefill_args=prefill_args, decode_args=decode_args) as s:
        decode = s.decode[0]
        for i, prompt in enumerate(prompts):
            before = metric_total(decode, "pdserve_kv_transfer_bytes_total")
            assert completion_tokens(s.url, prompt, MAX_TOKENS, stream=bool(i % 2)) == colocated(prompt), i
            pulled = metric_total(decode, "pdserve_kv_transfer_bytes_total") - before
            assert pulled == ideal_pull_bytes(model, prefill_args, decode_args, len(prompt)), (i, pulled)
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0  # really disaggregated
        assert info(s.prefill[0]).kv_blocks_pinned == 0
