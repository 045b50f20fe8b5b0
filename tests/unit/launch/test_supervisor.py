"""The supervisor behind `pdserve up`: restart with backoff, counted; pure helpers of the launcher."""

from __future__ import annotations

import subprocess
import sys
import time

from services.launch.spawn import Daemon, Router, last_words
from services.launch.supervisor import Backoff, Child, Supervisor
from services.launch.up import prometheus_targets, up_ready_line


def test_backoff_doubles_to_a_ceiling() -> None:
    backoff = Backoff(first_s=1.0, max_s=30.0)
    assert [backoff.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def _sample(supervisor: Supervisor, name: str, **labels: str) -> float:
    return supervisor.metrics.registry.get_sample_value(name, labels)


def test_a_child_that_dies_is_started_again_and_counted() -> None:
    starts = []

    def start(spawned):
        proc = _sleeper()
        spawned(proc)
        starts.append(proc)
        return proc

    supervisor = Supervisor(backoff=Backoff(first_s=0.05, max_s=0.2))
    child = Child("decode", "decode worker", start, _sleeper())
    first = child.proc
    supervisor.watch(child)
    try:
        assert _sample(supervisor, "pdserve_up_workers", role="decode", state="running") == 1
        for n in (1, 2):
            child.proc.kill()
            deadline = time.monotonic() + 10
            while _sample(supervisor, "pdserve_up_worker_restarts_total", role="decode") < n:
                assert time.monotonic() < deadline, "not restarted"
                time.sleep(0.02)
            assert child.proc.poll() is None and child.restarts == n
        assert child.proc is starts[-1] and first.poll() is not None
        assert _sample(supervisor, "pdserve_up_worker_restarts_total", role="prefill") == 0
        assert _sample(supervisor, "pdserve_up_workers", role="decode", state="running") == 1
    finally:
        supervisor.stop()
        child.proc.kill()
        child.proc.wait()
    time.sleep(0.3)
    assert len(starts) == 2  # stopping the supervisor, then the child, starts nothing new


def test_a_failed_restart_is_retried() -> None:
    calls = []

    def start(spawned):
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise RuntimeError("port still in use")
        proc = _sleeper()
        spawned(proc)
        return proc

    supervisor = Supervisor(backoff=Backoff(first_s=0.05, max_s=0.2))
    child = Child("prefill", "prefill worker", start, _sleeper())
    supervisor.watch(child)
    try:
        child.proc.kill()
        deadline = time.monotonic() + 10
        while child.restarts < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert len(calls) == 3 and calls[2] - calls[1] >= calls[1] - calls[0]  # the wait grows
        assert _sample(supervisor, "pdserve_up_worker_restarts_total", role="prefill") == 1
    finally:
        supervisor.stop()
        child.proc.kill()
        child.proc.wait()


def test_last_words_prefer_the_daemons_own_error() -> None:
    out = ["loading\n", "Traceback (most recent call last):\n", "ValueError: bad\n",
           "pdserve: error: tensor-parallel size 2 cannot shard this model\n", "\n"]
    assert last_words(out) == "pdserve: error: tensor-parallel size 2 cannot shard this model"
    assert last_words(["Traceback\n", "RuntimeError: CUDA out of memory\n"]) == "RuntimeError: CUDA out of memory"
    assert last_words(["a\n", "b\n"]) == "b" and last_words([]) == "(no output)"


def _daemons() -> list[Daemon]:
    return [Daemon("prefill", None, 9001, 9101, "p", None), Daemon("decode", None, 9002, 9102, "d", None)]


def test_ready_line_names_every_worker_and_metrics_port() -> None:
    line = up_ready_line(Router(None, "0.0.0.0", 8000), _daemons(), "127.0.0.1", 9200)
    assert line == ("pdserve up: ready on http://0.0.0.0:8000/v1 (metrics http://0.0.0.0:8000/metrics); "
                    "prefill 127.0.0.1:9001 (metrics 127.0.0.1:9101), decode 127.0.0.1:9002 (metrics 127.0.0.1:9102); "
                    "supervisor metrics 127.0.0.1:9200")


def test_prometheus_targets_label_components_not_roles() -> None:
    groups = prometheus_targets(Router(None, "0.0.0.0", 8000), _daemons(), 9200)
    assert groups == [
        {"targets": ["127.0.0.1:8000"], "labels": {"pdserve_component": "router"}},
        {"targets": ["127.0.0.1:9101"], "labels": {"pdserve_component": "prefill"}},
        {"targets": ["127.0.0.1:9102"], "labels": {"pdserve_component": "decode"}},
        {"targets": ["127.0.0.1:9200"], "labels": {"pdserve_component": "supervisor"}},
    ]
