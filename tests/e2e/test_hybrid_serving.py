"""End to end with a hybrid model: sliding-window and full-attention KV groups, KV-shared layers.

A small random Gemma-4 text checkpoint (sliding and full layers with different head dims, the last
layers reading earlier layers' KV, per-layer inputs) served by router + prefill + decode processes
over real NIXL must give the colocated engine's greedy tokens for prompts several windows long,
with prefix-cache hits, in both layouts and with different block sizes on the two sides. The
decode worker pulls the full group whole and the sliding group only over the last window: its
transfer-bytes metric for a long prompt is within 1.05x of that ideal.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.stack import (
    colocated_greedy,
    completion_tokens,
    http_client,
    ideal_pull_bytes,
    info,
    metric_total,
    stack,
)

MAX_TOKENS = 8
# (prefill args, decode args): both layouts on each side, block-size ratios in both directions.
PAIRS = {
    "P-cross16-D-per8": (
        ("--kv-layout", "cross_layer", "--block-size", "16", "--num-kv-blocks", "256", "--max-num-seqs", "8"),
        ("--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "256", "--max-num-seqs", "8"),
    ),
    "P-per4-D-cross16": (
        ("--kv-layout", "per_layer", "--block-size", "4", "--num-kv-blocks", "512", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "48"),  # chunked prefill: the window group frees between chunks
        ("--kv-layout", "cross_layer", "--block-size", "16", "--num-kv-blocks", "256", "--max-num-seqs", "8"),
    ),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("gemma4", tmp_path_factory.mktemp("gemma4"))
    return str(directory)


@pytest.fixture(scope="module")
def window(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["sliding_window"])


@pytest.fixture(scope="module")
def colocated(model: str):
    return colocated_greedy(model, MAX_TOKENS, num_kv_blocks=512)


def _prompts(window: int, n: int, seed: int) -> list[list[int]]:
    """Prompts 3-6 windows long sharing a 2-window prefix (prefix-cache hits on both sides)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(2 * window)]
    return [shared + [rng.randrange(3, 300) for _ in range(rng.randrange(window, 4 * window))] for _ in range(n)]


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_hybrid_disaggregated_equals_colocated(model: str, window: int, colocated, pair: str) -> None:
    prefill_args, decode_args = PAIRS[pair]
    with stack(model, prefill_args=prefill_args, decode_args=decode_args) as s:
        prompts = _prompts(window, 4, seed=5)
        for i, prompt in enumerate(prompts):
            assert completion_tokens(s.url, prompt, MAX_TOKENS, stream=bool(i % 2)) == colocated(prompt), i
        # The shared 2-window prefix is served from the prefill worker's cache (full group from
        # token 0, sliding group over the window before the hit) and the output does not change.
        with http_client(timeout=60) as client:
            body = {"prompt": prompts[-1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            answer = client.post(f"{s.url}/v1/completions", json=body).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * window
        assert completion_tokens(s.url, prompts[-1], MAX_TOKENS, stream=False) == colocated(prompts[-1])
        # Concurrent prompts of varied lengths: chunks of different sizes interleave on the prefill
        # worker, so sliding-group blocks are freed mid-prompt while other requests' blocks are held.
        # 12 requests for 8 decode seats: a pull waits for a seat instead of recomputing locally.
        many = _prompts(window, 12, seed=21)
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda p: completion_tokens(s.url, p[1], MAX_TOKENS, p[0] % 2 == 0),
                                    enumerate(many)))
        for prompt, tokens in zip(many, results, strict=True):
            assert tokens == colocated(prompt)
        decode = s.decode[0]
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0  # really disaggregated

        # A fresh long prompt: the decode worker holds none of it, so it pulls every full-group block
        # and the sliding group's blocks over the last window, nothing more.
        prompt = [random.Random(9).randrange(3, 300) for _ in range(10 * window + 3)]
        before = metric_total(decode, "pdserve_kv_transfer_bytes_total")
        assert completion_tokens(s.url, prompt, MAX_TOKENS, stream=False) == colocated(prompt)
        pulled = metric_total(decode, "pdserve_kv_transfer_bytes_total") - before
        ideal = ideal_pull_bytes(model, prefill_args, decode_args, len(prompt))
        assert ideal <= pulled <= 1.05 * ideal, (pulled, ideal)
        assert info(s.prefill[0]).kv_blocks_pinned == 0
