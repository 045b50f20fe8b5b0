"""``pdserve up``: place router, prefill and decode workers on this machine's GPUs, start them, keep them up."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from services.launch.placement import Placement, detect_gpus, gpu_pool, plan_placement
from services.launch.spawn import (
    Daemon,
    DaemonFailed,
    Router,
    local_host,
    spawn_daemon,
    start_router,
    terminate_all,
    wait_all_ready,
    wait_ready,
)
from services.launch.supervisor import Child, StartChild, Supervisor
from services.launch.up_flags import (
    child_environment,
    direct_decode_threshold,
    process_argv,
    up_router_argv,
    up_router_config,
)


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
    """The :func:`daemons` specs of ``pdserve up``: ``worker_argv`` (the engine's flags) with the role's own
    flags from ``up``'s (:func:`~services.launch.up_flags.process_argv`), each role's tp and block size and
    each worker's ``--device`` from ``placement`` (pure, so tests check it without starting processes)."""
    specs = []
    switching = getattr(args, "role_planner", False)
    if switching:
        check_switchable(args)
        worker_argv = [*worker_argv, "--role-switching"]
    for role, devices in (("prefill", placement.prefill), ("decode", placement.decode)):
        role_argv = [*worker_argv, *process_argv(args, role, role_planner=switching)]
        role_argv = _set_flag(role_argv, "--tp", _role_flag(args, role, "tp"))
        # The other role's TP size: with --kv-layout auto, different sizes pick the heads-outer KV layout.
        role_argv = _set_flag(role_argv, "--peer-tp-size", _role_flag(args, _PEER_ROLE[role], "tp"))
        role_argv = _set_flag(role_argv, "--block-size", _role_flag(args, role, "block_size"))
        role_argv = _set_flag(role_argv, "--kv-cache-dtype", _role_flag(args, role, "kv_cache_dtype"))
        if kv_dtypes_differ(args) and "--kv-staging-mib" not in role_argv:
            role_argv += ["--kv-staging-mib", str(CONVERTING_STAGING_MIB)]  # a converting pair moves KV staged only
        specs += [(role, None, tuple(_set_flag(role_argv, "--device", device))) for device in devices]
    return specs


def check_switchable(args) -> None:
    """``--role-planner`` switches workers' roles in place, so every worker runs the same engine flags: per-role
    TP sizes or block sizes that differ would make a switched worker the wrong shape for its new role."""
    for name in ("tp", "block_size", "kv_cache_dtype"):
        if _role_flag(args, "prefill", name) != _role_flag(args, "decode", name):
            flag = name.replace("_", "-")
            raise ValueError(f"--role-planner starts every worker with the same engine flags (a worker may serve "
                             f"either role): --prefill-{flag} and --decode-{flag} must not differ")


_PEER_ROLE = {"prefill": "decode", "decode": "prefill"}
#: The staging area each worker gets when the roles' KV dtypes differ and ``--kv-staging-mib`` is not given (a
#: converting pair moves every ticket through both sides' areas: services/kv/spec/kv_convert.py).
CONVERTING_STAGING_MIB = 256


def kv_dtypes_differ(args) -> bool:
    """``--prefill-kv-cache-dtype`` and ``--decode-kv-cache-dtype`` differ (the pair converts, or is refused by name
    on the router's ``/health`` when it cannot)."""
    return _role_flag(args, "prefill", "kv_cache_dtype") != _role_flag(args, "decode", "kv_cache_dtype")


def mixed_tp(args) -> bool:
    """Prefill and decode workers of different TP sizes: each reader rank reads a head slice of every
    block, one run per block in the heads-outer KV layout (``--kv-layout auto`` picks it from
    ``--peer-tp-size``) but one per layer and K/V in cross-layer HND blocks, and per token in NHD ones."""
    return _role_flag(args, "prefill", "tp") != _role_flag(args, "decode", "tp")


def _role_flag(args, role: str, name: str) -> int | str:
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

    A secret given on ``up``'s command line reaches its processes through their environment, never theirs.
    """
    os.environ.update(child_environment(args))
    up_router_config(args)  # the router's rules and files, checked before anything starts
    placement = up_placement(args, visible_gpus(args.device))
    specs = up_worker_specs(args, worker_argv, placement)
    print(f"pdserve up: {placement.explanation}", file=sys.stderr, flush=True)
    if mixed_tp(args) and args.kv_layout in (None, "auto") and args.kv_block_order in (None, "HND"):
        print("pdserve up: prefill and decode TP sizes differ: the workers' KV layout is heads-outer (--kv-layout "
              "auto with --peer-tp-size), so each decode rank reads its heads of a block as one run",
              file=sys.stderr, flush=True)
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
        print(up_ready_line(router, workers, local_host(args.host), supervisor_port), flush=True)
        stop.wait()
    finally:
        supervisor.stop()
        routers = [c.proc for c in supervisor.children if c.role == "router"]
        terminate_all(routers)  # the router first: no new requests reach workers that are draining
        terminate_all([c.proc for c in supervisor.children if c.role != "router"] + [s.proc for s in starting],
                      stop_timeout_s(args))
    return 0


def _worker_restarter(worker: Daemon, extra: tuple[str, ...]) -> StartChild:
    """Start ``worker`` again on the ports it had, so the router's list and its peers' addresses hold."""
    def start(spawned: Callable[[subprocess.Popen], None]) -> subprocess.Popen:
        s = spawn_daemon(worker.role, None, *extra, "--port", str(worker.port), "--metrics-port",
                         str(worker.metrics_port))
        spawned(s.proc)
        return wait_ready(s).proc

    return start


def stop_timeout_s(args: argparse.Namespace) -> float:
    """How long ``up`` lets a worker drain on Ctrl-C before it kills it: the workers' ``--drain-timeout-s``
    and a margin to exit, at least the 30 s of ``terminate``."""
    return max(float(getattr(args, "drain_timeout_s", 30.0)) + 15.0, 30.0)


def _start_up_router(args, workers: list[Daemon], supervisor: Supervisor) -> Router:
    prefill = [d.address for d in workers if d.role == "prefill"]
    decode = [d.address for d in workers if d.role == "decode"]
    extra = up_router_argv(args)

    def start(spawned: Callable[[subprocess.Popen], None]) -> subprocess.Popen:
        return start_router(None, prefill, decode, *extra, host=args.host, port=args.port,  # --model: in extra
                            direct_decode_threshold=direct_decode_threshold(args), on_spawn=spawned).proc

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
    host = local_host(router.host)

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
