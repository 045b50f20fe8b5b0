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
from contextlib import contextmanager
from dataclasses import dataclass, field

from services.placement import Placement, detect_gpus, gpu_pool, plan_placement


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
    """Hand lines to the launcher until the ready line, then pass the daemon's log through to stderr."""
    ready = False
    for line in proc.stdout:
        if ready:
            sys.stderr.write(f"[{role} {proc.pid}] {line}")
        else:
            lines.put(line)
            ready = line.startswith('{"ready"')


def wait_ready(s: _Starting, timeout_s: float = 300.0) -> Daemon:
    seen = []
    while True:
        try:
            line = s.lines.get(timeout=timeout_s)
        except queue.Empty:
            s.proc.kill()
            raise RuntimeError(f"{s.role} daemon not ready after {timeout_s}s:\n{''.join(seen)}") from None
        seen.append(line)
        if line.startswith('{"ready"'):
            ready = json.loads(line)
            return Daemon(s.role, s.proc, ready["port"], ready.get("metrics_port", 0), ready.get("engine_id", ""),
                          s.lines)
        if s.proc.poll() is not None and s.lines.empty():
            raise RuntimeError(f"{s.role} daemon exited with {s.proc.returncode}:\n{''.join(seen)}")


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


def stop_daemon(d: Daemon, timeout_s: float = 30.0) -> int:
    return terminate(d.proc, timeout_s)


@contextmanager
def daemons(*specs: tuple[str, str, tuple[str, ...]]):
    """Start several daemons at once (they load their models in parallel) and stop them all after."""
    starting = [spawn_daemon(role, model, *extra) for role, model, extra in specs]
    started: list[Daemon] = []
    try:
        for s in starting:
            started.append(wait_ready(s))
        yield started
    finally:
        for d in started:
            stop_daemon(d)
        for s in starting[len(started):]:
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_router(model: str | None, prefill: list[str], decode: list[str], *extra: str, host: str = "127.0.0.1",
                 port: int = 0, direct_decode_threshold: int = 0, timeout_s: float = 120.0) -> Router:
    """Start ``pdserve router`` and return once its /health answers 200 (a healthy pair exists)."""
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "services.cli", "router", "--host", host, "--port", str(port),
           "--direct-decode-threshold", str(direct_decode_threshold), "--health-interval-s", "0.5", *extra]
    if model:
        cmd += ["--model", model]
    if prefill:
        cmd += ["--prefill", ",".join(prefill)]
    cmd += ["--decode", ",".join(decode)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    router = Router(proc, host, port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{router.url}/health", timeout=2) as response:
                if response.status == 200:
                    return router
        except OSError:
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
    """``pdserve up``: router + N prefill + M decode workers here; one line when ready; Ctrl-C stops all.

    The placement goes to stderr as one line before anything starts; stdout keeps its one ready line.
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
    with daemons(*specs) as started:
        prefill = [d.address for d in started if d.role == "prefill"]
        decode = [d.address for d in started if d.role == "decode"]
        extra = ["--served-model-name", args.served_model_name] if args.served_model_name else []
        router = start_router(args.model, prefill, decode, *extra, host=args.host, port=args.port,
                              direct_decode_threshold=args.direct_decode_threshold)
        try:
            print(f"pdserve up: ready on {router.url}/v1 ({len(prefill)} prefill at {','.join(prefill) or '-'}, "
                  f"{len(decode)} decode at {','.join(decode)})", flush=True)
            while not stop.is_set() and router.proc.poll() is None:
                stop.wait(0.5)
        finally:
            stop_router(router)
    return 0


def stop_router(router: Router, timeout_s: float = 30.0) -> int:
    return terminate(router.proc, timeout_s)
