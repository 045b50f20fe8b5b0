"""Load, classification and block accounting for the fault suite.

Every request is greedy with ``ignore_eos`` and asks for token ids in its logprobs, so its answer is a
token list comparable with a fault-free run of the same prompt. A request ends one of three ways:

- completed: a 200 whose tokens equal the fault-free run's and that ended with a finish reason;
- failed cleanly: an HTTP error with an OpenAI error body, or a stream that ends with an error event
  and ``[DONE]``;
- lost: anything else (wrong tokens, a stream cut without an error event, no answer by the deadline).

After a fault, every surviving worker must come back to zero: nothing running or waiting, no block
pinned for a transfer, every KV block free (prefix-cached blocks count as free: they are evictable).
Only the workers a test killed on purpose (and did not restart) may be dead then: any other dead
worker fails the test, named. The settle wait is shorter than the KV lease the stacks give their
prefill workers (``LONG_LEASE_S``), so a missing release shows as pinned blocks instead of being
cleaned by the lease, and each live prefill worker's lease expiries are checked (0 unless the test
says which expiries are legitimate).
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx

from services.launch.spawn import Daemon, Router
from services.proto_gen.pdserve.v1 import worker_pb2
from tests.e2e.stack import PREFILL_ARGS, http_client, http_get, info, metric_total

REPORTS: list[FaultReport] = []
DEADLINE_S = 60.0
#: How long :func:`settle` waits for the workers to come back to zero after a fault.
SETTLE_S = 30.0
#: The KV lease of prefill workers in tests where no lease should fire: longer than any test's whole run
#: (settle wait included), so a ticket nobody released stays pinned and fails the settle, rather than
#: being freed by the lease while the test waits (the default lease, 30 s, equals the settle wait).
LONG_LEASE_S = 3600.0
assert LONG_LEASE_S > DEADLINE_S + SETTLE_S


def prefill_args(lease_s: float = LONG_LEASE_S) -> tuple[str, ...]:
    """The stack's prefill flags with the given KV lease."""
    return (*PREFILL_ARGS, "--kv-lease-s", f"{lease_s:g}")


@dataclass
class FaultReport:
    fault: str
    sent: int = 0
    completed: int = 0
    failed_cleanly: int = 0
    aborted_by_client: int = 0
    lost: int = 0
    blocks_pinned: int = 0
    lease_expiries: int = 0  # summed over the live prefill workers at the end
    aborts_at_worker: int | None = None  # client aborts that a worker got mid-request (where measured)

    def add(self, outcome: str) -> None:
        self.sent += 1
        setattr(self, outcome, getattr(self, outcome) + 1)


def body(prompt: list[int], max_tokens: int, stream: bool = True) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            "logprobs": 0, "return_tokens_as_token_ids": True}


def _ids(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in (choice.get("logprobs") or {}).get("tokens", [])]


def run_request(url: str, prompt: list[int], max_tokens: int, expected: list[int] | None,
                on_event: Callable[[int], None] | None = None, abort_after: int | None = None) -> str:
    """One streamed completion, classified (see the module docstring). ``abort_after``: the client goes
    away after that many events (0: right after the headers), which is reported as ``aborted_by_client``."""
    tokens: list[int] = []
    finished = errored = done = False
    try:
        with http_client(timeout=DEADLINE_S) as client, \
                client.stream("POST", f"{url}/v1/completions", json=body(prompt, max_tokens)) as response:
            if response.status_code != 200:
                response.read()
                return "failed_cleanly" if "error" in response.json() else "lost"
            if abort_after == 0:
                return "aborted_by_client"
            events = 0
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    errored = True
                    continue
                for choice in event["choices"]:
                    tokens += _ids(choice)
                    finished |= choice.get("finish_reason") is not None
                events += 1
                if on_event is not None:
                    on_event(events)
                if abort_after is not None and events >= abort_after:
                    return "aborted_by_client"
    except (httpx.HTTPError, ValueError):
        return "lost"
    if done and errored:
        return "failed_cleanly"
    if done and finished and (expected is None or tokens == expected):
        return "completed"
    return "lost"


