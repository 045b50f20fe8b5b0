"""End to end: strict disaggregation (``--enforce-disagg``) and the ``x-pdserve-route`` header, with real
router, prefill and decode processes and a real pull that fails.

One decode worker and two prefill workers serve four routers. The ``open`` prefill worker's KV can be
pulled. The ``locked`` one was started with a cluster token the decode worker lacks: the router (which
has the token) pairs them (pairing is by compatibility, not by token) and the prefill worker answers,
but the decode worker's KV handshake is refused every time (PERMISSION_DENIED), so every pull from it
fails, deterministically. Such a pair fails the router's pair probe too (the decode worker cannot even ask
the locked worker for its Info), so a probing router would never send it a request
(``tests/e2e/test_pair_probe.py`` shows that); the two routers in front of it run ``--no-pair-probe`` to
reach the paths that a pull failing after its pair passed the probe takes. The routers:

- ``normal``: open + decode, ``--direct-decode-threshold``: disaggregated and direct responses;
- ``strict``: locked + decode, ``--enforce-disagg --no-pair-probe``: 502 / an error event, nothing
  recomputed;
- ``lenient``: locked + decode, ``--no-pair-probe``: the decode worker recomputes, 200 with ``fallback``
  and the fault-free tokens;
- ``orphan``: ``--enforce-disagg`` with a prefill address nothing listens on: 503, the decode worker
  never asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from services.common.grpc_auth import METADATA_KEY, bearer
from services.launch.spawn import Daemon, daemons, free_port, terminate_all
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import DECODE_ARGS, PREFILL_ARGS, http_client, http_get, metric_total

pytestmark = pytest.mark.slow

TOKEN = "strict-s3cret"
MAX_TOKENS = 8
THRESHOLD = 8  # the normal router's --direct-decode-threshold
LONG = [17, 4, 99, 23, 150, 8, 61, 230, 45, 12, 77, 190, 33, 5, 140, 66, 21, 98, 250, 7]  # several blocks
SHORT = [31, 42, 53]


@dataclass
class RouterProc:
    proc: subprocess.Popen
    url: str
    log: Path

    def lines(self, request_id: str) -> list[str]:
        """The router's per-request log lines of requests sent with this X-Request-Id."""
        return [line for line in self.log.read_text().splitlines() if f"request id=cmpl-{request_id}" in line]

    def answered(self, request_id: str) -> list[str]:
        """Its log lines about the error it answered the request with: the full message the client did not get."""
        return [line for line in self.log.read_text().splitlines() if f"request {request_id} answered " in line]


@dataclass
class Cluster:
    open_prefill: Daemon
    locked_prefill: Daemon
    decode: Daemon
    normal: RouterProc
    strict: RouterProc
    lenient: RouterProc
    orphan: RouterProc


