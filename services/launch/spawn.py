"""Spawn primitives: start pdserve daemons and a router as child processes, wait for them, stop them.

``pdserve up`` (``services.launch.up``), the end-to-end tests and the benches use these.

Each daemon prints one JSON line ``{"ready": true, "port": ...}`` when it serves; the launcher waits
for it, so ports can be picked by the OS (``--port 0``) and nothing races a half-started process.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field

from services.common.addresses import WILDCARD_HOSTS


@dataclass
class Daemon:
    role: str
    proc: subprocess.Popen
    port: int
    metrics_port: int
    engine_id: str
    lines: queue.Queue = field(repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@dataclass
class _Starting:
    role: str
    proc: subprocess.Popen
    lines: queue.Queue


def spawn_daemon(role: str, model: str | None, *extra: str) -> _Starting:
    """Start ``pdserve <role>`` on a free port without waiting for it (see :func:`wait_ready`)."""
    model_args = ["--model", model] if model else []
    cmd = [sys.executable, "-m", "services.cli", role, *model_args, "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(role, proc, lines), daemon=True).start()
    return _Starting(role, proc, lines)


def _pump(role: str, proc: subprocess.Popen, lines: queue.Queue) -> None:
    """Hand lines to the launcher until the ready line, then pass the daemon's log through to stderr.

    ``None`` on the queue says the daemon closed its output (it exited) before it was ready.
    """
    ready = False
    for line in proc.stdout:
        if ready:
            sys.stderr.write(f"[{role} {proc.pid}] {line}")
        else:
            lines.put(line)
            ready = line.startswith('{"ready"')
    if not ready:
        lines.put(None)


class DaemonFailed(RuntimeError):
    """A daemon exited, or was not ready in time, during start-up; ``output`` is what it printed."""

    def __init__(self, message: str, output: list[str]) -> None:
        super().__init__(message)
        self.output = output


def last_words(output: list[str]) -> str:
    """The line that says why a daemon stopped: its own ``pdserve...`` error, else the last error-looking
    line (a traceback's last line), else the last line it printed."""
    lines = [line.strip() for line in output if line.strip()]
    for wanted in (lambda line: line.startswith("pdserve"), lambda line: "Error" in line or "error" in line):
        found = [line for line in lines if wanted(line)]
        if found:
            return found[-1]
    return lines[-1] if lines else "(no output)"


def wait_ready(s: _Starting, timeout_s: float = 300.0) -> Daemon:
    """Wait for ``s``'s ready line; raise :class:`DaemonFailed` at once if it exits first."""
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while True:
        try:
            line = s.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            s.proc.kill()
            s.proc.wait()
            raise DaemonFailed(f"{s.role} worker not ready after {timeout_s:g} s", seen) from None
        if line is None:
            code = s.proc.wait()
            raise DaemonFailed(f"{s.role} worker exited with code {code} during start-up: {last_words(seen)}", seen)
        seen.append(line)
        if line.startswith('{"ready"'):
            ready = json.loads(line)
            return Daemon(s.role, s.proc, ready["port"], ready.get("metrics_port", 0), ready.get("engine_id", ""),
                          s.lines)


def wait_all_ready(starting: list[_Starting], timeout_s: float = 300.0) -> list[Daemon]:
    """Wait for every daemon at once: the first to fail stops the others and its error is raised, so a
    worker that cannot start is reported as soon as it exits, not after the others finish loading."""
    with ThreadPoolExecutor(max_workers=max(len(starting), 1)) as pool:
        futures = [pool.submit(wait_ready, s, timeout_s) for s in starting]
        for future in as_completed(futures):
            if future.exception() is not None:
                for s in starting:
                    if s.proc.poll() is None:
                        s.proc.kill()
                raise future.exception()
        return [f.result() for f in futures]


def start_daemon(role: str, model: str | None, *extra: str, timeout_s: float = 300.0) -> Daemon:
    """Start ``pdserve <role>`` on a free port; return once it printed its ready line."""
    return wait_ready(spawn_daemon(role, model, *extra), timeout_s)


def terminate(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM (the daemons drain on it), then kill if it does not exit in time; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def terminate_all(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """SIGTERM every process at once (they drain in parallel), then wait for each."""
    with ThreadPoolExecutor(max_workers=max(len(procs), 1)) as pool:
        list(pool.map(lambda proc: terminate(proc, timeout_s), procs))


def stop_daemon(d: Daemon, timeout_s: float = 30.0) -> int:
    return terminate(d.proc, timeout_s)


@contextmanager
def daemons(*specs: tuple[str, str, tuple[str, ...]]):
    """Start several daemons at once (they load their models in parallel) and stop them all after."""
    starting = [spawn_daemon(role, model, *extra) for role, model, extra in specs]
    started: list[Daemon] = []
    try:
        started = wait_all_ready(starting)
        yield started
    finally:
        terminate_all([d.proc for d in started])
        for s in starting:
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()


@dataclass
class Router:
    proc: subprocess.Popen
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def local_url(self) -> str:
        """Where this machine reaches it (a router listening on every address answers on 127.0.0.1)."""
        return f"http://{local_host(self.host)}:{self.port}"


def local_host(host: str) -> str:
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_router(model: str | None, prefill: list[str], decode: list[str], *extra: str, host: str = "127.0.0.1",
                 port: int = 0, direct_decode_threshold: int | str = 0, timeout_s: float = 120.0,
                 on_spawn: Callable[[subprocess.Popen], None] | None = None) -> Router:
    """Start ``pdserve router`` and return once its /health says ``ok`` (a compatible pair is healthy).

    ``direct_decode_threshold``: 0 (the default here: tests and benchmarks that measure disaggregation get
    it on every request), a token count, or ``"auto"`` (the router's cost-based choice, ``pdserve up``'s)."""
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "services.cli", "router", "--host", host, "--port", str(port),
           "--direct-decode-threshold", str(direct_decode_threshold), "--health-interval-s", "0.5", *extra]
    if model:
        cmd += ["--model", model]
    if prefill:
        cmd += ["--prefill", ",".join(prefill)]
    cmd += ["--decode", ",".join(decode)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if on_spawn is not None:
        on_spawn(proc)
    router = Router(proc, host, port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{router.local_url}/health", timeout=2) as response:
                if json.loads(response.read()).get("status") == "ok":
                    return router
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"router not healthy after {timeout_s}s")


def stop_router(router: Router, timeout_s: float = 30.0) -> int:
    return terminate(router.proc, timeout_s)
