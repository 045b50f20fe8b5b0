"""The images built and the compose stack run for real: `make compose-up BASE=local TLS=1`, requests through
the published port, KV pulled between containers, Prometheus scraping them, a crashed prefill container, a
draining `docker compose stop`, `make compose-down`.

The stack runs with mTLS on worker gRPC (docker-compose.tls.yml, certificates from deploy/tls/make-certs.sh
in a directory of the test's own): every call between containers, the health checks that gate the start and
the restart, and the drains all go through it; a plaintext caller on the compose network is refused.

Runs where a Docker engine can be had: one already serving, or `dockerd` (Debian's docker.io, which `make
install` puts in place with debootstrap) started here as root and stopped at the end (its image store stays,
so a second run finds the base image and the layers cached). BASE=local builds everything from Debian's mirror
and this machine's pip (deploy/docker/localbuild.py), so nothing beyond the package registries is contacted.
The stack runs under a project name and host ports of its own, published on 127.0.0.1 only. The timings of
each stage are written to build/container-timings.json (docs/deployment.md quotes them), the containers'
logs to build/container-logs.txt.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.deploy.tools import DEPLOY, REPO, tool

QUESTION = "What is the capital of France?"
TIMINGS = REPO / "build" / "container-timings.json"


def _docker_ok() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, timeout=30).returncode == 0


def _why_not() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI (make install puts Debian's docker.io in place)"
    if shutil.which("debootstrap") is None:
        return "no debootstrap (make install puts it in place)"
    if not _docker_ok() and (shutil.which("dockerd") is None or os.geteuid() != 0):
        return "no Docker engine serving, and no dockerd this user can start"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")]


@pytest.fixture(scope="module")
def docker_engine() -> Iterator[None]:
    """The engine already serving, or a dockerd started here (in a session of its own) and stopped after."""
    if _docker_ok():
        yield
        return
    log = open(Path(tempfile.gettempdir()) / f"pdserve-test-dockerd-{os.getpid()}.log", "wb")  # noqa: SIM115
    daemon = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _docker_ok():
            assert daemon.poll() is None, f"dockerd exited ({daemon.returncode}); see {log.name}"
            assert time.monotonic() < deadline, f"dockerd did not answer in 60 s; see {log.name}"
            time.sleep(1)
        yield
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    project: str
    http_port: int
    prometheus_port: int
    tls_dir: Path
    env: dict[str, str]
    timings_s: dict[str, float] = field(default_factory=dict)
    first_answer: dict = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def make(self, target: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        argv = ["make", "--no-print-directory", target, *self.make_args]
        result = subprocess.run(argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert result.returncode == 0, f"make {target} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
        return result

    @property
    def make_args(self) -> list[str]:
        return ["BASE=local", "TLS=1", f"TLS_DIR={self.tls_dir}", f"COMPOSE_PROJECT={self.project}"]

    def compose(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """Compose as the Makefile runs it for BASE=local TLS=1 (project, files, env file, profile, Prometheus
        image, certificates)."""
        argv = [tool("docker-compose"), "--project-name", self.project, "--project-directory", str(DEPLOY),
                "-f", str(DEPLOY / "docker-compose.yml"), "-f", str(DEPLOY / "docker-compose.tls.yml"),
                "--env-file", str(DEPLOY / "pdserve.env"), *args]
        env = {**self.env, "COMPOSE_PROFILES": "cpu", "PROMETHEUS_IMAGE": "pdserve-prometheus:bookworm",
               "PDSERVE_TLS_DIR": str(self.tls_dir)}
        result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        assert result.returncode == 0, result.stderr
        return result

    def container(self, service: str) -> str:
        ids = self.compose("ps", "--all", "--quiet", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str) -> dict:
        out = subprocess.run(["docker", "inspect", self.container(service)], capture_output=True, text=True,
                             check=True).stdout
        return json.loads(out)[0]

    def worker_metric(self, service: str, port: int, name: str) -> float:
        """A counter of a worker's /metrics, read inside its container (not published on the host)."""
        code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
        text = subprocess.run(["docker", "exec", self.container(service), "python", "-c", code],
                              capture_output=True, text=True, check=True, timeout=30).stdout
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def promql(self, query: str) -> list[dict]:
        answer = httpx.get(f"http://127.0.0.1:{self.prometheus_port}/api/v1/query", params={"query": query},
                           timeout=10).json()
        assert answer["status"] == "success", answer
        return answer["data"]["result"]


