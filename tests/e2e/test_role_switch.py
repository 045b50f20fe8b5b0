"""End to end: workers started with --role-switching switch roles in place behind a real router.

One stack for the module (three workers, all with the same engine flags): a prefill worker becomes a decode
worker and back under light load with no failed or lost request; a decode worker whose drain runs past its
bound gives its requests back, and the router finishes them on the other decode worker token-exact against an
unswitched greedy run; a prefill worker switching while a ticket of its is unpulled frees nothing early (the
ticket is still pulled fine, then the switch completes); the admin POST refuses without the API key.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from services.launch.spawn import daemons, start_router, stop_router
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import colocated_reference, make_checkpoint
from tests.e2e.stack import DECODE_ARGS, hold_ticket, http_client, http_get, http_post, metric_total, random_prompt

KEY = "role-switch-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WORKER_ARGS = (*DECODE_ARGS, "--role-switching")  # one engine shape for both roles


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2-switch"))
    return str(directory)


@pytest.fixture(scope="module")
def reference(model: str):
    return colocated_reference(model)


@pytest.fixture(scope="module")
def cluster(model: str):
    specs = [("prefill", model, WORKER_ARGS)] * 2 + [("decode", model, WORKER_ARGS)]
    with daemons(*specs) as started:
        prefill = [d.address for d in started if d.role == "prefill"]
        decode = [d.address for d in started if d.role == "decode"]
        router = start_router(model, prefill, decode, "--api-key", KEY)
        try:
            yield router, {d.address: d for d in started}
        finally:
            stop_router(router)


def _roles(url: str) -> dict[str, tuple[str, str]]:
    """address -> (role, state), from GET /admin/workers."""
    body = http_get(f"{url}/admin/workers", headers=AUTH, timeout=10).json()
    return {w["address"]: (w["role"], w["state"]) for w in body["workers"]}


def _wait_healthy(url: str, role: str, count: int, timeout_s: float = 30.0, wanted: str | None = None) -> list[str]:
    """The healthy workers of ``role`` once there are ``count`` (and ``wanted`` is among them), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = [a for a, (r, state) in _roles(url).items() if r == role and state == "healthy"]
        if (len(ready) >= count and wanted in (None, *ready)) or time.monotonic() > deadline:
            return ready
        time.sleep(0.2)


def _switch(url: str, worker: str, role: str, drain_timeout_s: float = 0.0) -> httpx.Response:
    return http_post(f"{url}/admin/workers/{worker}/role", headers=AUTH, timeout=120,
                     json={"role": role, "drain_timeout_s": drain_timeout_s})


