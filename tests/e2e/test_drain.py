"""End to end: the workers' preStop command (``pdserve drain``, run as the kubelet runs it) on real workers.

- A decode worker (fixed role) with a short drain bound and running streams, beside a second decode worker behind
  a real router: the command returns once the worker runs nothing; past the bound its streams were migrated and
  the router finished them on the other worker, every output equal to an undisturbed greedy run, none failed.
  The worker then stays up, NOT_SERVING, until the SIGTERM that follows stops it at once.
- A prefill worker (started with --role-switching) holding unpulled tickets: the drain waits (blocks pinned, new
  prompts refused, a SIGTERM during it joins it), a ticket is still pulled during the drain, and only the last
  ticket's release ends the command and the worker.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launch.spawn import daemons, start_router, stop_router
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import ColocatedReference, colocated_reference, make_checkpoint
from tests.e2e.stack import (
    DECODE_ARGS,
    PREFILL_ARGS,
    hold_ticket,
    http_client,
    http_get,
    info,
    metric_total,
    random_prompt,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2-drain"))
    return str(directory)


@pytest.fixture(scope="module")
def reference(model: str) -> ColocatedReference:
    return colocated_reference(model)


def _drain_command(port: int, *args: str) -> subprocess.Popen:
    """``pdserve drain`` as a preStop hook runs it: its own process, dialing the worker on 127.0.0.1."""
    return subprocess.Popen([sys.executable, "-m", "services.cli", "drain", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _wait(what: str, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _probed_pairs(url: str) -> int:
    pairs = http_get(f"{url}/health", timeout=10).json().get("pairs", [])
    return sum(p["state"] == "probed" for p in pairs)


def _migrated(url: str) -> float:
    text = http_get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_router_migrated_requests_total "))


def _stream(url: str, prompt: list[int], max_tokens: int, started: threading.Event) -> list[int]:
    """Greedy streamed completion through the router; ``started`` is set once a few tokens arrived. An error
    event fails with the event itself."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 0,
            "return_tokens_as_token_ids": True, "ignore_eos": True}
    tokens: list[int] = []
    with http_client(timeout=120) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "choices" not in event:
                    raise AssertionError(f"error event in the stream: {event}")
                choice = event["choices"]
                if choice and choice[0].get("logprobs"):
                    tokens += [int(t.removeprefix("token_id:")) for t in choice[0]["logprobs"]["tokens"]]
                    if len(tokens) >= 4:
                        started.set()
    return tokens


def test_decode_drain_migrates_running_streams_token_exact(model, reference) -> None:
    specs = [("prefill", model, PREFILL_ARGS), ("decode", model, (*DECODE_ARGS, "--drain-timeout-s", "0.2")),
             ("decode", model, DECODE_ARGS)]
    with daemons(*specs) as (prefill, victim, other):
        router = start_router(model, [prefill.address], [victim.address, other.address])
        try:
            url = router.url
            _wait("both pairs to be probed", lambda: _probed_pairs(url) == 2)
            migrated_before = _migrated(url)
            prompts = [random_prompt(100 + i) for i in range(6)]
            max_tokens = 480  # prompt + output within the checkpoint's 512 positions; long past the drain's bound
            started = [threading.Event() for _ in prompts]
            with ThreadPoolExecutor(len(prompts)) as pool:
                streams = [pool.submit(_stream, url, p, max_tokens, s) for p, s in zip(prompts, started, strict=True)]
                for event in started:
                    assert event.wait(120), "a stream produced no tokens"
                running = info(victim).num_running
                assert running > 0, "no request runs on the worker to drain: the test would prove nothing"
                command = _drain_command(victim.port, "--timeout-s", "60")
                out, err = command.communicate(timeout=90)
                after = info(victim)  # right when the command returned: nothing may run there any more
                outputs = [s.result(timeout=120) for s in streams]
            assert command.returncode == 0, err
            answer = json.loads(out)
            assert answer["drained"] and answer["role"] == "decode" and answer["num_left"] == 0
            assert (after.num_running, after.num_waiting) == (0, 0) and after.draining
            assert answer["num_migrated"] >= 1  # the 0.2 s bound ran out with streams of 480 tokens running
            for prompt, tokens, expected in zip(prompts, outputs, reference.many(prompts, max_tokens), strict=True):
                assert tokens == expected, prompt
            assert _migrated(url) - migrated_before == answer["num_migrated"]
            assert metric_total(victim, "pdserve_requests_total", 'outcome="migrated"') == answer["num_migrated"]
            # Drained, not stopped: NOT_SERVING until the SIGTERM that follows, which stops it at once.
            assert _health(victim.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert victim.proc.poll() is None
            assert _drain_command(victim.port).wait(timeout=30) == 0  # a second drain: the same one, done
            victim.proc.send_signal(signal.SIGTERM)
            assert victim.proc.wait(timeout=15) == 0
        finally:
            stop_router(router)


def test_prefill_drain_waits_for_unpulled_tickets(model, reference) -> None:
    prefill_args = (*PREFILL_ARGS, "--role-switching", "--kv-lease-s", "120", "--drain-timeout-s", "120")
    params = worker_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = {"held-pulled": random_prompt(7, 28), "held-released": random_prompt(8, 28)}
    with daemons(("prefill", model, prefill_args), ("decode", model, DECODE_ARGS)) as (prefill, decode), \
            grpc.insecure_channel(prefill.address) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        tickets = {}
        for rid, prompt in prompts.items():
            tickets[rid] = hold_ticket(stub, rid, prompt, params)
        pinned = info(prefill).kv_blocks_pinned
        assert pinned > 0
        command = _drain_command(prefill.port, "--timeout-s", "90")
        time.sleep(1.5)
        # Draining for its tickets: the command waits, nothing is freed, new prompts are refused.
        assert command.poll() is None
        now = info(prefill)
        assert now.draining and now.kv_blocks_pinned == pinned
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prefill(worker_pb2.PrefillRequest(request_id="late", prompt_token_ids=random_prompt(9), params=params),
                         timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # The SIGTERM the kubelet sends when a hook outlasts its time joins the same drain: nothing stops yet.
        prefill.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert prefill.proc.poll() is None and command.poll() is None
        assert info(prefill).kv_blocks_pinned == pinned
        # A ticket out is still pulled during the drain (no recompute), and the other one keeps the drain going.
        with grpc.insecure_channel(decode.address) as decode_channel:
            chunks = list(worker_pb2_grpc.DecodeWorkerStub(decode_channel).Generate(
                worker_pb2.GenerateRequest(request_id="held-pulled", prompt_token_ids=prompts["held-pulled"],
                                           params=params, ticket=tickets["held-pulled"], require_pull=True),
                timeout=30))
        assert [t for c in chunks for t in c.token_ids] == reference(prompts["held-pulled"], 8)
        assert not any(c.recomputed_locally for c in chunks)
        _wait("the pulled ticket's blocks to be freed", lambda: info(prefill).kv_blocks_pinned < pinned)
        assert info(prefill).kv_blocks_pinned > 0 and command.poll() is None and prefill.proc.poll() is None
        assert metric_total(prefill, "pdserve_kv_lease_expiries_total") == 0  # nothing freed by the lease
        stub.Release(worker_pb2.ReleaseRequest(request_id="held-released"), timeout=10)
        out, err = command.communicate(timeout=30)
        assert prefill.proc.wait(timeout=15) == 0  # the SIGTERM's stop, once drained
    assert command.returncode == 0, err
    answer = json.loads(out)
    assert answer["drained"] and answer["role"] == "prefill" and answer["num_left"] == 0