def abort_before_headers(url: str, prompt: list[int], max_tokens: int) -> str:
    """Send the request and hang up before any answer: the router must clean up a request nobody reads."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body(prompt, max_tokens)).encode()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return "aborted_by_client"


def references(url: str, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """The fault-free answers (greedy: the same tokens every time)."""
    out = []
    with http_client(timeout=DEADLINE_S) as client:
        for prompt in prompts:
            response = client.post(f"{url}/v1/completions", json=body(prompt, max_tokens, stream=False))
            response.raise_for_status()
            out.append(_ids(response.json()["choices"][0]))
    return out


def run_load(report: FaultReport, jobs: Sequence[Callable[[], str]], concurrency: int) -> None:
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for outcome in pool.map(lambda job: job(), jobs):
            report.add(outcome)


def prompts(count: int, seed: int, low: int = 8, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def describe(worker: Daemon) -> str:
    code = worker.proc.poll()
    state = "running" if code is None else f"exited with code {code}"
    return f"{worker.role} worker {worker.address} (pid {worker.proc.pid}, {state})"


def _live_info(worker: Daemon) -> worker_pb2.WorkerInfo:
    """The worker's Info; an AssertionError naming it if it died (a worker no test killed)."""
    assert worker.proc.poll() is None, f"{describe(worker)} died, and the test did not kill it"
    try:
        return info(worker)
    except grpc.RpcError as exc:
        if worker.proc.poll() is not None:
            raise AssertionError(f"{describe(worker)} died, and the test did not kill it") from exc
        raise


def settle(workers: Sequence[Daemon], num_blocks: int, killed: Sequence[Daemon] = (),
           timeout_s: float = SETTLE_S) -> tuple[int, int]:
    """Wait for every worker to be idle with all blocks free; then (blocks pinned or used, requests
    still running or waiting), summed over the workers.

    ``killed``: the workers the test killed on purpose and did not restart; they must be dead and are
    skipped. Any other worker that is dead is an AssertionError naming it.
    """
    for worker in killed:
        assert worker.proc.poll() is not None, f"{describe(worker)} was to be killed by the test"
    survivors = [w for w in workers if all(w is not k for k in killed)]
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = requests = 0
        for worker in survivors:
            state = _live_info(worker)
            blocks += state.kv_blocks_pinned + (num_blocks - state.kv_blocks_free)
            requests += state.num_running + state.num_waiting
        if blocks == requests == 0 or time.monotonic() > deadline:
            return blocks, requests
        time.sleep(0.2)


def lease_expiries(workers: Sequence[Daemon]) -> int:
    """``pdserve_kv_lease_expiries_total`` summed over the live prefill workers among ``workers``."""
    return int(sum(metric_total(w, "pdserve_kv_lease_expiries_total") for w in workers
                   if w.role == "prefill" and w.proc.poll() is None))


def router_metric_total(router: Router, name: str, label: str = "") -> float:
    """Sum of a metric's samples on the router's /metrics (those whose labels contain ``label``); like
    ``tests.e2e.stack.metric_total``, a missing series is an error, not 0. Matches unlabelled series too."""
    text = http_get(f"{router.local_url}/metrics", timeout=10).text
    samples = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if (line.startswith(name + "{") and label in line) or (not label and line.startswith(name + " "))]
    assert samples, f"no {name} sample with {label!r} on the router's /metrics"
    return sum(samples)


def record(report: FaultReport, workers: Sequence[Daemon], num_blocks: int, *, killed: Sequence[Daemon] = (),
           max_lease_expiries: int = 0) -> FaultReport:
    """Settle the workers, add the report to the table, and check that nothing was lost or left behind.

    ``workers``: every worker of the stack (a restarted one included); ``killed``: those the test killed
    on purpose and did not restart (see :func:`settle`). The live prefill workers' lease expiries may be
    at most ``max_lease_expiries`` (0: no lease may have freed anything: every ticket was released).
    """
    report.blocks_pinned, requests_left = settle(workers, num_blocks, killed)
    report.lease_expiries = lease_expiries([w for w in workers if all(w is not k for k in killed)])
    REPORTS.append(report)
    assert report.lost == 0, report
    assert report.blocks_pinned == 0 and requests_left == 0, (report, requests_left)
    assert report.lease_expiries <= max_lease_expiries, \
        (f"{report.lease_expiries} KV leases expired on the prefill workers (at most {max_lease_expiries} "
         "may): a ticket was freed by the lease, not released", report)
    return report
