"""Requests whose K/V a 16-bit (here float32) KV cache rounds through e4m3 (``attention.kv_rounding``) on CPU.

A prefill worker with an unquantized cache serving an FP8-KV decode worker rounds that request's K/V as an FP8
cache would, so the decode worker continues exactly where a colocated FP8-KV engine would have. Here the whole
request runs on one engine: a float32-KV engine whose requests are all rounded gives the FP8-KV engine's greedy
tokens and logits (dense attention and DeepSeek's latent rows, scales that differ per layer and between K and V),
and not the plain float32 engine's; in a step that mixes rounded and plain requests each gets its own engine's
tokens; rounded and plain requests never share prefix-cache blocks; a bad dtype is a clear error and an FP8 cache
ignores the flag (it stores the rounded values anyway).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.loading.source import resolve_model
from tests.checkpoints import make_checkpoint

FP8 = "float8_e4m3fn"
NUM_TOKENS = 12
PROMPTS = [[(7 * i + 3 * n) % 300 + 10 for i in range(n)] for n in (5, 19, 37, 26)]
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
SCALES = {"llama": {0: (0.37, 1.7), 1: (1.3, 0.23)}, "deepseek_v3": {0: (0.61, 1.0), 1: (1.45, 1.0), 2: (0.29, 1.0)}}


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def source(request, tmp_path_factory):
    directory, _ = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return dataclasses.replace(resolve_model(str(directory)), kv_scales=SCALES[request.param])


def _engine(source, kv_cache_dtype: str = "float32", **kw) -> LLMEngine:
    settings = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=24)
    return LLMEngine(EngineConfig(model=source.name, kv_cache_dtype=kv_cache_dtype, **{**settings, **kw}), source)


def _run(engine: LLMEngine, rounded: list[bool], prompts=PROMPTS, tag: str = "r"):
    """Every prompt added at once (``rounded[i]``: its K/V rounded through FP8), stepped to the end."""
    requests = [engine.add_request(f"{tag}{i}", p, GREEDY, kv_rounding=FP8 if r else "")
                for i, (p, r) in enumerate(zip(prompts, rounded, strict=True))]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return requests, [finals[r.request_id] for r in requests]


def _logits(out) -> torch.Tensor:
    return torch.cat([chunk for _, chunk in out.logits])


def test_rounded_requests_are_the_fp8_engines(source) -> None:
    _, fp8 = _run(_engine(source, "fp8_e4m3"), [False] * len(PROMPTS))
    _, plain = _run(_engine(source), [False] * len(PROMPTS))
    _, rounded = _run(_engine(source), [True] * len(PROMPTS))
    assert [o.token_ids for o in rounded] == [o.token_ids for o in fp8]
    for a, b in zip(rounded, fp8, strict=True):
        assert torch.allclose(_logits(a), _logits(b), rtol=0, atol=1e-5)
    differs = max(float((_logits(a) - _logits(b)).abs().max()) for a, b in zip(rounded, plain, strict=True))
    assert differs > 1e-3, "rounding through e4m3 must change the logits (else the test sees nothing)"


def test_a_mixed_step_rounds_only_its_rounded_requests(source) -> None:
    _, fp8 = _run(_engine(source, "fp8_e4m3"), [False] * len(PROMPTS))
    _, plain = _run(_engine(source), [False] * len(PROMPTS))
    mixed = [True, False, True, False]
    _, out = _run(_engine(source, max_num_batched_tokens=512), mixed)  # every prompt in one step
    for i, flag in enumerate(mixed):
        want = fp8[i] if flag else plain[i]
        assert out[i].token_ids == want.token_ids, f"prompt {i} (rounded: {flag})"
        assert torch.allclose(_logits(out[i]), _logits(want), rtol=0, atol=1e-5)


def test_rounded_and_plain_requests_share_no_prefix_blocks(source) -> None:
    engine = _engine(source)
    prompt = [PROMPTS[2]]
    _run(engine, [True], prompt, "a")
    requests, _ = _run(engine, [False], prompt, "b")
    assert requests[0].num_cached_tokens == 0, "a plain request was served a rounded request's blocks"
    requests, _ = _run(engine, [True], prompt, "c")
    assert requests[0].num_cached_tokens > 0, "two rounded requests of one prompt should share blocks"


def test_a_bad_rounding_dtype_is_refused_and_an_fp8_cache_ignores_it(source) -> None:
    engine = _engine(source)
    with pytest.raises(ValueError, match="only an FP8 KV dtype"):
        engine.add_request("bad", PROMPTS[0], GREEDY, kv_rounding="bfloat16")
    assert not engine.has_unfinished_requests()
    fp8 = _engine(source, "fp8_e4m3")
    assert fp8.add_request("r", PROMPTS[0], GREEDY, kv_rounding=FP8).kv_rounding == ""
