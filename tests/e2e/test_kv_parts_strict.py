"""End to end: a KV part that fails to pull under the router's strict mode (``--enforce-disagg``) fails the
request with a clear error; without it the decode worker recomputes the prompt (real routers, workers, NIXL).

The decode worker corrupts every KV block it pulls after its first pull (``PDSERVE_FAULT_INJECT=kv_corrupt:1``;
the routers skip the pair probe, so the first pull is the first request's first part): that part passes its
digest check, the next pull fails it (on this machine the parts that queued behind the first pull, so that pull
reads several). So the first strict request fails mid-stream, after its first pull went in; the second at its
first pull. Both fail (502, or an error event after the first token), nothing is prefilled on
the decode worker, and neither worker keeps a block. Through the lenient router the same failure falls back:
the decode worker prefills the prompt, and the tokens equal the colocated engine's.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.launch.spawn import Daemon, start_router, stop_router
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import PREFILL_ARGS, completion_tokens, http_post, info, metric_total, random_prompt, stack

pytestmark = pytest.mark.slow

CHUNK = 8
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("ckpt"))
    return str(directory)


def _complete(url: str, prompt: list[int], stream: bool, request_id: str) -> tuple[int, str]:
    """Status and body of a greedy completion (each token's id in its logprobs: a token is never held back)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    response = http_post(f"{url}/v1/completions", json=body, timeout=120, headers={"X-Request-Id": request_id})
    return response.status_code, response.text


def _answered(capfd: pytest.CaptureFixture[str], request_id: str) -> str:
    """The router's log line (its stderr, this test's) about the error it answered ``request_id`` with: the
    decode worker's reason, which the client does not get."""
    (line,) = [line for line in capfd.readouterr().err.splitlines() if f"request {request_id} answered " in line]
    return line


def _counts(prefill: Daemon, decode: Daemon) -> dict[str, float]:
    return {"parts": metric_total(prefill, "pdserve_requests_total", 'outcome="kv_part"'),
            "pulled": metric_total(decode, "pdserve_kv_transfer_seconds_count"),
            "corrupt": metric_total(decode, "pdserve_kv_integrity_failures_total"),
            "pull_required": metric_total(decode, "pdserve_requests_total", 'outcome="pull_required"'),
            "recomputed": metric_total(decode, "pdserve_local_recompute_fallbacks_total")}


def _moved(before: dict[str, float], prefill: Daemon, decode: Daemon) -> dict[str, float]:
    after = _counts(prefill, decode)
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def _settled(prefill: Daemon, decode: Daemon, free_at_start: int, timeout_s: float = 20.0) -> tuple[int, ...]:
    """(blocks pinned on the prefill worker, blocks not free, requests on the decode worker), once all are 0
    or in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        p, d = info(prefill), info(decode)
        left = (p.kv_blocks_pinned, free_at_start - d.kv_blocks_free, d.num_running + d.num_waiting)
        if not any(left) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_a_failing_part_fails_a_strict_request_and_falls_back_otherwise(checkpoint: str,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capfd: pytest.CaptureFixture[str]) -> None:
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", dtype="float32", num_kv_blocks=128,
                                    max_num_batched_tokens=CHUNK, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("PDSERVE_FAULT_INJECT", "kv_corrupt:1")  # the prefill worker ignores it
    monkeypatch.delenv("PDSERVE_ENFORCE_DISAGG", raising=False)
    prefill_args = (*PREFILL_ARGS, "--max-num-batched-tokens", str(CHUNK))
    with stack(checkpoint, 1, 1, "--enforce-disagg", "--no-pair-probe", prefill_args=prefill_args) as s:
        (prefill,), (decode,) = s.prefill, s.decode
        free_at_start = info(decode).kv_blocks_free
        lenient = start_router(checkpoint, [prefill.address], [decode.address], "--no-pair-probe")
        try:
            # 45 tokens: 5 parts and the final ticket. The first pull goes in; the next one is corrupted on the way.
            before = _counts(prefill, decode)
            capfd.readouterr()  # what the stack logged so far
            status, text = _complete(s.url, random_prompt(1, 45), stream=False, request_id="strict-json")
            assert status == 502, text
            error = httpx.Response(status, text=text).json()["error"]
            assert error["code"] == "disaggregation_failed" and "--enforce-disagg" in error["message"], error
            assert "KV pull of tokens" not in text and prefill.address not in text  # the reason is the log's
            line = _answered(capfd, "strict-json")
            failed = re.search(r"KV pull of tokens (\d+)\.\.(\d+)", line)
            assert failed and int(failed[1]) > 0 and "digest" in line, line
            # The prefill worker issued every part regardless; the decode worker refused, recomputing nothing.
            assert _moved(before, prefill, decode) == {"parts": 5, "pulled": 1, "corrupt": 1, "pull_required": 1}
            assert _settled(prefill, decode, free_at_start) == (0, 0, 0)

            # Streamed: the first token is out before the first part's pull fails; then an error event, never a
            # recomputed token.
            prompt = random_prompt(2, 45)
            before = _counts(prefill, decode)
            status, text = _complete(s.url, prompt, stream=True, request_id="strict-stream")
            assert status == 200 and "disaggregation_failed" in text and "KV pull of tokens" not in text, text
            assert "KV pull of tokens 0.." in _answered(capfd, "strict-stream")
            reference = engine.generate([prompt], params)[0].token_ids
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
            tokens = [t for e in events for c in e.get("choices", []) for t in c["logprobs"]["tokens"]]
            assert tokens == [f"token_id:{reference[0]}"], text  # the first token only, never a recomputed one
            assert events[-1]["error"]["code"] == "disaggregation_failed"
            assert _moved(before, prefill, decode) == {"parts": 5, "corrupt": 1, "pull_required": 1}
            assert _settled(prefill, decode, free_at_start) == (0, 0, 0)

            # Without --enforce-disagg: the decode worker drops what it pulled, reads the parts to the last and
            # prefills the prompt plus the first token itself.
            prompt = random_prompt(3, 45)  # a fresh one: the prefill worker's cache holds the last
            before = _counts(prefill, decode)
            assert completion_tokens(lenient.url, prompt, MAX_TOKENS, stream=False) == \
                engine.generate([prompt], params)[0].token_ids
            assert _moved(before, prefill, decode) == {"parts": 5, "corrupt": 1, "recomputed": 1}
            assert _settled(prefill, decode, free_at_start) == (0, 0, 0)
        finally:
            stop_router(lenient)
