"""End to end with prefill and decode workers of different KV dtypes: router + workers as processes.

A float32-KV prefill worker and an fp8_e4m3-KV decode worker: the prefill worker quantizes every ticket into its
staging area (the router tells it the decode worker's compat hash) and, for such a reader, prefills over K/V
rounded through e4m3 as an FP8 cache holds them (``engine.attention.kv_rounding``), so the greedy tokens are the
colocated FP8-KV engine's, every request is pulled, and the bytes pulled are a quarter of a float32 pair's. The
reverse pair (fp8 prefill, float32 decode: the decode worker dequantizes on read) is served too: its first token
is the FP8 prefill's, the rest is decoded over KV the float32 engine would hold only in part, so its greedy
agreement with both colocated engines is measured and printed, not required. The values themselves are exact:
tests/integration/test_kv_transfer_fp8_pairs.py. A decode worker that cannot convert (another block size) is
listed on ``/health`` as unpaired, with the reason.
"""

from __future__ import annotations

import random

import pytest

from services.launch.spawn import daemons, start_router, stop_router
from tests.checkpoints import ColocatedReference, make_checkpoint
from tests.e2e.stack import completion_tokens, http_get, info, metric_total, pull_totals

MAX_TOKENS = 8
SAME = ("--kv-layout", "cross_layer", "--block-size", "4", "--num-kv-blocks", "256", "--max-num-seqs", "16",
        "--dtype", "float32", "--kv-staging-mib", "16")
FP8 = ("--kv-cache-dtype", "fp8_e4m3")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return str(directory)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(4848)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(17, 41))] for _ in range(5)]


def _serve(model: str, prompts: list[list[int]], prefill: tuple[str, ...], decode: tuple[str, ...],
           unservable: tuple[str, ...] | None = None) -> tuple[list[list[int]], dict[str, float], dict]:
    """Greedy tokens through a router, a prefill and a decode worker (and an ``unservable`` decode worker, which
    must take no request), what the decode worker pulled, and ``/health``."""
    specs = [("prefill", model, prefill), ("decode", model, decode)]
    specs += [("decode", model, unservable)] if unservable else []
    with daemons(*specs) as started:
        p, d, *other = started
        router = start_router(model, [p.address], [x.address for x in (d, *other)])
        try:
            before = pull_totals(d)
            tokens = [completion_tokens(router.url, x, MAX_TOKENS, stream=bool(i % 2)) for i, x in enumerate(prompts)]
            after = pull_totals(d)
            health = http_get(f"{router.url}/health", timeout=10).json()
            assert info(p).kv_blocks_pinned == 0  # every ticket was read and released
            for x in other:
                assert metric_total(x, "pdserve_requests_total", 'outcome="finished"') == 0
        finally:
            stop_router(router)
        health["addresses"] = [x.address for x in started]
        return tokens, {k: after[k] - before[k] for k in after}, health


def _agreement(name: str, tokens: list[list[int]], model: str, prompts: list[list[int]]) -> dict[str, list]:
    """Each colocated engine's tokens (FP8 KV, float32 KV), with how many completions and tokens agree, printed."""
    out = {}
    for kv in ("fp8_e4m3", "auto"):
        reference = ColocatedReference(model, kv_cache_dtype=kv).many(prompts, MAX_TOKENS)
        same = sum(a == b for a, b in zip(tokens, reference, strict=True))
        lead = sum(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), MAX_TOKENS)
                   for a, b in zip(tokens, reference, strict=True))
        print(f"{name} vs colocated {'fp8_e4m3' if kv != 'auto' else 'float32'} KV: {same}/{len(prompts)} greedy "
              f"completions identical, {lead}/{len(prompts) * MAX_TOKENS} tokens before the first difference")
        out[kv] = reference
    return out


def test_float32_prefill_quantizes_for_an_fp8_decode_worker(model: str, prompts: list[list[int]]) -> None:
    tokens, pulled, health = _serve(model, prompts, SAME, (*SAME, *FP8),
                                    unservable=(*SAME, *FP8, "--block-size", "8"))
    assert pulled["pulls"] == len(prompts) and pulled["recomputed"] == 0
    reference = _agreement("float32 prefill + fp8 decode", tokens, model, prompts)
    assert tokens == reference["fp8_e4m3"], "a float32 prefill for an FP8 reader must give the FP8 engine's tokens"
    assert tokens != reference["auto"], "the FP8 and float32 engines agree: the check above tells nothing"
    workers = {w["address"]: w for w in health["workers"]}
    reason = workers[health["addresses"][2]]["unpaired_reason"]
    assert "dtype prefill float32 vs decode float8_e4m3fn converts only through staging, which needs equal block " \
           "sizes: block_size prefill 4 vs decode 8" in reason, reason
    assert "unpaired_reason" not in workers[health["addresses"][1]]

    _, same, _ = _serve(model, prompts, SAME, SAME)
    assert same["pulls"] == len(prompts) and pulled["bytes"] > 0 and pulled["bytes"] * 4 == same["bytes"], \
        (pulled, same)


def test_fp8_prefill_is_dequantized_by_a_float32_decode_worker(model: str, prompts: list[list[int]]) -> None:
    tokens, pulled, _ = _serve(model, prompts, (*SAME, *FP8), SAME)
    assert pulled["pulls"] == len(prompts) and pulled["recomputed"] == 0
    reference = _agreement("fp8 prefill + float32 decode", tokens, model, prompts)
    assert [t[0] for t in tokens] == [t[0] for t in reference["fp8_e4m3"]]  # the prefill worker's first token