def _start_router(log_dir: Path, name: str, model: str, prefill: str, decode: str, *extra: str,
                  want: str) -> RouterProc:
    """``pdserve router`` at INFO (its per-request lines go to a file); returns once ``/health`` says
    ``want`` with the decode worker healthy."""
    port = free_port()
    log = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "services.cli", "--log-level", "INFO", "router", "--port", str(port), "--model",
           model, "--prefill", prefill, "--decode", decode, "--health-interval-s", "0.5", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    router = RouterProc(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"router {name} exited: {log.read_text()[-2000:]}"
        try:
            health = http_get(f"{router.url}/health", timeout=2).json()
            if health["status"] == want and health["healthy_workers"]["decode"] == 1:
                return router
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"router {name} not {want} in time: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    model = str(make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))[0])
    logs = tmp_path_factory.mktemp("router-logs")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("PDSERVE_KV_AUTH_TOKEN", raising=False)  # only the locked worker and the routers have one
        env.delenv("PDSERVE_ENFORCE_DISAGG", raising=False)
        specs = [("prefill", model, PREFILL_ARGS), ("prefill", model, (*PREFILL_ARGS, "--kv-auth-token", TOKEN)),
                 ("decode", model, DECODE_ARGS)]
        with daemons(*specs) as (open_prefill, locked_prefill, decode):
            routers: list[RouterProc] = []
            try:
                token = ("--kv-auth-token", TOKEN)
                for name, prefill, extra, want in (
                        ("normal", open_prefill.address, ("--direct-decode-threshold", str(THRESHOLD)), "ok"),
                        ("strict", locked_prefill.address, (*token, "--enforce-disagg", "--no-pair-probe"), "ok"),
                        # Disaggregated whatever the decode worker caches, so its failing pull falls back.
                        ("lenient", locked_prefill.address, (*token, "--no-pair-probe", "--direct-decode-threshold",
                                                             "0"), "ok"),
                        ("orphan", f"127.0.0.1:{free_port()}", ("--enforce-disagg",), "unavailable")):
                    routers.append(_start_router(logs, name, model, prefill, decode.address, *extra, want=want))
                yield Cluster(open_prefill, locked_prefill, decode, *routers)
            finally:
                terminate_all([r.proc for r in routers])


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    tokens: list[int]
    body: dict | None = None  # non-streamed
    events: list | None = None  # streamed: decoded JSON events, then "[DONE]"


def _complete(url: str, prompt: list[int], stream: bool, request_id: str) -> Answer:
    """A greedy completion; its token ids as the client received them."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    with http_client(timeout=120, headers={"X-Request-Id": request_id}) as client:
        response = client.post(f"{url}/v1/completions", json=body)
    if not stream or response.status_code != 200:
        payload = response.json()
        choices = payload.get("choices") or [{}]
        return Answer(response.status_code, response.headers, _ids(choices[0]), body=payload)
    events = [block.removeprefix("data: ") for block in response.text.split("\n\n") if block]
    events = [e if e == "[DONE]" else json.loads(e) for e in events]
    tokens = [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in _ids(c)]
    return Answer(response.status_code, response.headers, tokens, events=events)


def _ids(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in (choice.get("logprobs") or {}).get("tokens", [])]


def _decode_counts(cluster: Cluster) -> dict[str, float]:
    d = cluster.decode
    return {"recomputed": metric_total(d, "pdserve_local_recompute_fallbacks_total"),
            "pulled": metric_total(d, "pdserve_kv_transfer_seconds_count"),
            "handshake_failures": metric_total(d, "pdserve_kv_handshake_failures_total"),
            "pull_required": metric_total(d, "pdserve_requests_total", 'outcome="pull_required"'),
            "finished": metric_total(d, "pdserve_requests_total", 'outcome="finished"')}


def _changes(cluster: Cluster, before: dict[str, float], expected: dict[str, float],
             timeout_s: float = 5.0) -> dict[str, float]:
    """What moved on the decode worker since ``before``, once it is ``expected`` or in time (it counts a
    request finished just after its last chunk left, which may be after the client has its answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = _decode_counts(cluster)
        moved = {k: after[k] - before[k] for k in before if after[k] != before[k]}
        if moved == expected or time.monotonic() > deadline:
            return moved
        time.sleep(0.1)


def _routed(router: RouterProc) -> dict[str, float]:
    text = http_get(f"{router.url}/metrics", timeout=10).text
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("pdserve_router_routed_requests_total{")}


def _openai_error(answer: Answer, status: int, code: str) -> dict:
    assert answer.status == status, answer.body
    assert set(answer.body) == {"error"} and set(answer.body["error"]) == {"message", "type", "param", "code"}
    assert answer.body["error"]["code"] == code
    return answer.body["error"]


def _wait_unpinned(d: Daemon, timeout_s: float = 10.0) -> int:
    """The blocks the (locked) prefill worker holds for a transfer, once none are left or in time."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(d.address) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        while True:
            pinned = stub.Info(worker_pb2.InfoRequest(), timeout=5,
                               metadata=((METADATA_KEY, bearer(TOKEN)),)).kv_blocks_pinned
            if not pinned or time.monotonic() > deadline:
                return pinned
            time.sleep(0.1)


@pytest.fixture(scope="module")
def fault_free(cluster: Cluster) -> list[int]:
    """The long prompt's tokens served disaggregated through the open prefill worker."""
    answer = _complete(cluster.normal.url, LONG, stream=False, request_id="reference")
    assert answer.status == 200 and len(answer.tokens) == MAX_TOKENS
    return answer.tokens


def test_disaggregated_and_direct_responses_say_so(cluster: Cluster, fault_free: list[int]) -> None:
    before = _decode_counts(cluster)
    streamed = _complete(cluster.normal.url, LONG, stream=True, request_id="disagg-stream")
    assert streamed.status == 200 and streamed.headers["x-pdserve-route"] == "disaggregated"
    assert streamed.tokens == fault_free and streamed.events[-1] == "[DONE]"
    assert streamed.events[-2]["pdserve_route"] == "disaggregated"  # the last chunk: the final route
    short = _complete(cluster.normal.url, SHORT, stream=False, request_id="direct")
    assert short.status == 200 and short.headers["x-pdserve-route"] == "direct" and len(short.tokens) == MAX_TOKENS
    # The decode worker pulled the long prompt and prefilled the short one itself, by policy: no fallback.
    assert _changes(cluster, before, expected := {"pulled": 1, "finished": 2}) == expected
    assert _routed(cluster.normal) == {"disaggregated": 2, "direct": 1, "fallback": 0}  # the reference too
    (line,) = cluster.normal.lines("direct")
    assert " route=direct " in line and "prefill=None" in line


def test_strict_without_a_prefill_worker_is_503_and_the_decode_worker_never_asked(cluster: Cluster) -> None:
    health = http_get(f"{cluster.orphan.url}/health", timeout=5)
    assert health.status_code == 503 and "--enforce-disagg" in health.json()["reason"]
    before = _decode_counts(cluster)
    for stream in (False, True):
        for prompt in (LONG, SHORT):
            answer = _complete(cluster.orphan.url, prompt, stream, request_id=f"orphan-{stream}-{len(prompt)}")
            error = _openai_error(answer, 503, "disaggregation_unavailable")
            assert "no healthy prefill worker" in error["message"] and answer.headers["retry-after"] == "1"
            assert "x-pdserve-route" not in answer.headers
    assert _changes(cluster, before, {}, timeout_s=1.0) == {}  # nothing ran there, nothing recomputed
    assert _routed(cluster.orphan) == {"disaggregated": 0, "direct": 0, "fallback": 0}
    (line,) = cluster.orphan.lines("orphan-False-20")
    assert "end=error:DisaggregationUnavailable" in line and " route=none " in line


def test_strict_with_a_failing_pull_is_502_or_an_error_event_and_nothing_recomputed(cluster: Cluster,
                                                                                     fault_free: list[int]) -> None:
    before = _decode_counts(cluster)
    whole = _complete(cluster.strict.url, LONG, stream=False, request_id="strict-whole")
    error = _openai_error(whole, 502, "disaggregation_failed")
    # The client reads the kind; the decode worker's reason (a refused handshake with the prefill worker, whose
    # address it names) is the router's log line.
    assert error["type"] == "server_error" and "--enforce-disagg" in error["message"]
    assert "handshake" not in error["message"] and cluster.locked_prefill.address not in error["message"]
    (line,) = cluster.strict.answered("strict-whole")
    assert "answered 502 disaggregation_failed" in line and "handshake" in line, line
    assert "x-pdserve-route" not in whole.headers

    # Streamed: the prefill worker's first token is out (and the header with it) before the pull fails.
    streamed = _complete(cluster.strict.url, LONG, stream=True, request_id="strict-stream")
    assert streamed.status == 200 and streamed.headers["x-pdserve-route"] == "disaggregated"
    assert streamed.events[-1] == "[DONE]" and streamed.events[-2]["error"]["code"] == "disaggregation_failed"
    assert streamed.tokens == fault_free[:1]  # the first token only: never a recomputed one
    assert not any("pdserve_route" in e for e in streamed.events if isinstance(e, dict))

    # Both refused on the decode worker, the handshake failure counted as always, nothing prefilled there.
    assert _changes(cluster, before, expected := {"handshake_failures": 2, "pull_required": 2}) == expected
    assert _wait_unpinned(cluster.locked_prefill) == 0  # the router released the blocks nobody will pull
    assert _routed(cluster.strict) == {"disaggregated": 0, "direct": 0, "fallback": 0}
    (line,) = cluster.strict.lines("strict-whole")
    assert "end=error:DisaggregationFailed" in line and " route=none " in line
    # The short prompt is disaggregated too in strict mode, so it fails the same way.
    assert _complete(cluster.strict.url, SHORT, False, request_id="strict-short").status == 502


def test_without_strict_a_failing_pull_falls_back_with_the_fault_free_output(cluster: Cluster,
                                                                             fault_free: list[int]) -> None:
    before = _decode_counts(cluster)
    whole = _complete(cluster.lenient.url, LONG, stream=False, request_id="lenient-whole")
    assert whole.status == 200 and whole.headers["x-pdserve-route"] == "fallback"
    assert whole.tokens == fault_free
    streamed = _complete(cluster.lenient.url, LONG, stream=True, request_id="lenient-stream")
    # The header left with the first token, before the pull failed; the last chunk has the final route.
    assert streamed.status == 200 and streamed.headers["x-pdserve-route"] == "disaggregated"
    assert streamed.tokens == fault_free and streamed.events[-2]["pdserve_route"] == "fallback"
    expected = {"recomputed": 2, "handshake_failures": 2, "finished": 2}
    assert _changes(cluster, before, expected) == expected
    assert _routed(cluster.lenient) == {"disaggregated": 0, "direct": 0, "fallback": 2}
    (line,) = cluster.lenient.lines("lenient-stream")
    assert " route=fallback " in line and "recomputed=True" in line