def _migrated(url: str) -> float:
    """The router's pdserve_router_migrated_requests_total."""
    text = http_get(f"{url}/metrics", headers=AUTH, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_router_migrated_requests_total "))


def _stream(url: str, prompt: list[int], max_tokens: int, started: threading.Event | None = None) -> list[int]:
    """Greedy streamed completion; ``started`` is set once a few tokens arrived."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 0,
            "return_tokens_as_token_ids": True, "ignore_eos": True}
    tokens: list[int] = []
    with http_client(timeout=120) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "choices" not in event:  # an error event: say which
                    raise AssertionError(f"error event in the stream: {event}")
                choice = event["choices"]
                if choice and choice[0].get("logprobs"):
                    tokens += [int(t.removeprefix("token_id:")) for t in choice[0]["logprobs"]["tokens"]]
                    if started is not None and len(tokens) >= 4:
                        started.set()
    return tokens


def test_admin_switch_refuses_without_the_key(cluster) -> None:
    router, _ = cluster
    worker = next(iter(_roles(router.url)))
    response = http_post(f"{router.url}/admin/workers/{worker}/role", json={"role": "decode"}, timeout=10)
    assert response.status_code == 401
    wrong = http_post(f"{router.url}/admin/workers/{worker}/role", json={"role": "decode"}, timeout=10,
                      headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401


def test_switch_each_way_under_load_loses_nothing(cluster, reference) -> None:
    router, _ = cluster
    url = router.url
    prefill = sorted(_wait_healthy(url, "prefill", 2))
    assert len(prefill) == 2
    stop = threading.Event()
    results: list[tuple[list[int], list[int]]] = []
    errors: list[BaseException] = []

    def load(seed: int) -> None:
        n = 0
        while not stop.is_set():
            prompt = random_prompt(seed * 1000 + n)
            n += 1
            try:
                results.append((prompt, _stream(url, prompt, 12)))
            except BaseException as e:  # noqa: BLE001 - every failure is reported below
                errors.append(e)

    with ThreadPoolExecutor(2) as pool:
        clients = [pool.submit(load, seed) for seed in (1, 2)]
        time.sleep(0.5)
        to_decode = _switch(url, prefill[1], "decode")
        assert to_decode.status_code == 200, to_decode.text
        assert to_decode.json()["role"] == "decode" and to_decode.json()["previous_role"] == "prefill"
        assert prefill[1] in _wait_healthy(url, "decode", 2, wanted=prefill[1])
        time.sleep(0.5)
        back = _switch(url, prefill[1], "prefill")
        assert back.status_code == 200, back.text
        assert back.json()["epoch"] > to_decode.json()["epoch"]
        assert prefill[1] in _wait_healthy(url, "prefill", 2, wanted=prefill[1])
        time.sleep(0.5)
        stop.set()
        for client in clients:
            client.result()
    assert not errors, errors[:3]
    assert len(results) >= 4
    for prompt, tokens in results:
        assert tokens == reference(prompt, 12)


def test_decode_drain_past_its_bound_migrates_token_exact(cluster, reference) -> None:
    router, workers = cluster
    url = router.url
    # Two decode workers: the original one and a prefill worker switched over (the last prefill one stays).
    prefill = sorted(_wait_healthy(url, "prefill", 2))
    assert _switch(url, prefill[1], "decode").status_code == 200
    decodes = sorted(_wait_healthy(url, "decode", 2))
    assert len(decodes) == 2
    before = _migrated(url)
    prompts = [random_prompt(100 + i) for i in range(6)]
    max_tokens = 300
    started = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = [pool.submit(_stream, url, p, max_tokens, s) for p, s in zip(prompts, started, strict=True)]
        for event in started:
            assert event.wait(60)
        victim = decodes[0]
        switched = _switch(url, victim, "prefill", drain_timeout_s=0.05)
        outputs = [s.result() for s in streams]
    assert switched.status_code == 200, switched.text
    assert switched.json()["num_migrated"] >= 1
    for prompt, tokens, expected in zip(prompts, outputs, reference.many(prompts, max_tokens), strict=True):
        assert tokens == expected, prompt
    assert _migrated(url) - before == switched.json()["num_migrated"]
    assert metric_total(workers[victim], "pdserve_requests_total", 'outcome="migrated"') >= 1


def test_prefill_switch_waits_for_unpulled_tickets(cluster, reference) -> None:
    router, _ = cluster
    url = router.url
    prefill = sorted(_wait_healthy(url, "prefill", 2))
    decode = _wait_healthy(url, "decode", 1)[0]
    owner = prefill[0]
    prompt = random_prompt(7, 28)
    params = worker_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(owner) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        ticket = hold_ticket(stub, "held-ticket", prompt, params)
        switching = stub.SwitchRole.future(worker_pb2.SwitchRoleRequest(role="decode"), timeout=60)
        time.sleep(1.0)
        info = stub.Info(worker_pb2.InfoRequest(), timeout=5)
        # Still draining for its ticket: nothing freed, nothing switched.
        assert not switching.done() and info.role == "prefill" and info.switching_to == "decode"
        assert info.kv_blocks_pinned > 0
        with grpc.insecure_channel(decode) as decode_channel:
            chunks = list(worker_pb2_grpc.DecodeWorkerStub(decode_channel).Generate(
                worker_pb2.GenerateRequest(request_id="held-ticket", prompt_token_ids=prompt, params=params,
                                           ticket=ticket, require_pull=True), timeout=30))
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == reference(prompt, 8)
        assert not any(c.recomputed_locally for c in chunks)
        answer = switching.result(timeout=30)  # the pull freed the ticket: the drain ends
        assert answer.role == "decode" and answer.previous_role == "prefill"
        info = stub.Info(worker_pb2.InfoRequest(), timeout=5)
        assert info.role == "decode" and info.epoch == answer.epoch and info.kv_blocks_pinned == 0
    assert owner in _wait_healthy(url, "decode", 2, wanted=owner)  # the router adopts the switch it did not make


def test_a_worker_dying_mid_switch_is_handled_like_any_dead_worker(cluster) -> None:
    """Last (it kills a worker): the switch's caller gets an error, the router's health checks take the worker
    out, and requests go on without it (here the prefill role is empty: decode workers prefill directly)."""
    router, workers = cluster
    url = router.url
    victim = _wait_healthy(url, "prefill", 1)[0]
    prompt = random_prompt(9, 24)
    params = worker_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(victim) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        hold_ticket(stub, "never-pulled", prompt, params)  # its drain waits for this ticket (a 30 s lease)
        switching = stub.SwitchRole.future(worker_pb2.SwitchRoleRequest(role="decode"), timeout=60)
        time.sleep(0.5)
        assert stub.Info(worker_pb2.InfoRequest(), timeout=5).switching_to == "decode"
        workers[victim].kill()
        with pytest.raises(grpc.RpcError):
            switching.result(timeout=30)
    deadline = time.monotonic() + 30
    while _roles(url)[victim][1] != "unhealthy" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _roles(url)[victim][1] == "unhealthy"
    assert _stream(url, random_prompt(10), 6) and http_get(f"{url}/health", timeout=10).status_code == 200
