"""Keep ``pdserve up``'s children running: a child that dies after start-up is started again, with backoff.

Each child (the router, every worker) gets a thread that waits for its process to exit. An exit the
supervisor did not ask for counts as a restart: the thread sleeps (1 s, doubling to 30 s; back to 1 s
once a run lasted a minute) and starts the child again on the same ports, so the router's worker list
and every peer's address stay valid; the restarted worker has a new epoch, which fences off KV state
peers cached from its previous life. Restarts are counted in ``pdserve_up_worker_restarts_total`` on
the supervisor's own ``/metrics``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.metrics import serve_metrics

log = logging.getLogger(__name__)

ROLES = ("router", "prefill", "decode")


@dataclass(frozen=True)
class Backoff:
    """Delay before the n-th restart in a row; a run longer than ``stable_s`` starts the count over."""

    first_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0

    def delay(self, consecutive: int) -> float:
        return min(self.first_s * 2 ** max(consecutive - 1, 0), self.max_s)


class SupervisorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.restarts = Counter("pdserve_up_worker_restarts", "Children started again after they died, by role",
                                ["role"], registry=self.registry)
        self.workers = Gauge("pdserve_up_workers", "Children by role and state (running or restarting)",
                             ["role", "state"], registry=self.registry)
        for role in ROLES:
            self.restarts.labels(role)
            for state in ("running", "restarting"):
                self.workers.labels(role, state)

    def serve(self, host: str, port: int) -> int:
        return serve_metrics(self.registry, host, port)


# Starts a child and returns once it serves (or raises); it hands the process to its argument as soon
# as it exists, so a shutdown during a restart stops that process too.
StartChild = Callable[[Callable[[subprocess.Popen], None]], subprocess.Popen]


@dataclass
class Child:
    """One supervised process and how to start it again."""

    role: str
    name: str
    start: StartChild
    proc: subprocess.Popen
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(self, metrics: SupervisorMetrics | None = None, backoff: Backoff | None = None) -> None:
        self.metrics = metrics or SupervisorMetrics()
        self.backoff = backoff or Backoff()
        self.children: list[Child] = []
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def watch(self, child: Child) -> None:
        """Restart ``child`` whenever it exits, until :meth:`stop`."""
        self.children.append(child)
        self.metrics.workers.labels(child.role, "running").inc()
        thread = threading.Thread(target=self._keep_running, args=(child,), name=f"supervise-{child.name}",
                                  daemon=True)
        thread.start()
        self._threads.append(thread)

    def _keep_running(self, child: Child) -> None:
        consecutive = 0
        while True:
            code = child.proc.wait()
            if self.stopping:
                return
            consecutive = 1 if time.monotonic() - child.started_at > self.backoff.stable_s else consecutive + 1
            delay = self.backoff.delay(consecutive)
            log.warning("%s exited with code %s; starting it again in %.0f s", child.name, code, delay)
            print(f"pdserve up: {child.name} exited with code {code}; restarting in {delay:g} s", file=sys.stderr,
                  flush=True)
            self._set_state(child.role, "running", "restarting")
            while not self._stopping.wait(delay):
                try:
                    child.start(lambda proc: setattr(child, "proc", proc))
                    break
                except Exception as e:  # a failed start is retried like a crash, with a longer wait
                    consecutive += 1
                    delay = self.backoff.delay(consecutive)
                    log.warning("%s did not start again (%s); next try in %.0f s", child.name, e, delay)
            if self.stopping:
                return
            child.restarts += 1
            child.started_at = time.monotonic()
            self.metrics.restarts.labels(child.role).inc()
            self._set_state(child.role, "restarting", "running")
            print(f"pdserve up: {child.name} serves again (restart {child.restarts})", file=sys.stderr, flush=True)

    def _set_state(self, role: str, old: str, new: str) -> None:
        self.metrics.workers.labels(role, old).dec()
        self.metrics.workers.labels(role, new).inc()

    def stop(self) -> None:
        """No more restarts; the caller stops the processes themselves."""
        self._stopping.set()
