"""``pdserve up``'s command line: its own flags, and which process each of the others goes to.

The table (:func:`up_flag_table`) is generated from the declarations: a flag of ``EngineConfig`` goes to every
worker, one of ``PrefillConfig`` / ``DecodeConfig`` to the workers of that role (both when both declare it), one
of ``RouterConfig`` to the router, the mTLS flags (``services.common.tls``) to every process; a name several
declare goes to all of them (``--kv-auth-token``: the router and every worker). A flag added to a config later
reaches ``pdserve up`` by itself. Left out, each with its reason: :data:`EXCLUDED` (what makes no sense for a
stack on one machine) and :data:`UP_OWN` (names ``up`` declares itself, for the whole stack).

How a value travels: the engine's flags as before (every value, ``argv_from_args``); the workers' and the
router's only when given, as typed (``add_forwarded_flags``), so each child keeps its own defaults and reads
its own ``PDSERVE_*`` variables, which it inherits; a secret (``flag(secret=True)``) never on a child's command
line, where ``ps`` shows it, but in its declared environment variable.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

from services.common.config_flags import (
    add_flags,
    add_forwarded_flags,
    declared_flags,
    positive_float,
    positive_int,
)
from services.common.tls import ENV as TLS_ENV
from services.common.tls import add_tls_arguments
from services.engine.engine_config import EngineConfig
from services.router.config import RouterConfig
from services.worker.config import DecodeConfig, PrefillConfig, SwitchableConfig

ROUTER, PREFILL, DECODE = "router", "prefill", "decode"
WORKERS = frozenset({PREFILL, DECODE})
EVERY = frozenset({ROUTER, PREFILL, DECODE})
ENGINE, FORWARDED, TLS = "engine", "forwarded", "tls"  # how up parses a flag and hands it on (module docstring)

EXCLUDED: dict[str, str] = {
    "--prefill": "up hands its router the prefill workers it started",
    "--decode": "up hands its router the decode workers it started",
    "--prefill-dns": "DNS discovery is for a cluster; up knows its workers' addresses",
    "--decode-dns": "DNS discovery is for a cluster; up knows its workers' addresses",
    "--dns-refresh-s": "up's router has no DNS names to resolve again",
    "--advertise-host": "every process runs on this machine: peers dial 127.0.0.1",
    "--engine-id": "one id for several workers would collide; each worker's follows from the address up gives it",
    "--role-switching": "up's --role-planner starts every worker with it",
    "--header-timeout-s": "the HTTP door's slow-client bounds keep their defaults on up's local router",
    "--body-timeout-s": "the HTTP door's slow-client bounds keep their defaults on up's local router",
    "--keep-alive-timeout-s": "the HTTP door's slow-client bounds keep their defaults on up's local router",
    "--max-connections": "the HTTP door's slow-client bounds keep their defaults on up's local router",
}
"""Flags of the router or the workers that ``pdserve up`` does not take, and why."""

UP_OWN: dict[str, str] = {
    "--host": "the router's address; every worker listens on 127.0.0.1",
    "--port": "the router's port; each worker gets a free one (on the ready line)",
    "--metrics-port": "the supervisor's /metrics; each worker's is a free port (on the ready line)",
    "--role-planner": "the router acts on its P:D planner and every worker starts with --role-switching",
    "--planner-interval-s": "the router's, checked to be > 0 before anything starts",
}
"""Names of the router's or the workers' flags that ``pdserve up`` declares itself, with what they do there."""

_STARTED_BY_UP = ("--direct-decode-threshold",)  # start_router passes it (its own default, 0, is the tests')


@dataclass(frozen=True)
class UpFlag:
    """One flag ``pdserve up`` takes and hands on: to which processes, how (ENGINE, FORWARDED or TLS), and for
    a secret the environment variable that carries it (never the command line)."""

    name: str
    processes: frozenset[str]
    how: str
    env: str | None = None

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def _sources() -> list[tuple[str, frozenset[str], str, bool, str | None]]:
    """(flag, processes, how, secret, env) for every declaration of every process's flags."""
    out = [(name, WORKERS, ENGINE, spec.secret, spec.env) for name, spec in declared_flags(EngineConfig).items()]
    for config, processes in ((PrefillConfig, {PREFILL}), (DecodeConfig, {DECODE}), (RouterConfig, {ROUTER})):
        out += [(name, frozenset(processes), FORWARDED, spec.secret, spec.env)
                for name, spec in declared_flags(config).items()]
    role_only = declared_flags(PrefillConfig).keys() | declared_flags(DecodeConfig).keys()
    out += [(name, WORKERS, FORWARDED, spec.secret, spec.env)  # --role-switching: a worker's, of neither role
            for name, spec in declared_flags(SwitchableConfig).items() if name not in role_only]
    return out + [(f"--tls-{suffix}", EVERY, TLS, False, None) for suffix in TLS_ENV]


