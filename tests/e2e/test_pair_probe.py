"""End to end: the router pairs a prefill and a decode worker only after a real KV transfer between them.

One prefill worker and two decode workers behind one router; the second decode worker runs with
``PDSERVE_FAULT_INJECT=kv_corrupt``, so every pull it makes fails its KV digest check, the probe's too:
a deterministic, real failure of a pair that compatibility alone would have used. A second router,
``--enforce-disagg``, sees only that failing pair.

- A healthy pair is probed before any client request (the decode worker moved KV, the router's metrics
  and /health say probed), and serves every request.
- The failing pair is never used: /health says why (its pair, and the decode worker's unpaired_reason,
  carry the digest mismatch), metrics count it; the strict router refuses with 503 and says why.
- Restarting the prefill worker (a new epoch) makes the router probe its pairs again before using them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from services.launch.spawn import (
    Daemon,
    Router,
    spawn_daemon,
    start_router,
    terminate_all,
    wait_all_ready,
    wait_ready,
)
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import DECODE_ARGS, PREFILL_ARGS, http_get, http_post, info, metric_total
from tests.e2e.test_enforce_disagg import RouterProc, _start_router

pytestmark = pytest.mark.slow

PROMPT = [17, 4, 99, 23, 150, 8, 61, 230, 45, 12, 77, 190, 33, 5, 140, 66, 21, 98, 250, 7]  # several blocks


@dataclass
class Cluster:
    model: str
    prefill: Daemon
    decode: Daemon  # healthy
    corrupting: Daemon  # PDSERVE_FAULT_INJECT=kv_corrupt: every pull fails its digest check
    router: Router  # prefill + both decode workers
    strict: RouterProc  # --enforce-disagg, prefill + the corrupting decode worker only


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    model = str(make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))[0])
    starting = []
    with pytest.MonkeyPatch.context() as env:  # each daemon takes the environment as it is when spawned
        for name in ("PDSERVE_KV_AUTH_TOKEN", "PDSERVE_FAULT_INJECT", "PDSERVE_ENFORCE_DISAGG"):
            env.delenv(name, raising=False)
        starting.append(spawn_daemon("prefill", model, *PREFILL_ARGS))
        starting.append(spawn_daemon("decode", model, *DECODE_ARGS))
        env.setenv("PDSERVE_FAULT_INJECT", "kv_corrupt")
        starting.append(spawn_daemon("decode", model, *DECODE_ARGS))
        env.delenv("PDSERVE_FAULT_INJECT")
        routers = []
        try:
            prefill, decode, corrupting = wait_all_ready(starting)
            router = start_router(model, [prefill.address], [decode.address, corrupting.address])
            routers.append(router.proc)
            strict = _start_router(tmp_path_factory.mktemp("router-logs"), "strict", model, prefill.address,
                                   corrupting.address, "--enforce-disagg", want="unavailable")
            routers.append(strict.proc)
            yield Cluster(model, prefill, decode, corrupting, router, strict)
        finally:
            terminate_all(routers)
            terminate_all([s.proc for s in starting])


def _health(url: str) -> dict:
    return http_get(f"{url}/health", timeout=10).json()


def _pairs(url: str) -> dict[str, dict]:
    """The router's pairs on /health by decode address."""
    return {p["decode"]: p for p in _health(url)["pairs"]}


def _router_metric(url: str, name: str, label: str = "") -> float:
    text = http_get(f"{url}/metrics", timeout=10).text
    samples = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line]
    assert samples, f"no {name} sample with {label!r} on the router's /metrics"
    return sum(samples)


