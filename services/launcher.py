"""Start pdserve daemons as child processes: ``pdserve up`` and the end-to-end tests use this.

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
from services.placement import Placement, detect_gpus, gpu_pool, plan_placement
from services.supervisor import Child, StartChild, Supervisor


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
        return f"http://{_local(self.host)}:{self.port}"


def _local(host: str) -> str:
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_router(model: str | None, prefill: list[str], decode: list[str], *extra: str, host: str = "127.0.0.1",
                 port: int = 0, direct_decode_threshold: int = 0, timeout_s: float = 120.0,
                 on_spawn: Callable[[subprocess.Popen], None] | None = None) -> Router:
    """Start ``pdserve router`` and return once its /health says ``ok`` (a compatible pair is healthy)."""
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


def visible_gpus(device: str) -> int:
    """The GPUs ``pdserve up`` can see; ``--device cpu`` asks for none, so torch is not even imported."""
    return 0 if device.strip() == "cpu" else detect_gpus()


def up_placement(args, num_gpus: int) -> Placement:
    """Where ``pdserve up`` puts each worker, from its flags and the visible GPU count (pure)."""
    pool = gpu_pool(args.device, num_gpus)
    return plan_placement(num_gpus, [_role_flag(args, "prefill", "tp")] * args.num_prefill,
                          [_role_flag(args, "decode", "tp")] * args.num_decode, args.prefill_gpus, args.decode_gpus,
                          gpus=None if args.device.strip() in ("auto", "cuda") else pool)


def up_worker_specs(args, worker_argv: list[str], placement: Placement) -> list[tuple[str, None, tuple[str, ...]]]:
    """The :func:`daemons` specs of ``pdserve up``: ``worker_argv`` with each role's tp and block size and
    each worker's ``--device`` from ``placement`` (pure, so tests check it without starting processes)."""
    specs = []
    if getattr(args, "kv_block_order", None) is None and mixed_tp(args):
        worker_argv = _set_flag(worker_argv, "--kv-block-order", "HND")
    for role, devices in (("prefill", placement.prefill), ("decode", placement.decode)):
        role_argv = _set_flag(worker_argv, "--tp", _role_flag(args, role, "tp"))
        role_argv = _set_flag(role_argv, "--block-size", _role_flag(args, role, "block_size"))
        specs += [(role, None, tuple(_set_flag(role_argv, "--device", device))) for device in devices]
    return specs


def mixed_tp(args) -> bool:
    """Prefill and decode workers of different TP sizes: each reader rank reads a head slice of every
    block, which is one descriptor per token and layer in NHD blocks but one per layer in HND ones."""
    return _role_flag(args, "prefill", "tp") != _role_flag(args, "decode", "tp")


def _role_flag(args, role: str, name: str) -> int:
    """``--prefill-tp`` etc. when given, else the flag both roles share (``--tp``)."""
    value = getattr(args, f"{role}_{name}")
    return getattr(args, name) if value is None else value


def _set_flag(argv: list[str], flag: str, value: object) -> list[str]:
    """A copy of ``argv`` with ``flag``'s value replaced, or the flag appended when absent."""
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = str(value)
    else:
        argv += [flag, str(value)]
    return argv


