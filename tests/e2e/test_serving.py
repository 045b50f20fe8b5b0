"""End to end: router + prefill + decode processes, HTTP in, tokens out.

Greedy completions through the disaggregated stack must be token-identical to the same engine run
colocated, streaming and not, for prompts spanning several blocks and hitting the prefix cache; 32
concurrent requests all complete correctly; afterwards no block is pinned on any prefill worker. Behind an API
key, what the router shows without it (/health, /metrics) and what a client reads when a worker dies name no
worker.
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import Stack, completion_tokens, finished_requests, http_client, info, metric_total, stack

MAX_TOKENS = 10
API_KEY = "e2e-key"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))
    return str(directory)


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(24)]  # a common prefix: prefix-cache hits
    return [shared[: rng.randrange(8, 24)] + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]
            for _ in range(n)]


@pytest.fixture(scope="module")
def colocated(model: str):
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=512))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    cache: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = engine.generate([prompt], params)[0].token_ids
        return cache[key]

    return reference


def _wait_unpinned(daemons, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        pinned = [info(d).kv_blocks_pinned for d in daemons]
        if not any(pinned) or time.monotonic() > deadline:
            return pinned
        time.sleep(0.1)


@pytest.fixture(scope="module")
def served(request, model: str) -> Iterator[Stack]:
    """A stack of ``request.param`` = (prefill workers, decode workers); tests asking for the same split share it."""
    num_prefill, num_decode = request.param
    with stack(model, num_prefill, num_decode) as s:
        yield s


def _wait_idle(daemons, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(i.num_running or i.num_waiting or i.kv_blocks_pinned for i in map(info, daemons)):
        assert time.monotonic() < deadline, "the workers did not go idle"
        time.sleep(0.1)


@pytest.mark.parametrize("served", [(1, 1), (2, 2)], ids=["1P1D", "2P2D"], indirect=True)
def test_disaggregated_equals_colocated(colocated, served: Stack) -> None:
    s, num_prefill = served, len(served.prefill)
    # The stack may have served another test's requests: what this test checks on the workers is what it adds.
    finished = [finished_requests(d) for d in s.decode]
    pulled = [metric_total(d, "pdserve_kv_transfer_bytes_total") for d in s.decode]
    recomputed = sum(metric_total(d, "pdserve_local_recompute_fallbacks_total") for d in s.decode)
    prompts = _prompts(6)
    for prompt in prompts:  # sequential: later prompts hit the prefix cache of earlier ones
        for stream in (False, True):
            assert completion_tokens(s.url, prompt, MAX_TOKENS, stream) == colocated(prompt)

    # The same prompt again: a prefill worker that saw it serves all but its last block from its
    # prefix cache (with two prefill workers, after one round each).
    with http_client(timeout=60) as client:
        for _ in range(num_prefill):
            usage = client.post(f"{s.url}/v1/completions", json={
                "prompt": prompts[-1], "max_tokens": 2, "temperature": 0}).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(prompts[-1]) - 4

    many = _prompts(32, seed=11)
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: completion_tokens(s.url, p[1], MAX_TOKENS, p[0] % 2 == 0),
                                enumerate(many)))
    for prompt, tokens in zip(many, results, strict=True):
        assert tokens == colocated(prompt)
    assert _wait_unpinned(s.prefill) == [0] * num_prefill
    # Every worker took part (least-outstanding pairing spreads the load), as its /metrics says.
    assert all(finished_requests(d) > n for d, n in zip(s.decode, finished, strict=True))
    # Disaggregated for real: every decode worker pulled KV, and none recomputed a prompt instead.
    assert all(metric_total(d, "pdserve_kv_transfer_bytes_total") > n for d, n in zip(s.decode, pulled, strict=True))
    assert sum(metric_total(d, "pdserve_local_recompute_fallbacks_total") for d in s.decode) == recomputed


@pytest.mark.parametrize("served", [(1, 1)], ids=["1P1D"], indirect=True)
def test_bad_requests_get_openai_errors_and_touch_no_worker(served: Stack) -> None:
    s = served
    with http_client(timeout=60) as client:
        _wait_idle(s.prefill + s.decode)  # the stack may have just served another test's requests
        before = [info(d) for d in s.prefill + s.decode]
        url = f"{s.url}/v1/completions"
        cases = [
            (client.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400),
            (client.post(url, content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"}), 400),
            (client.post(url, json={"max_tokens": 4}), 400),  # no prompt
            (client.post(url, json={"prompt": "hi", "max_tokens": "four"}), 400),
            (client.post(url, json={"prompt": [5, 6], "max_tokens": -1}), 400),
            (client.post(url, json={"prompt": [5] * 600, "max_tokens": 4}), 400),  # over the context
            (client.post(url, json={"prompt": [5, 6], "max_tokens": 4, "model": "no-such-model"}), 404),
        ]
        for response, status in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["message"] and error["type"]
        after = [info(d) for d in s.prefill + s.decode]
        for b, a in zip(before, after, strict=True):
            assert (a.num_running, a.num_waiting, a.kv_blocks_free) == (b.num_running, b.num_waiting, b.kv_blocks_free)

        # A client's request id comes back, and is in the id the workers got (the answer's id).
        response = client.post(url, json={"prompt": [5, 6], "max_tokens": 2}, headers={"X-Request-Id": "e2e-trace-7"})
        assert response.status_code == 200 and response.headers["x-request-id"] == "e2e-trace-7"
        assert response.json()["id"].startswith("cmpl-e2e-trace-7-")


# ---- behind an API key: what the router shows without it, and a dead worker's error ---------------------------


def test_behind_an_api_key_nothing_the_router_shows_names_a_worker(model: str,
                                                                    capfd: pytest.CaptureFixture[str]) -> None:
    """Without the key, /health is the status alone and /metrics labels workers by id, not address. Then the
    decode worker is stopped, two requests (streamed, not) go to it, and it is killed: each ends with an error in
    OpenAI's format (a status, or an error event after the first token) that names neither a worker nor gRPC's
    text; the router's log (its stderr, captured here: the stack starts inside the test) has both, under the
    request's id."""
    with stack(model, 1, 1, "--api-key", API_KEY) as s, http_client(timeout=120) as client:
        anonymous = client.get(f"{s.url}/health")
        keyed = client.get(f"{s.url}/health", headers={"Authorization": f"Bearer {API_KEY}"})
        metrics = client.get(f"{s.url}/metrics").text
        assert (anonymous.status_code, anonymous.json()) == (200, {"status": "ok"})
        workers = {w["address"]: w for w in keyed.json()["workers"]}
        assert set(workers) == {d.address for d in s.prefill + s.decode}
        for d in s.prefill + s.decode:
            assert not re.search(rf":{d.port}\b", metrics), d.address
        (decode,) = s.decode
        worker_id = workers[decode.address]["worker"]
        assert f'pdserve_router_worker_outstanding_requests{{role="decode",worker="{worker_id}"}}' in metrics

        decode.proc.send_signal(signal.SIGSTOP)  # the router still counts it healthy for its health timeout (1 s)
        try:
            def complete(stream: bool) -> httpx.Response:
                body = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13], "max_tokens": MAX_TOKENS, "stream": stream}
                return client.post(f"{s.url}/v1/completions", json=body, headers={
                    "X-Request-Id": f"dead-{stream}", "Authorization": f"Bearer {API_KEY}"})

            with ThreadPoolExecutor(2) as pool:
                answers = [pool.submit(complete, stream) for stream in (False, True)]
                time.sleep(0.5)  # both are on their way to the stopped worker
                decode.proc.kill()
                whole, streamed = (a.result() for a in answers)
        finally:
            decode.proc.kill()
            decode.proc.wait()
    assert whole.status_code in (502, 503), whole.text
    errors = [whole.json()["error"]]
    if streamed.status_code == 200:
        events = [e.removeprefix("data: ") for e in streamed.text.split("\n\n") if e]
        assert events[-1] == "[DONE]", events
        errors.append(json.loads(events[-2])["error"])
    else:
        assert streamed.status_code in (502, 503), streamed.text
        errors.append(streamed.json()["error"])
    for error in errors:
        assert error["code"] in ("worker_unavailable", "worker_failure", "no_healthy_workers"), error
    for text in (whole.text, streamed.text, json.dumps(errors)):
        assert "127.0.0.1" not in text, text
        assert not re.search(r"StatusCode|UNAVAILABLE|INTERNAL|Socket|ipv4|failed to connect", text), text
    assert str(decode.port) not in json.dumps(errors), errors
    log = capfd.readouterr().err
    for stream in (False, True):
        (line,) = [line for line in log.splitlines() if f"request dead-{stream} answered " in line]
        assert decode.address in line, line
