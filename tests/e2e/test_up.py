"""`pdserve up` (what `make run` starts): the bundled SmolLM2 behind the router answers a chat request; a worker
killed comes back; with `--api-key` and `--kv-auth-token` it serves only with the key, long prompts too."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from services.common.grpc_auth import METADATA_KEY, bearer
from services.launch.spawn import free_port
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import colocated_tokens, make_checkpoint
from tests.e2e.stack import completion_tokens, http_client, http_get, stop_up


def test_up_serves_the_default_model_and_stops_on_ctrl_c() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        ready = proc.stdout.readline()  # the one line `pdserve up` prints when everything serves
        assert ready.startswith("pdserve up: ready on http://127.0.0.1:"), ready
        url = f"http://127.0.0.1:{port}"
        with http_client(timeout=120) as client:
            assert client.get(f"{url}/health").status_code == 200
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            answer = client.post(f"{url}/v1/chat/completions", json={
                "model": model, "temperature": 0, "max_tokens": 24,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            }).json()
        assert "Paris" in answer["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGINT)  # Ctrl-C stops the router and every worker
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        leftovers = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert not leftovers, f"processes left behind: {leftovers}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- start-up failures and supervision -----------------------------------------------------------

READY = re.compile(r"(?P<role>prefill|decode) (?P<address>[\d.]+:\d+) \(metrics (?P<metrics>[\d.]+:\d+)\)")


def _start_up(*flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True)
    return proc, proc.stdout.readline()




def _metric(url: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in http_get(url, timeout=10).text.splitlines():
        if line.startswith(name) and wanted in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in {url}")


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_up_fails_at_once_with_the_workers_own_message() -> None:
    """SmolLM2 cannot be sharded over 2 ranks: `up` stops within seconds, saying so, not after a timeout."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", str(free_port()), "--prefill-tp",
                             "2", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert "pdserve up: error: prefill worker exited with code 2 during start-up: pdserve: error: tensor-parallel " \
           "size 2 cannot shard this model: 3 KV heads over 2 ranks" in result.stderr
    assert time.monotonic() - started < 60


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A small random checkpoint whose greedy tokens depend on the whole context (unlike dummy:tiny's,
    which follow the last prompt token: tests/unit/test_context_checkpoint.py), so KV that is wrong or
    missing after a pull changes them."""
    directory, _ = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))
    return str(directory)


def test_a_killed_worker_comes_back_and_serves(checkpoint: str) -> None:
    """kill -9 the prefill worker, then the decode worker, under `pdserve up`: /health says what is left
    (degraded, then unavailable), the supervisor starts each again on its port (counted), and requests
    are disaggregated again with the same greedy tokens, those of the model run colocated, the decode
    worker pulling the KV each time (its own metrics: bytes pulled, no local recompute)."""
    port = free_port()
    proc, ready = _start_up("--port", str(port), "--model", checkpoint, "--device", "cpu", "--dtype", "float32",
                            "--direct-decode-threshold", "0")
    try:
        assert ready.startswith(f"pdserve up: ready on http://127.0.0.1:{port}/v1"), ready
        workers = {m["role"]: m for m in READY.finditer(ready)}
        supervisor = "http://" + ready.rsplit("supervisor metrics ", 1)[1].strip() + "/metrics"
        decode_metrics = f"http://{workers['decode']['metrics']}/metrics"
        url = f"http://127.0.0.1:{port}"
        # 40 tokens, 3 KV blocks: disaggregated (--direct-decode-threshold 0); ids fit the vocabulary.
        prompt = [(7 * i + 3) % 300 + 10 for i in range(40)]

        def complete() -> list[int]:
            return completion_tokens(url, prompt, 8, stream=False)

        def health() -> tuple[int, str]:
            response = http_get(f"{url}/health", timeout=10)
            return response.status_code, response.json()["status"]

        def disaggregated() -> float:
            return _metric(f"{url}/metrics", "pdserve_router_routed_requests_total", route="disaggregated")

        def pulled() -> tuple[float, float]:
            """The decode worker's own evidence: (KV bytes pulled, prompts recomputed locally instead)."""
            return (_metric(decode_metrics, "pdserve_kv_transfer_bytes_total", role="decode"),
                    _metric(decode_metrics, "pdserve_local_recompute_fallbacks_total", role="decode"))

        expected = complete()
        assert disaggregated() == 1
        assert expected == colocated_tokens(checkpoint, prompt, 8)
        transferred, recomputed = pulled()
        assert transferred > 0 and recomputed == 0
        for role, down in (("prefill", (200, "degraded")), ("decode", (503, "unavailable"))):
            pid = int(subprocess.run(["pgrep", "-s", str(proc.pid), "-f", f"services.cli {role}"],
                                     capture_output=True, text=True).stdout.split()[0])
            os.kill(pid, signal.SIGKILL)
            _wait_for(lambda down=down: health() == down, f"/health {down} with the {role} worker dead", 10)
            _wait_for(lambda: health() == (200, "ok"), f"the {role} worker back")
            assert _metric(supervisor, "pdserve_up_worker_restarts_total", role=role) == 1
            assert http_get(f"http://{workers[role]['metrics']}/metrics", timeout=10).status_code == 200
            before, (transferred_before, _) = disaggregated(), pulled()
            assert complete() == expected
            assert disaggregated() == before + 1  # pulled from the new prefill worker / by the new decode one
            # The decode worker's own word on pull or recompute, not the router's route count (after a decode
            # restart these are the new process's metrics, from 0).
            transferred, recomputed = pulled()
            assert transferred > transferred_before and recomputed == 0
    finally:
        stop_up(proc)


