"""The monitoring stack against the real thing: Prometheus scrapes a running ``pdserve up``, evaluates the
deployment's recording and alert rules, and answers every query of the Grafana dashboard with data.

``pdserve up --prometheus-sd-file`` writes its processes' metrics addresses as file_sd targets; the
Prometheus config here is deploy/prometheus/prometheus.yml with each job's DNS discovery swapped for
that file (a job keeps the targets of its component), plus the supervisor's job, scraped every second.
Traffic goes through the router's OpenAI endpoints (streamed and not, all disaggregated), then every
rule and panel query runs against Prometheus' HTTP API.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from services.launch.spawn import free_port
from tests.deploy import promql
from tests.deploy.tools import tool
from tests.e2e.stack import http_client

pytestmark = pytest.mark.slow

MODEL = "dummy:tiny"  # random weights, 2 layers: the whole stack is ready in about 10 s on 2 cores
NUM_REQUESTS = 16
SCRAPE = "1s"
# file_sd targets of `pdserve up` carry pdserve_component; the jobs of prometheus.yml are pdserve-<component>.
SUPERVISOR_JOB = {"job_name": "pdserve-up", "component": "supervisor"}


def prometheus_config(targets_file: Path) -> dict:
    """deploy/prometheus/prometheus.yml for this machine: file_sd instead of DNS, the repository's rules."""
    base = yaml.safe_load((promql.PROMETHEUS_DIR / "prometheus.yml").read_text())
    jobs = [{"job_name": job["job_name"], "component": job["job_name"].removeprefix("pdserve-")}
            for job in base["scrape_configs"] if "dns_sd_configs" in job]
    assert {j["component"] for j in jobs} == {"router", "prefill", "decode"}
    return {
        "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": SCRAPE},
        "rule_files": [str(path) for path in promql.RULE_FILES],
        "scrape_configs": [{
            "job_name": job["job_name"],
            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}],
            "relabel_configs": [{"source_labels": ["pdserve_component"], "regex": job["component"],
                                 "action": "keep"}],
        } for job in [*jobs, SUPERVISOR_JOB]],
    }


def _stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL the whole process group (the process leads its own session)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything left in its group (children of pdserve up)
    proc.wait()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@dataclass
class Observed:
    prom: promql.Prometheus
    router_url: str
    num_requests: int


def _start_up(tmp: Path, targets_file: Path) -> tuple[subprocess.Popen, queue.Queue, int]:
    port = free_port()
    log = (tmp / "pdserve-up.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--model", MODEL, "--device", "cpu",
         "--prometheus-sd-file", str(targets_file), "--metrics-port", "0",
         "--kv-offload-gib", "0.05",  # a host KV tier on each worker: its series get data
         "--direct-decode-threshold", "0"],  # every request disaggregated (not the cost-based choice)
        stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:  # keeps draining stdout so `pdserve up` never blocks on it
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines, port


def _wait_ready(lines: queue.Queue, log: Path, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
        except queue.Empty:
            raise AssertionError(f"pdserve up not ready after {timeout_s:g} s:\n{_tail(log)}") from None
        if line is None:
            raise AssertionError(f"pdserve up exited before it was ready:\n{_tail(log)}")
        if line.startswith("pdserve up: ready on http://"):
            return line


def _start_prometheus(tmp: Path, targets_file: Path) -> tuple[subprocess.Popen, str]:
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(targets_file)))
    port = free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _prompt(i: int) -> str:
    if i == NUM_REQUESTS - 1:
        i = 3  # the last request repeats an early prompt (33 words): a prefix cache hit
    words = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
             "quietly", "hum", "an", "old", "tune")
    return " ".join(words[(i + k) % len(words)] for k in range(12 + 7 * i))  # 12 to over 100 words