@functools.cache
def up_flag_table() -> tuple[UpFlag, ...]:
    """Every flag ``pdserve up`` hands on, in declaration order, merged by name: one value for every process
    that declares it (ValueError for a secret without one environment variable to carry it, or a name
    declared as a secret in one place and not in another). Built once: the declarations do not change while
    the process runs, and the parser and every child's command line and environment read it."""
    merged: dict[str, tuple[set[str], str, bool, set[str | None]]] = {}
    for name, processes, how, secret, env in _sources():
        if name in EXCLUDED or name in UP_OWN:
            continue
        if name not in merged:
            merged[name] = (set(processes), how, secret, {env})
            continue
        known, known_how, known_secret, envs = merged[name]
        if known_secret != secret or (known_how == TLS) != (how == TLS):
            raise ValueError(f"{name} is declared twice in ways up cannot hand on as one flag")
        known |= processes
        envs.add(env)
        # The engine's declaration (every value, parsed as the engine's) wins over a router's of the same name.
        merged[name] = (known, ENGINE if ENGINE in (how, known_how) else known_how, secret, envs)
    table = []
    for name, (processes, how, secret, envs) in merged.items():
        if secret and (len(envs) != 1 or None in envs):
            raise ValueError(f"{name} is a secret without one environment variable to carry it to every process "
                             "(up puts no secret on a command line)")
        table.append(UpFlag(name, frozenset(processes), how, envs.pop() if secret else None))
    return tuple(table)


def _gpu_list(text: str) -> list[int]:
    """An argparse type for ``--prefill-gpus 0,1``."""
    from services.launch.placement import parse_gpu_list

    try:
        return parse_gpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_GROUPS = (
    (frozenset({ROUTER}), "router", "the router's flags, handed to it"),
    (EVERY, "router and every worker", "handed to the router and to every worker (a secret through its "
                                       "environment variable, never a command line; mTLS: one certificate for all, "
                                       "naming 127.0.0.1, or --tls-server-name)"),
    (WORKERS, "every worker", "the engine's and both daemons' flags, handed to every worker"),
    (frozenset({PREFILL}), "prefill workers only", "with --role-planner: every worker (any may turn prefill)"),
    (frozenset({DECODE}), "decode workers only", "with --role-planner: every worker (any may turn decode)"),
)


def add_up_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``up`` subcommand: its own flags, then the table's, grouped by the processes they go to."""
    up = sub.add_parser("up", help="start a router, N prefill and M decode workers here; Ctrl-C stops all")
    own = up.add_argument_group("pdserve up's own", "the stack: how many workers, where, its supervisor")
    own.add_argument("--host", default="127.0.0.1", help="router address (default 127.0.0.1)")
    own.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    own.add_argument("--num-prefill", type=int, default=1, help="prefill workers (default 1)")
    own.add_argument("--num-decode", type=int, default=1, help="decode workers (default 1)")
    for role in (PREFILL, DECODE):
        own.add_argument(f"--{role}-tp", type=positive_int, default=None,
                         help=f"tensor-parallel size of each {role} worker (default: --tp)")
        own.add_argument(f"--{role}-block-size", type=int, default=None,
                         help=f"KV block size of the {role} workers (default: --block-size)")
        own.add_argument(f"--{role}-kv-cache-dtype", default=None, metavar="DTYPE",
                         help=f"KV cache dtype of the {role} workers (default: --kv-cache-dtype); a 16/32-bit prefill "
                              "and an fp8_e4m3 decode side (or the reverse) convert the KV through their staging "
                              "areas: the prefill workers quantize on send, or the decode workers dequantize on read")
        own.add_argument(f"--{role}-gpus", type=_gpu_list, default=None, metavar="I,J,...",
                         help=f"GPU indices for the {role} workers' ranks, handed out in order "
                              "(default: placed automatically)")
    own.add_argument("--role-planner", action="store_true",
                     help="start every worker able to switch roles in place (--role-switching, the same engine "
                          "flags for all) and the router with its P:D planner acting: it switches a worker's role "
                          "when the traffic calls for another prefill:decode split")
    own.add_argument("--planner-interval-s", type=positive_float, default=None, metavar="SECONDS",
                     help="the router's P:D planner evaluates this often (default: the router's, 10 s); with "
                          "--role-planner a switch needs three evaluations in a row that call for it")
    own.add_argument("--metrics-port", type=int, default=0,
                     help="the supervisor's /metrics port (worker restarts; default: a free one, on the ready line)")
    own.add_argument("--prometheus-sd-file", default=None, metavar="PATH",
                     help="write every process's metrics address here as Prometheus file_sd targets")
    table = up_flag_table()
    for processes, title, description in _GROUPS:
        group = up.add_argument_group(title, description)
        names = {f.name for f in table if f.processes == processes}
        add_flags(group, EngineConfig, only={f.name for f in table if f.name in names and f.how == ENGINE})
        for config in (PrefillConfig, DecodeConfig, SwitchableConfig, RouterConfig):
            wanted = {f.name for f in table if f.name in names and f.how == FORWARDED} - _added(up)
            add_forwarded_flags(group, config, wanted & declared_flags(config).keys())
        if any(f.how == TLS for f in table if f.name in names):
            add_tls_arguments(group)
    return up


