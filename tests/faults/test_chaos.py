"""Chaos under load: 2 prefill + 2 decode workers, one of each reached through a TCP proxy; while 8 clients
stream, a decode worker and a prefill worker are killed with SIGKILL and restarted on their ports, and the
proxied links are reset and blackholed. Every request must be answered 200 with the tokens of a fault-free run,
none may hang, and afterwards every worker is back to zero: nothing running, no KV block pinned or used.

The faults come one at a time, each once the stack can take it (the killed worker is back before the next link
goes), so there is always a decode worker to fail over to: what is tested is that nothing is lost, not what
happens with no worker left (that is a 503, tests/faults/test_faults.py).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import pytest

from services.launch.spawn import Daemon, daemons, spawn_daemon, start_router, stop_router, wait_ready
from tests.e2e.proxy import TCPProxy
from tests.e2e.stack import DECODE_ARGS, http_get
from tests.faults.harness import (
    DEADLINE_S,
    FaultReport,
    prefill_args,
    prompts,
    record,
    references,
    router_metric_total,
    run_load,
    run_request,
)

NUM_BLOCKS = 512  # the stacks' --num-kv-blocks
MAX_TOKENS = 48
# A reader killed mid-READ never notifies; the router releases its ticket when the request ends, so the lease
# (shorter than the settle wait) may free at most one ticket per request that failed over.
LEASE_S = 10.0

pytestmark = pytest.mark.slow


def _wait_worker(url: str, address: str, healthy: bool, timeout_s: float = 60.0) -> None:
    """Until the router's /health lists ``address`` healthy (or, with ``healthy=False``, not healthy)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = http_get(f"{url}/health", timeout=5).json().get("workers", [])
        state = next((w["state"] for w in workers if w["address"] == address), None)
        if (state in ("healthy", "unpaired")) == healthy:
            return
        time.sleep(0.2)
    raise AssertionError(f"the router never saw {address} {'healthy' if healthy else 'down'}")


class Chaos:
    """The fault schedule, run in its own thread once the load streams; what it did, for the assertions."""

    def __init__(self, url: str, model: str, prefill: list[Daemon], decode: list[Daemon],
                 proxies: dict[str, TCPProxy]) -> None:
        self.url, self.model = url, model
        self.prefill, self.decode, self.proxies = prefill, decode, proxies
        self.done: list[str] = []
        self.restarted: list[Daemon] = []  # started here: the test stops them
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def run(self) -> None:
        try:
            self._restart("decode", 0)
            self._restart("prefill", 0)
            self._cut("decode")
            self._blackhole("decode", 5.0)
            self._cut("prefill")
        except BaseException as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
            self.error = exc
        finally:
            self.finished.set()

    def _restart(self, role: str, index: int) -> None:
        workers = self.prefill if role == "prefill" else self.decode
        victim = workers[index]
        victim.kill()
        self.done.append(f"kill -9 {role}")
        args = prefill_args(LEASE_S) if role == "prefill" else DECODE_ARGS
        workers[index] = wait_ready(spawn_daemon(role, self.model, *args, "--port", str(victim.port)))
        self.restarted.append(workers[index])
        _wait_worker(self.url, victim.address, healthy=True)

    def _cut(self, role: str) -> None:
        time.sleep(1.0)
        assert self.proxies[role].cut() > 0, f"no connection to cut through the {role} proxy"
        self.done.append(f"reset {role} link")
        time.sleep(1.0)

    def _blackhole(self, role: str, seconds: float) -> None:
        proxy = self.proxies[role]
        proxy.blackhole()
        self.done.append(f"blackhole {role} link {seconds:g} s")
        time.sleep(seconds)
        proxy.restore()
        _wait_worker(self.url, proxy.address, healthy=True)


def _jobs(url: str, pool: list[list[int]], refs: list[list[int]], count: int,
          on_event: Callable[[int], None]) -> list:
    return [functools.partial(run_request, url, pool[i % len(pool)], MAX_TOKENS, refs[i % len(refs)], on_event)
            for i in range(count)]


def test_kills_and_link_faults_under_load_lose_nothing(model: str) -> None:
    specs = [("prefill", model, prefill_args(LEASE_S))] * 2 + [("decode", model, DECODE_ARGS)] * 2
    with daemons(*specs) as started:
        prefill = [d for d in started if d.role == "prefill"]
        decode = [d for d in started if d.role == "decode"]
        proxies = {"prefill": TCPProxy(prefill[1].port), "decode": TCPProxy(decode[1].port)}
        router = start_router(model, [prefill[0].address, proxies["prefill"].address],
                              [decode[0].address, proxies["decode"].address], "--health-interval-s", "0.5")
        chaos = Chaos(router.url, model, prefill, decode, proxies)
        try:
            pool = prompts(12, seed=11, low=12, high=60)
            refs = references(router.url, pool, MAX_TOKENS)
            schedule = threading.Thread(target=chaos.run, daemon=True)
            started_once = threading.Lock()

            def start_chaos(_: int) -> None:
                with started_once:
                    if not schedule.is_alive() and not chaos.finished.is_set():
                        schedule.start()

            report = FaultReport("chaos: kill -9 P and D, reset and blackhole links")
            began = time.monotonic()
            # Load until the schedule is through: batches of requests, each batch streaming while faults land.
            while not chaos.finished.is_set():
                run_load(report, _jobs(router.url, pool, refs, 16, start_chaos), concurrency=8)
                assert time.monotonic() - began < 240, "the fault schedule did not finish"
            schedule.join(timeout=DEADLINE_S)
            assert chaos.error is None, chaos.error
            failovers = router_metric_total(router, "pdserve_router_decode_failovers_total")
            print(f"chaos: {' ; '.join(chaos.done)}; {report}; {failovers:g} decode failovers")
            assert report.completed == report.sent, report  # every request 200 with the fault-free tokens
            assert failovers > 0, "decode workers broke under load, yet no request failed over"
            record(report, [*prefill, *decode], NUM_BLOCKS, max_lease_expiries=int(failovers))
        finally:
            stop_router(router)
            for proxy in proxies.values():
                proxy.close()
            for worker in chaos.restarted:
                if worker.proc.poll() is None:
                    worker.kill()