def _complete(client: httpx.Client, url: str, i: int) -> None:
    body = {"prompt": _prompt(i), "max_tokens": 8 + i % 5, "temperature": 0, "ignore_eos": True,
            "stream": i % 2 == 0}
    if body["stream"]:
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2, events[-3:]
    else:
        response = client.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == body["max_tokens"]


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> Observed:
    tmp = tmp_path_factory.mktemp("observability")
    targets_file = tmp / "targets.json"
    up, lines, port = _start_up(tmp, targets_file)
    prometheus = None
    prom = None
    try:
        prometheus, prom_url = _start_prometheus(tmp, targets_file)  # starts while the workers load
        prom = promql.Prometheus(prom_url)
        _wait_ready(lines, tmp / "pdserve-up.log")
        router_url = f"http://127.0.0.1:{port}"
        prom.wait(prom.ready, "Prometheus to be ready")
        groups = json.loads(targets_file.read_text())
        assert sorted(g["labels"]["pdserve_component"] for g in groups) == ["decode", "prefill", "router",
                                                                              "supervisor"]

        def all_up() -> bool:
            targets = prom.active_targets()
            return len(targets) == len(groups) and all(t["health"] == "up" for t in targets)

        with http_client(timeout=120) as client:
            # One request first: the router's per-route series only exist once a request took that route,
            # and rates need a sample of them from before the traffic.
            _complete(client, router_url, 0)
            prom.wait(all_up, "every target of the file_sd file to be scraped (up)", timeout_s=30)
            prom.wait(lambda: prom.query("pdserve_router_routed_requests_total"), "the first request", timeout_s=15)
            time.sleep(2)
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: _complete(client, router_url, i), range(1, NUM_REQUESTS)))
        # Scraped: every request counted at the router and on the decode workers, the pulls included.
        prom.wait(lambda: prom.value("sum(pdserve_router_routed_requests_total)") >= NUM_REQUESTS
                  and prom.value('sum(pdserve_requests_total{role="decode", outcome="finished"})') >= NUM_REQUESTS
                  and prom.value("sum(pdserve_kv_transfer_seconds_count)") >= 1,
                  "the traffic to show up in the scraped counters", timeout_s=20)
        # And evaluated: every recording rule has a series, over a window that holds the traffic (rule
        # groups are evaluated apart: a quantile evaluated before the last scrape is NaN, never > 0).
        prom.wait(lambda: all(prom.query(name) for name in promql.recording_rule_names())
                  and prom.value('sum(role:pdserve_kv_transfer_bytes:rate1m{role="decode"})') > 0
                  and prom.value("sum(job:pdserve_router_time_to_first_token_seconds:p99_rate1m)") > 0
                  and prom.value('sum(role:pdserve_inter_token_latency_seconds:p50_rate1m{role="decode"})') > 0,
                  "the recording rules to see the traffic", timeout_s=20)
        yield Observed(prom, router_url, NUM_REQUESTS)
    except BaseException:
        for name in ("pdserve-up.log", "prometheus.log"):
            sys.stderr.write(f"--- {name} (last lines)\n{_tail(tmp / name)}\n")
        raise
    finally:
        if prom is not None:
            prom.close()
        _stop(up)
        if prometheus is not None:
            _stop(prometheus)


def test_every_dashboard_query_returns_data(observed: Observed) -> None:
    empty = []
    for q in promql.panel_queries():
        if not observed.prom.query(q.instant()):  # a query Prometheus cannot parse raises here
            empty.append(f"{q.panel!r} {q.ref}: {q.instant()}")
    assert not empty, "panel queries without data:\n" + "\n".join(empty)


def test_dashboard_variables_list_the_workers(observed: Observed) -> None:
    queries = promql.variable_queries()
    selector, label = promql.label_values_query(queries["model"])
    models = {s["metric"][label] for s in observed.prom.query(promql.substitute(selector))}
    assert len(models) == 1, models  # both workers serve the one model
    selector, label = promql.label_values_query(queries["instance"])
    instances = {s["metric"][label] for s in observed.prom.query(promql.substitute(selector))}
    workers = {s["metric"]["instance"] for s in observed.prom.query("pdserve_queue_depth")}
    assert instances == workers and len(instances) == 2


