"""The host KV tier end to end (CPU, real daemons, real NIXL, the router's HTTP API).

The prefill worker's device pool holds one prompt at most: a second prompt pushes the first out,
so when the first comes back its prefix is found in the host tier, loaded back to compute the
rest, and the decode worker reads that prefix straight from the prefill worker's host memory
(the ticket names host blocks; a metric counts the bytes). The answer must be the same tokens, those
of the model run colocated, ``usage.prompt_tokens_details.cached_tokens`` must report the prefix, and
nothing may stay pinned afterwards on either tier. The model is a small random checkpoint whose
tokens depend on the whole context (``tests/unit/test_context_checkpoint.py``), so KV that is wrong
or missing changes them; a Qwen3-MoE and a gpt-oss checkpoint (routed experts; sinks and a sliding-window
group) go the same way once.
"""

from __future__ import annotations

import time

import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import http_post, metric_total, stack

pytestmark = pytest.mark.slow

# Ids below the checkpoint's vocabulary (320); the two prompts share no prefix.
PROMPT = [(7 * i + 3) % 300 + 10 for i in range(300)]
OTHER = [(11 * i + 5) % 300 + 10 for i in range(300)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))
    return str(directory)


@pytest.fixture(scope="module")
def colocated(model: str) -> list[int]:
    """PROMPT's greedy tokens from one engine doing prefill and decode (float32, as the workers run)."""
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=64))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.generate([PROMPT], params)[0].token_ids


def _complete(url: str, prompt: list[int]) -> tuple[list[int], int]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True, "ignore_eos": True}
    response = http_post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    answer = response.json()
    tokens = [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]
    return tokens, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _eventually(check, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


# (factor, decode block size): the decode side's blocks may be coarser than a span, so the host
# part of a pull can end inside one of its blocks (the device part's READ writes the rest).
@pytest.mark.parametrize(("factor", "decode_block_size"), [(1, 32), (2, 16), (4, 16)])
def test_repeated_prompt_is_served_from_the_host_tier(model: str, colocated: list[int], factor: int,
                                                      decode_block_size: int) -> None:
    prefill_args = ("--block-size", "16", "--num-kv-blocks", "24", "--kv-offload-gib", "0.02",
                    "--kv-offload-block-factor", str(factor), "--dtype", "float32")
    # The decode worker's pool also holds one prompt, so its own prefix cache does not keep PROMPT.
    decode_args = ("--block-size", str(decode_block_size), "--num-kv-blocks", str(384 // decode_block_size),
                   "--kv-layout", "per_layer", "--dtype", "float32")
    with stack(model, prefill_args=prefill_args, decode_args=decode_args) as s:
        (prefill,), (decode,) = s.prefill, s.decode
        first, first_cached = _complete(s.url, PROMPT)
        # The stores of PROMPT's spans finish in the background; then OTHER evicts it from the device.
        _eventually(lambda: metric_total(prefill, "pdserve_kv_offload_spans", 'state="cached"') >= 300 // (16 * factor))
        _complete(s.url, OTHER)
        again, cached = _complete(s.url, PROMPT)

        assert first_cached == 0 and again == first
        assert first == colocated
        span = 16 * factor
        assert cached == (len(PROMPT) - 1) // span * span
        # The workers publish the engine's counts as they come (every few milliseconds).
        host_hits = 'result="hit",role="prefill",tier="host"'  # labels as /metrics orders them
        _eventually(lambda: metric_total(prefill, "pdserve_kv_prefix_lookups_total", host_hits) == 1)
        assert metric_total(prefill, "pdserve_kv_prefix_cached_tokens_total", 'tier="host"') > 0
        assert metric_total(prefill, "pdserve_kv_offload_bytes_total", 'direction="load"') > 0
        assert metric_total(decode, "pdserve_kv_transfer_source_bytes_total", 'source="host"') > 0
        # Nothing stays pinned: held device blocks and pinned host spans are freed on notification.
        _eventually(lambda: metric_total(prefill, "pdserve_kv_blocks", 'state="pinned_for_transfer"') == 0
                    and metric_total(prefill, "pdserve_kv_offload_spans", 'state="used"') == 0
                    and metric_total(prefill, "pdserve_kv_offload_queue_depth") == 0)
        assert metric_total(prefill, "pdserve_kv_lease_expiries_total") == 0
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_moe_prompt_is_served_from_the_host_tier(tmp_path_factory, arch: str) -> None:
    """Qwen3-MoE (routed experts, q/k norms) and gpt-oss (sinks, a sliding-window group beside the full one): the
    experts change nothing on either tier; the prompt served again from the host tier gives the colocated engine's
    tokens and its decode worker reads the prefix from host memory."""
    directory, _ = make_checkpoint(arch, tmp_path_factory.mktemp(arch))
    model = str(directory)
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=64))
    colocated = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                         ignore_eos=True))[0].token_ids
    engine.close()
    prefill_args = ("--block-size", "16", "--num-kv-blocks", "24", "--kv-offload-gib", "0.02",
                    "--kv-offload-block-factor", "2", "--dtype", "float32")
    decode_args = ("--block-size", "16", "--num-kv-blocks", "24", "--kv-layout", "per_layer", "--dtype", "float32")
    with stack(model, prefill_args=prefill_args, decode_args=decode_args) as s:
        (prefill,), (decode,) = s.prefill, s.decode
        first, _ = _complete(s.url, PROMPT)
        _eventually(lambda: metric_total(prefill, "pdserve_kv_offload_spans", 'state="cached"') >= 300 // 32)
        _complete(s.url, OTHER)
        again, cached = _complete(s.url, PROMPT)
        assert first == again == colocated and cached == (len(PROMPT) - 1) // 32 * 32
        assert metric_total(decode, "pdserve_kv_transfer_source_bytes_total", 'source="host"') > 0
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0