def chat(stack: Stack, max_tokens: int = 16, content: str = QUESTION, timeout_s: float = 180, **extra) -> dict:
    response = httpx.post(f"{stack.api}/v1/chat/completions", timeout=timeout_s, json={
        "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": max_tokens, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def _stage_seconds(output: str) -> dict[str, float]:
    """localbuild's own timings (cold runs only: a cached stage prints no time)."""
    found = {}
    for what, key in (("base image", "base_build_s"), ("wheelhouse", "wheelhouse_download_s")):
        match = re.search(rf"localbuild: {what} \S+ (?:built|downloaded) in (\d+) s", output)
        if match:
            found[key] = float(match.group(1))
    return found


@pytest.fixture(scope="module")
def stack(docker_engine, tmp_path_factory) -> Iterator[Stack]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "PDSERVE_", "PROMETHEUS_", "GRAFANA_"))}
    s = Stack(project=f"pdserve-test-{os.getpid()}", http_port=_free_port(), prometheus_port=_free_port(),
              tls_dir=tmp_path_factory.mktemp("tls") / "certs", env=env)
    s.env.update(PDSERVE_HTTP_PORT=str(s.http_port), PROMETHEUS_PORT=str(s.prometheus_port))
    try:
        started = time.monotonic()
        built = s.make("images", timeout_s=840)
        s.timings_s["images_s"] = time.monotonic() - started  # base + wheelhouse + both images, cached or not
        s.timings_s.update(_stage_seconds(built.stderr))
        started = time.monotonic()
        up = s.make("compose-up", timeout_s=600)
        s.timings_s["compose_up_s"] = time.monotonic() - started  # images checked (cached), stack healthy
        assert f"http://127.0.0.1:{s.http_port}/v1" in up.stdout, up.stdout
        started = time.monotonic()
        s.first_answer = chat(s)
        s.timings_s["first_answer_s"] = time.monotonic() - started
        TIMINGS.parent.mkdir(exist_ok=True)
        TIMINGS.write_text(json.dumps({k: round(v, 1) for k, v in s.timings_s.items()}, indent=1) + "\n")
        yield s
    finally:
        # What each container logged, for a failure's post-mortem (the stack is gone after this).
        with suppress(AssertionError, subprocess.SubprocessError):
            logs = s.compose("logs", "--no-color", "--timestamps")
            (REPO / "build").mkdir(exist_ok=True)
            (REPO / "build" / "container-logs.txt").write_text(logs.stdout + logs.stderr)
        subprocess.run(["make", "--no-print-directory", "compose-down", *s.make_args],
                       cwd=REPO, env=s.env, capture_output=True, timeout=300)
        subprocess.run(["docker", "volume", "rm", "-f", f"{s.project}_prometheus-data"], capture_output=True)


def test_chat_through_the_published_port_with_kv_pulled_between_containers(stack):
    answer = stack.first_answer["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    # The decode container read the prompt's KV from the prefill container over NIXL (UCX TCP between the two
    # network namespaces), and Prometheus counted the bytes from its scrape of the decode container.
    assert stack.worker_metric("decode", 9102, "pdserve_kv_transfer_bytes_total") > 0
    assert stack.worker_metric("decode", 9102, "pdserve_local_recompute_fallbacks_total") == 0
    deadline = time.monotonic() + 60
    while not [r for r in stack.promql('sum(pdserve_kv_transfer_bytes_total{job="pdserve-decode"}) > 0')]:
        assert time.monotonic() < deadline, "Prometheus never saw KV bytes pulled by the decode container"
        time.sleep(2)


def test_workers_require_mtls_and_their_health_checks_pass_with_it(stack):
    """Every worker serves TLS only: from the router's container, `pdserve health` reaches both workers by their
    service names with the container's certificate (the name checked is PDSERVE_TLS_SERVER_NAME), and the same
    call without it is refused; Docker's own health checks (the same command) report every container healthy."""
    router = stack.container("router")
    for service, port in (("prefill", 9001), ("decode", 9002)):
        assert stack.inspect(service)["State"]["Health"]["Status"] == "healthy", service
        probe = ["pdserve", "health", "--host", service, "--port", str(port)]
        with_tls = subprocess.run(["docker", "exec", router, *probe], capture_output=True, text=True, timeout=60)
        assert with_tls.returncode == 0, with_tls.stderr
        plaintext = subprocess.run(["docker", "exec", router, "env", "-u", "PDSERVE_TLS_CERT", "-u", "PDSERVE_TLS_KEY",
                                    "-u", "PDSERVE_TLS_CA", "-u", "PDSERVE_TLS_SERVER_NAME", *probe],
                                   capture_output=True, text=True, timeout=60)
        assert plaintext.returncode == 2 and "did not answer" in plaintext.stderr, plaintext.stderr


def test_every_prometheus_target_is_up(stack):
    deadline = time.monotonic() + 60
    while True:
        targets = httpx.get(f"http://127.0.0.1:{stack.prometheus_port}/api/v1/targets", timeout=10).json()
        active = targets["data"]["activeTargets"]
        jobs = {t["labels"]["job"]: t["health"] for t in active}
        if set(jobs) >= {"pdserve-router", "pdserve-prefill", "pdserve-decode", "prometheus"} and \
                all(t["health"] == "up" for t in active):
            return
        down = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in active if t["health"] != "up"]
        assert time.monotonic() < deadline, f"targets not all up: {jobs} {down}"
        time.sleep(2)