def test_the_routers_series_name_no_worker_address(observed: Observed) -> None:
    """The router's /metrics is open to anyone who reaches its port: its per-worker series carry the worker's
    opaque id (``worker``), never a host:port (``instance``, the router's own scrape target, aside)."""
    series = [s["metric"] for s in observed.prom.query('{job="pdserve-router"}')]
    per_worker = [m for m in series if m["__name__"] == "pdserve_router_worker_outstanding_requests"]
    assert len(per_worker) == 2 and all(re.fullmatch(r"[0-9a-f]{12}", m["worker"]) for m in per_worker), per_worker
    for metric in series:
        leaked = {k: v for k, v in metric.items() if k != "instance" and re.search(r":\d+\b", v)}
        assert not leaked, metric


def test_every_metric_the_rules_and_dashboard_use_exists_in_prometheus(observed: Observed) -> None:
    exprs = [r.expr for r in promql.rules()] + promql.dashboard_exprs()
    used = set().union(*(promql.metric_names(e) for e in exprs))
    known = observed.prom.metric_names() | promql.recording_rule_names()
    assert used - known == set()


def test_every_rule_expression_runs(observed: Observed) -> None:
    for rule in promql.rules():
        result = observed.prom.query(rule.expr)  # raises on an error
        if rule.kind == "record":
            assert result, f"{rule.name}: no series"


def test_recording_rules_produced_series(observed: Observed) -> None:
    missing = [name for name in sorted(promql.recording_rule_names()) if not observed.prom.query(name)]
    assert not missing, f"recording rules without series: {missing}"


def test_rules_are_loaded_and_evaluate_without_error(observed: Observed) -> None:
    loaded = {}
    for group in observed.prom.rule_groups():
        for rule in group["rules"]:
            loaded[rule["name"]] = rule
    expected = {r.name for r in promql.rules()}
    assert expected <= set(loaded)
    broken = {name: rule.get("lastError") for name, rule in loaded.items() if rule["health"] != "ok"}
    assert not broken, broken
    assert {name for name, rule in loaded.items() if rule["type"] == "alerting"} == promql.alert_names()


def test_no_alert_on_a_healthy_stack(observed: Observed) -> None:
    active = [(a["labels"]["alertname"], a["state"], a["labels"]) for a in observed.prom.alerts()]
    assert not active, active


def test_the_figures_describe_the_traffic(observed: Observed) -> None:
    prom = observed.prom
    assert prom.value('sum(pdserve_router_status{status="ok"})') == 1
    assert prom.value('sum(pdserve_router_routed_requests_total{route="disaggregated"})') == observed.num_requests
    # Every request was pulled: bytes moved, in at least one descriptor each, and nothing failed.
    assert prom.value('sum(role:pdserve_kv_transfer_gigabytes_per_pull_second:ratio_rate1m{role="decode"})') > 0
    assert prom.value('sum(role:pdserve_kv_transfer_bytes_per_pull:ratio_rate1m{role="decode"})') > 0
    assert prom.value('sum(role:pdserve_kv_transfer_descriptors_per_pull:ratio_rate1m{role="decode"})') >= 1
    assert prom.value('sum(role:pdserve_kv_pull_failures:ratio_rate5m{role="decode"})') == 0
    assert prom.value('sum(role:pdserve_local_recompute_fallbacks:ratio_rate5m{role="decode"})') == 0
    # Latency quantiles are numbers, and the router's TTFT histogram holds every request (a latency bound
    # here would be one slow request away from a flake on a 2-core machine).
    assert prom.value("sum(job:pdserve_router_time_to_first_token_seconds:p99_rate1m)") > 0
    assert prom.value("sum(pdserve_router_time_to_first_token_seconds_count)") == observed.num_requests
    assert prom.value('sum(role:pdserve_inter_token_latency_seconds:p50_rate1m{role="decode"})') > 0
    assert prom.value("sum(pdserve_up_worker_restarts_total)") == 0
    # The repeated prompt hit the prefix cache; full blocks were stored in the host KV tiers.
    assert prom.value('sum(pdserve_kv_prefix_lookups_total{result="hit"})') >= 1
    assert prom.value("sum(pdserve_kv_prefix_cached_tokens_total)") > 0
    assert prom.value('sum(pdserve_kv_offload_bytes_total{direction="store"})') > 0
    assert prom.value('sum(pdserve_kv_offload_spans{state="total"})') > 0
    assert prom.value("sum(pdserve_kv_offload_stores_skipped_total)") == 0