def _added(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def process_argv(args: argparse.Namespace, process: str, *, role_planner: bool = False,
                 omit: tuple[str, ...] = ()) -> list[str]:
    """The table's flags of ``args`` that ``process`` (router, prefill or decode) takes on its command line:
    no secret, and for a worker not the engine's (``engine_argv`` has them). With ``role_planner`` a worker gets
    both roles' flags: it may switch to the other role."""
    wanted = WORKERS if role_planner and process in WORKERS else {process}
    argv: list[str] = []
    for f in up_flag_table():
        if (not f.processes & wanted or f.env is not None or (f.how == ENGINE and process != ROUTER)
                or f.name in omit):
            continue
        value = getattr(args, f.dest, None)
        for one in value if isinstance(value, list) else [value]:
            if one is True:
                argv.append(f.name)
            elif one is not None and one is not False:
                argv += [f.name, str(one)]
    return argv


def child_environment(args: argparse.Namespace) -> dict[str, str]:
    """The secrets given on ``up``'s command line, as the variables their processes read them from (the
    children inherit ``up``'s environment; a secret set only there already reaches them)."""
    return {f.env: getattr(args, f.dest) for f in up_flag_table()
            if f.env is not None and getattr(args, f.dest, None) is not None}


def up_router_argv(args: argparse.Namespace) -> list[str]:
    """The router's command line from ``up``'s flags (pure; no secret, no address of a worker):
    the table's router flags, the acting planner and its interval (``--direct-decode-threshold``
    goes through ``start_router``'s own argument)."""
    argv = process_argv(args, ROUTER, omit=_STARTED_BY_UP)
    argv += ["--role-planner"] if getattr(args, "role_planner", False) else []
    interval = getattr(args, "planner_interval_s", None)
    return argv + (["--planner-interval-s", str(interval)] if interval is not None else [])


def direct_decode_threshold(args: argparse.Namespace) -> str:
    """The router's ``--direct-decode-threshold`` under ``up``: as given, else ``auto`` (the cost-based choice)."""
    return getattr(args, "direct_decode_threshold", "auto")


def up_router_config(args: argparse.Namespace) -> RouterConfig:
    """The config the router ``up`` starts will build from what it is handed (its rules, the mTLS files, the
    secrets from the environment; placeholder worker addresses): ``run_up`` builds it before anything
    starts, so a bad value is a ValueError at once, not a router that exits after the workers loaded."""
    from services.router.cli_args import add_router_parser, router_config_from_args

    parser = argparse.ArgumentParser(prog="pdserve", add_help=False)
    add_router_parser(parser.add_subparsers(dest="command"))
    argv = ["router", *up_router_argv(args), "--direct-decode-threshold", direct_decode_threshold(args),
            "--decode", "127.0.0.1:1", *(["--prefill", "127.0.0.1:2"] if args.num_prefill > 0 else [])]
    return router_config_from_args(parser.parse_args(argv))