# ---- access: the API key and the cluster token through `pdserve up` --------------------------------

API_KEY, CLUSTER_TOKEN = "up-test-api-key", "up-test-cluster-token"
LONG_PROMPT_TOKENS = 3000  # over the default 2048-token prefill budget: prefilled in several chunks


@pytest.fixture(scope="module")
def protected_up():
    """One `pdserve up --api-key K --kv-auth-token T` on the bundled SmolLM2 (CPU) for the access tests; every
    prompt disaggregated, so each goes through the workers' authenticated calls."""
    port = free_port()
    proc, ready = _start_up("--port", str(port), "--device", "cpu", "--api-key", API_KEY, "--kv-auth-token",
                            CLUSTER_TOKEN, "--direct-decode-threshold", "0")
    try:
        assert ready.startswith(f"pdserve up: ready on http://127.0.0.1:{port}/v1"), ready
        yield proc, f"http://127.0.0.1:{port}", {m["role"]: m for m in READY.finditer(ready)}
    finally:
        stop_up(proc)


def _complete(url: str, prompt: list[int], headers: dict[str, str]) -> httpx.Response:
    with http_client(timeout=300) as client:
        return client.post(f"{url}/v1/completions", headers=headers, json={
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})


def test_up_with_an_api_key_serves_only_with_it_and_keeps_its_secrets_off_command_lines(protected_up) -> None:
    proc, url, workers = protected_up
    prompt = [(7 * i + 3) % 5000 + 1000 for i in range(40)]
    assert _complete(url, prompt, {}).status_code == 401
    assert _complete(url, prompt, {"Authorization": "Bearer wrong"}).status_code == 401
    answer = _complete(url, prompt, {"Authorization": f"Bearer {API_KEY}"})
    assert answer.status_code == 200 and answer.headers["x-pdserve-route"] == "disaggregated", answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4
    # The workers got the cluster token (through their environment): a call without it is refused.
    for role, stub_type in (("prefill", worker_pb2_grpc.PrefillWorkerStub),
                            ("decode", worker_pb2_grpc.DecodeWorkerStub)):
        with grpc.insecure_channel(workers[role]["address"]) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                stub_type(channel).Info(worker_pb2.InfoRequest(), timeout=5)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            metadata = ((METADATA_KEY, bearer(CLUSTER_TOKEN)),)
            assert stub_type(channel).Info(worker_pb2.InfoRequest(), timeout=5, metadata=metadata).role
    # ps shows every process's command line: no child of `up` has either secret on its own.
    children = [int(pid) for pid in subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True,
                                                   text=True).stdout.split() if int(pid) != proc.pid]
    assert len(children) >= 3  # the router and both workers
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
        assert API_KEY not in cmdline and CLUSTER_TOKEN not in cmdline, cmdline


def test_a_prompt_prefilled_in_several_chunks_works_through_up_with_the_cluster_token(protected_up) -> None:
    """3000 tokens: the prefill worker sends its KV per chunk and the router relays the parts over
    GenerateParts, a streaming call that must carry the token like every other."""
    _proc, url, workers = protected_up
    prefill_metrics = f"http://{workers['prefill']['metrics']}/metrics"
    decode_metrics = f"http://{workers['decode']['metrics']}/metrics"
    parts_before = _metric(prefill_metrics, "pdserve_requests_total", outcome="kv_part")
    prompt = [(31 * i + 17) % 20000 + 1000 for i in range(LONG_PROMPT_TOKENS)]
    answer = _complete(url, prompt, {"Authorization": f"Bearer {API_KEY}"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-pdserve-route"] == "disaggregated"
    usage = answer.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (LONG_PROMPT_TOKENS, 4)
    assert _metric(prefill_metrics, "pdserve_requests_total", outcome="kv_part") > parts_before
    assert _metric(decode_metrics, "pdserve_local_recompute_fallbacks_total", role="decode") == 0