def test_prefill_container_killed_with_requests_in_flight(stack):
    """The prefill container dies under load: every request is answered (the decode worker prefills what it
    cannot pull), Docker restarts the container by its policy, and the decode container pulls from it again.

    The container's process is killed with SIGKILL from the host, as a crash or the OOM killer does. `docker
    kill` itself would not do: Docker counts it as a stop by hand and cancels the restart policy."""
    before = stack.inspect("prefill")
    bytes_before = stack.worker_metric("decode", 9102, "pdserve_kv_transfer_bytes_total")
    stop = threading.Event()

    def client(i: int) -> list[dict]:
        answers = []
        while not stop.is_set():
            answers.append(chat(stack, max_tokens=24, content=f"{QUESTION} ({i}.{len(answers)})"))
        return answers

    with ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client, i) for i in range(4)]
        time.sleep(3)
        os.kill(before["State"]["Pid"], signal.SIGKILL)
        time.sleep(8)  # requests keep coming while the prefill container is down or restarting
        stop.set()
        answers = [a for c in clients for a in c.result(timeout=300)]
    assert len(answers) >= 8, f"only {len(answers)} requests completed"
    for a in answers:
        assert a["choices"][0]["finish_reason"] in ("stop", "length"), a
        assert a["choices"][0]["message"]["content"], a

    deadline = time.monotonic() + 240
    while True:
        after = stack.inspect("prefill")
        healthy = after["State"].get("Health", {}).get("Status") == "healthy"
        if after["RestartCount"] > before["RestartCount"] and healthy:
            break
        assert time.monotonic() < deadline, f"prefill not restarted and healthy: {after['State']}"
        time.sleep(2)
    assert after["State"]["Pid"] != before["State"]["Pid"]

    # The router takes the restarted worker back (DNS refresh, health, pair probe), then KV flows from it again.
    pulled_again = stack.worker_metric("decode", 9102, "pdserve_kv_transfer_bytes_total")
    deadline = time.monotonic() + 120
    while pulled_again <= bytes_before:
        assert time.monotonic() < deadline, "the decode container never pulled from the restarted prefill container"
        assert "Paris" in chat(stack)["choices"][0]["message"]["content"]
        pulled_again = stack.worker_metric("decode", 9102, "pdserve_kv_transfer_bytes_total")
        time.sleep(1)
    assert "Paris" in chat(stack)["choices"][0]["message"]["content"]


def test_compose_stop_drains_without_cutting_a_request_then_compose_down(stack):
    """`docker compose stop` with requests in flight: the router stops first and finishes what it started, the
    workers drain and exit 0 (no SIGKILL at the grace period); then `make compose-down` removes the stack."""
    # 48 tokens each, never stopping early: seconds of decoding on two shared cores, well inside the router's
    # 30 s graceful shutdown (uvicorn's timeout_graceful_shutdown), which would cancel a longer one.
    def long_request(n: int) -> tuple[dict, float]:
        answer = chat(stack, 48, f"{QUESTION} Then tell story number {n} about it.", ignore_eos=True)
        return answer, time.monotonic()

    with ThreadPoolExecutor(3) as pool:
        inflight = [pool.submit(long_request, n) for n in range(3)]
        time.sleep(1.5)
        started = time.monotonic()
        stack.compose("stop", timeout_s=200)
        stop_s = time.monotonic() - started
        answers = [f.result(timeout=200) for f in inflight]
    for answer, done_at in answers:
        assert done_at > started, "a request finished before the stop began: nothing was in flight"
        assert answer["choices"][0]["finish_reason"] == "length", answer
        assert answer["usage"]["completion_tokens"] == 48, answer["usage"]
    for service in ("router", "prefill", "decode"):
        state = stack.inspect(service)["State"]
        # uvicorn re-raises the SIGTERM it handled once its graceful shutdown is done: the router exits 143.
        clean = (0, 143) if service == "router" else (0,)
        assert state["Status"] == "exited" and state["ExitCode"] in clean and not state["OOMKilled"], (service, state)
    assert stop_s < 45, f"compose stop took {stop_s:.0f} s: something waited for the SIGKILL"

    stack.make("compose-down", timeout_s=300)
    left = subprocess.run(["docker", "ps", "--all", "--quiet", "--filter",
                           f"label=com.docker.compose.project={stack.project}"], capture_output=True, text=True)
    assert left.stdout.split() == [], f"containers left after compose-down: {left.stdout}"
