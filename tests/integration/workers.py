"""Start real pdserve worker daemons as subprocesses for tests, and talk to them over gRPC."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Daemon:
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


def start_daemon(role: str, model: str, *extra: str, timeout_s: float = 120.0) -> Daemon:
    """Start ``pdserve <role>`` on a free port; return once it printed its ready line."""
    cmd = [sys.executable, "-m", "services.cli", role, "--model", model, "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen = []
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            proc.kill()
            raise RuntimeError(f"{role} daemon not ready after {timeout_s}s:\n{''.join(seen)}") from None
        seen.append(line)
        if line.startswith('{"ready"'):
            ready = json.loads(line)
            return Daemon(proc, ready["port"], ready["metrics_port"], ready["engine_id"], lines)
        if proc.poll() is not None and lines.empty():
            raise RuntimeError(f"{role} daemon exited with {proc.returncode}:\n{''.join(seen)}")


def stop_daemon(d: Daemon, timeout_s: float = 30.0) -> int:
    """SIGTERM (drain), then kill if it does not exit in time; returns the exit code."""
    if d.proc.poll() is None:
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
    return d.proc.returncode


@contextmanager
def daemons(*specs: tuple[str, str, tuple[str, ...]]):
    started: list[Daemon] = []
    try:
        for role, model, extra in specs:
            started.append(start_daemon(role, model, *extra))
        yield started
    finally:
        for d in started:
            stop_daemon(d)