def _wait(what: str, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not in {timeout_s:g} s: {what}"
        time.sleep(0.2)


def _complete(url: str) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return http_post(f"{url}/v1/completions", json=body, timeout=120)


def test_a_healthy_pair_is_probed_before_any_request_and_a_failing_one_is_never_used(cluster: Cluster) -> None:
    url, decode, corrupting = cluster.router.url, cluster.decode, cluster.corrupting
    # Probed at start-up: the healthy decode worker pulled the probe's KV before any client request.
    assert metric_total(decode, "pdserve_requests_total", 'outcome="finished"') == 0
    assert metric_total(decode, "pdserve_kv_transfer_bytes_total") > 0
    assert metric_total(decode, "pdserve_kv_probes_total", 'result="ok"') == 1
    _wait("the corrupting decode worker's probe to fail",
          lambda: _pairs(url).get(corrupting.address, {}).get("state") == "failed")
    health = _health(url)
    assert health["status"] == "ok"
    pairs = _pairs(url)
    assert pairs[decode.address] == {"prefill": cluster.prefill.address, "decode": decode.address, "state": "probed"}
    reason = pairs[corrupting.address]["reason"]
    assert "does not match the ticket's digest" in reason, reason
    workers = {w["address"]: w for w in health["workers"]}
    assert workers[corrupting.address]["state"] == "unpaired"
    assert workers[corrupting.address]["unpaired_reason"] == f"prefill {cluster.prefill.address}: KV probe failed: " \
                                                              f"{reason}"
    assert workers[decode.address]["state"] == workers[cluster.prefill.address]["state"] == "healthy"
    assert _router_metric(url, "pdserve_router_pairs", 'state="probed"') == 1
    assert _router_metric(url, "pdserve_router_pairs", 'state="failed"') == 1
    assert _router_metric(url, "pdserve_router_pair_probes_total", 'result="failed"') >= 1
    # The decode worker says the same from its side: its probe's pull failed the digest check.
    assert metric_total(corrupting, "pdserve_kv_probes_total", 'result="failed"') >= 1
    assert metric_total(corrupting, "pdserve_kv_integrity_failures_total") >= 1

    # Every request goes to the probed pair, disaggregated; none reaches the corrupting decode worker.
    for _ in range(4):
        response = _complete(url)
        assert response.status_code == 200 and response.headers["x-pdserve-route"] == "disaggregated"
    assert metric_total(decode, "pdserve_requests_total", 'outcome="finished"') == 4
    assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0
    assert metric_total(corrupting, "pdserve_requests_total", 'outcome="finished"') == 0
    assert metric_total(corrupting, "pdserve_local_recompute_fallbacks_total") == 0


def test_a_strict_router_whose_only_pair_failed_its_probe_refuses_and_says_why(cluster: Cluster) -> None:
    url = cluster.strict.url
    _wait("the strict router's pair to fail its probe",
          lambda: _pairs(url).get(cluster.corrupting.address, {}).get("state") == "failed")
    health = http_get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert "failed its KV probe" in health.json()["reason"]
    response = _complete(url)
    assert response.status_code == 503 and response.json()["error"]["code"] == "disaggregation_unavailable"
    assert "failed its KV probe" in response.json()["error"]["message"]
    assert metric_total(cluster.corrupting, "pdserve_requests_total", 'outcome="finished"') == 0


def test_a_restarted_prefill_worker_is_probed_again_before_it_is_used(cluster: Cluster) -> None:
    url, decode, old = cluster.router.url, cluster.decode, cluster.prefill
    old_epoch = info(old).epoch
    probes = metric_total(decode, "pdserve_kv_probes_total", 'result="ok"')
    pulls = metric_total(decode, "pdserve_kv_transfer_seconds_count")
    router_ok = _router_metric(url, "pdserve_router_pair_probes_total", 'result="ok"')
    old.kill()
    restarted = wait_ready(spawn_daemon("prefill", cluster.model, *PREFILL_ARGS, "--port", str(old.port)))
    try:
        new_epoch = info(restarted).epoch
        assert new_epoch != old_epoch
        _wait("the new epoch's probe", lambda: metric_total(decode, "pdserve_kv_probes_total", 'result="ok"')
              == probes + 1 and _pairs(url).get(decode.address, {}).get("state") == "probed")
        assert _health(url)["status"] == "ok"
        assert metric_total(decode, "pdserve_kv_transfer_seconds_count") == pulls + 1  # a real pull, no request
        assert _router_metric(url, "pdserve_router_pair_probes_total", 'result="ok"') == router_ok + 1
        response = _complete(url)
        assert response.status_code == 200 and response.headers["x-pdserve-route"] == "disaggregated"
        assert metric_total(decode, "pdserve_kv_transfer_seconds_count") == pulls + 2
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0
    finally:
        restarted.kill()  # the module's teardown only knows the original process (dead already)