def run_up(args, worker_argv: list[str]) -> int:
    """``pdserve up``: router + N prefill + M decode workers here, kept running; Ctrl-C stops all.

    The placement goes to stderr as one line before anything starts. A worker that exits during
    start-up stops everything at once with its own message (exit 1). Once all serve, stdout gets one
    ready line naming every worker's role, address and metrics port, and a supervisor starts any child
    that dies again on its ports (:mod:`services.supervisor`).
    """
    placement = up_placement(args, visible_gpus(args.device))
    specs = up_worker_specs(args, worker_argv, placement)
    print(f"pdserve up: {placement.explanation}", file=sys.stderr, flush=True)
    if args.kv_block_order is None and mixed_tp(args):
        print("pdserve up: prefill and decode TP sizes differ: KV blocks are head-major (--kv-block-order HND) "
              "so each decode rank reads its heads as whole runs", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    supervisor = Supervisor()
    supervisor_port = supervisor.metrics.serve(args.host, args.metrics_port)
    starting = [spawn_daemon(role, model, *extra) for role, model, extra in specs]
    try:
        try:
            workers = wait_all_ready(starting)
        except DaemonFailed as e:
            tail = "".join(e.output[-20:])
            print(f"pdserve up: error: {e}\n{tail}", file=sys.stderr, flush=True)
            return 1
        for worker, (_role, _model, extra) in zip(workers, specs, strict=True):
            supervisor.watch(Child(worker.role, f"{worker.role} worker {worker.address}",
                                   _worker_restarter(worker, extra), worker.proc))
        router = _start_up_router(args, workers, supervisor)
        if args.prometheus_sd_file:
            write_prometheus_targets(args.prometheus_sd_file, router, workers, supervisor_port)
        print(up_ready_line(router, workers, _local(args.host), supervisor_port), flush=True)
        stop.wait()
    finally:
        supervisor.stop()
        routers = [c.proc for c in supervisor.children if c.role == "router"]
        terminate_all(routers)  # the router first: no new requests reach workers that are draining
        terminate_all([c.proc for c in supervisor.children if c.role != "router"] + [s.proc for s in starting])
    return 0


def _worker_restarter(worker: Daemon, extra: tuple[str, ...]) -> StartChild:
    """Start ``worker`` again on the ports it had, so the router's list and its peers' addresses hold."""
    def start(spawned: Callable[[subprocess.Popen], None]) -> subprocess.Popen:
        s = spawn_daemon(worker.role, None, *extra, "--port", str(worker.port), "--metrics-port",
                         str(worker.metrics_port))
        spawned(s.proc)
        return wait_ready(s).proc

    return start


def _start_up_router(args, workers: list[Daemon], supervisor: Supervisor) -> Router:
    prefill = [d.address for d in workers if d.role == "prefill"]
    decode = [d.address for d in workers if d.role == "decode"]
    extra = ["--served-model-name", args.served_model_name] if args.served_model_name else []

    def start(spawned: Callable[[subprocess.Popen], None]) -> subprocess.Popen:
        return start_router(args.model, prefill, decode, *extra, host=args.host, port=args.port,
                            direct_decode_threshold=args.direct_decode_threshold, on_spawn=spawned).proc

    router = Router(start(lambda proc: None), args.host, args.port)
    supervisor.watch(Child("router", f"router {router.url}", start, router.proc))
    return router


def up_ready_line(router: Router, workers: list[Daemon], metrics_host: str, supervisor_port: int) -> str:
    """``pdserve up: ready on URL/v1 ...``: where to send requests and where every process's metrics are."""
    listed = ", ".join(f"{d.role} {d.address} (metrics {metrics_host}:{d.metrics_port})" for d in workers)
    return (f"pdserve up: ready on {router.url}/v1 (metrics {router.url}/metrics); {listed}; "
            f"supervisor metrics {metrics_host}:{supervisor_port}")


def prometheus_targets(router: Router, workers: list[Daemon], supervisor_port: int) -> list[dict]:
    """Prometheus file-based service discovery for this ``up``: one target group per process. The label
    is ``pdserve_component``, not ``role``, which the workers' own series already carry."""
    host = _local(router.host)

    def group(component: str, port: int, target_host: str = "127.0.0.1") -> dict:
        return {"targets": [f"{target_host}:{port}"], "labels": {"pdserve_component": component}}

    return [group("router", router.port, host), *(group(d.role, d.metrics_port) for d in workers),
            group("supervisor", supervisor_port, host)]


def write_prometheus_targets(path: str, router: Router, workers: list[Daemon], supervisor_port: int) -> None:
    """Write the targets atomically (Prometheus watches the file and must never read half of it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(prometheus_targets(router, workers, supervisor_port), f, indent=1)
    os.replace(tmp, path)


def stop_router(router: Router, timeout_s: float = 30.0) -> int:
    return terminate(router.proc, timeout_s)
