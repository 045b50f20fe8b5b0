"""End to end with Granite-4.0-H (Mamba2 state layers beside attention): router + prefill + decode processes over
real NIXL.

A small random Granite-4.0-H checkpoint must give the colocated engine's greedy tokens, in both layouts, with
different block sizes on the two sides, whole tickets and KV sent per prefill chunk, and between TP sizes (1 -> 2,
2 -> 1: the Mamba heads split differently on the two sides). Every request is pulled (the
decode worker's transfer bytes grow with each, nothing is recomputed locally), and the bytes pulled are the ideal:
the attention layer's K and V of every prompt token, and each Mamba2 layer's conv and SSM state once.
"""

from __future__ import annotations

import pytest

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
from tests.unit.engine.test_granite_hybrid import CHECKPOINTS, make_granite_checkpoint

MAX_TOKENS = 8
pytestmark = pytest.mark.timeout(240)  # a leaked state slot stalls a request: fail in minutes, not at the suite's 900 s
# (prefill args, decode args): both layouts on each side, block-size ratios in both directions; the second
# prefills in chunks of 24 tokens, so its longer prompts go out as part tickets (the state with the last).
PAIRS = {
    # Two state slots per worker for five requests: a slot not given back after a pull (prefill) or a finish
    # (decode) would stall the third request.
    "P-cross16-D-per8": (
        ("--kv-layout", "cross_layer", "--block-size", "16", "--num-kv-blocks", "256", "--dtype", "float32",
         "--max-num-seqs", "2"),
        ("--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "256", "--dtype", "float32",
         "--max-num-seqs", "2"),
    ),
    "P-per8-chunked-D-cross16": (
        ("--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "512", "--dtype", "float32",
         "--max-num-batched-tokens", "24"),
        ("--kv-layout", "cross_layer", "--block-size", "16", "--num-kv-blocks", "256", "--dtype", "float32"),
    ),
}
# TP pairs (stack.TP_PAIRS): each decode rank reads its Mamba heads' state from the prefill rank(s) holding them,
# and the one group's B and C rows (on every rank) once per decode rank.
PAIRS |= TP_PAIRS


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_granite_checkpoint("nope", tmp_path_factory.mktemp("granite"))
    return str(directory)


@pytest.fixture(scope="module")
def colocated(model: str):
    return colocated_greedy(model, MAX_TOKENS)


def _ideal_bytes(num_tokens: int, decode_tp: int = 1) -> int:
    """What a pull must move, from the checkpoint's config (fp32): K and V of the one attention layer per token,
    and per Mamba2 layer the SSM state [heads, head_dim, d_state] and the conv window of x [heads x head_dim,
    d_conv - 1] once, and of B and C [d_state, d_conv - 1] per group once per decode rank holding that group."""
    c = CHECKPOINTS["nope"]
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    kv = c["layer_types"].count("attention") * 2 * c["num_key_value_heads"] * head_dim * 4
    inner = c["mamba_expand"] * c["hidden_size"]
    groups_read = decode_tp * max(1, c["mamba_n_groups"] // decode_tp)
    conv_rows = inner + 2 * groups_read * c["mamba_d_state"]
    state = (conv_rows * (c["mamba_d_conv"] - 1) + c["mamba_n_heads"] * c["mamba_d_head"] * c["mamba_d_state"]) * 4
    return num_tokens * kv + c["layer_types"].count("mamba") * state


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_state_model_disaggregated_equals_colocated_and_pulls_the_ideal(model: str, colocated, pair: str) -> None:
    prefill_args, decode_args = PAIRS[pair]
    tp = worker_tp(decode_args)
    # Lengths on every block boundary of both sides (16 divides them), so the ideal is exact; distinct
    # random prompts (a model with state layers gets no prefix-cache hits anyway).
    prompts = [random_prompt(200 + i, n) for i, n in enumerate((16, 48, 64, 32))]
    with stack(model, prefill_args=prefill_args, decode_args=decode_args) as s:
        decode = s.decode[0]
        for i, prompt in enumerate(prompts):
            before = metric_total(decode, "pdserve_kv_transfer_bytes_total")
            assert completion_tokens(s.url, prompt, MAX_TOKENS, stream=bool(i % 2)) == colocated(prompt), i
            pulled = metric_total(decode, "pdserve_kv_transfer_bytes_total") - before
            assert pulled == _ideal_bytes(len(prompt), tp), (i, pulled, _ideal_bytes(len(prompt), tp))
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0  # really disaggregated
        # A prompt that ends mid-block: pulled, its last block at most padded to the finer block size.
        prompt = random_prompt(9, 37)
        before = metric_total(decode, "pdserve_kv_transfer_bytes_total")
        assert completion_tokens(s.url, prompt, MAX_TOKENS, stream=False) == colocated(prompt)
        pulled = metric_total(decode, "pdserve_kv_transfer_bytes_total") - before
        assert _ideal_bytes(37, tp) <= pulled <= _ideal_bytes(40, tp), pulled
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0
        assert info(s.prefill[0]).kv_blocks_pinned == 0
