"""``pdserve drain``: drain a worker and wait until it is drained, the workers' preStop hook.

Kubernetes runs a preStop hook to its end before it sends SIGTERM, and counts it in the pod's grace period.
This command is that hook: it dials the worker in its own container (127.0.0.1, the worker's port, the
cluster token and mTLS as every other client of a worker does), checks that the worker answers, lets it serve
on for ``--after-s`` (the routers drop the terminating pod meanwhile: the preStop sleep), then calls ``Drain``
and waits for the answer, which comes once the worker is drained (services/worker/grpc_server.py). The
SIGTERM that follows finds the drain done and stops the worker at once; a SIGTERM that comes earlier (the hook
ran out of time) joins the same drain.

Exit status: 0 drained; 1 not drained (``--timeout-s`` ran out, the worker gave work up at its own bound, or it
went away during the drain); 2 nothing drained (the worker cannot be reached, refused the call, or predates
``Drain``). A failure is one line on stderr saying which; the result is one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import grpc

from services.common.addresses import join_host_port
from services.common.config_flags import add_flags, config_from_args, flag
from services.common.grpc_auth import METADATA_KEY, bearer
from services.common.tls import TLSConfig, add_tls_arguments, open_blocking_channel, tls_from_args
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc

DRAINED, NOT_DRAINED, NOT_STARTED = 0, 1, 2
#: How long the worker has to answer the first call (its Info) before the command gives up on it.
CONNECT_TIMEOUT_S = 10.0
Stub = worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
DESCRIPTION = """\
Drain the worker at --host:--port and wait until it is drained: check that it answers, let it serve on for
--after-s, call Drain (prefill: its tickets are pulled, released or expired; decode: requests finish, and past
its --drain-timeout-s the rest move to another decode worker), wait for the answer. The SIGTERM that follows
stops the worker at once. Exit status: 0 drained; 1 not drained (--timeout-s ran out, the worker gave work up
at its bound, or it went away); 2 nothing drained (unreachable, refused, or a worker without Drain)."""


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, at least 0 (a typo is a usage error, not a hook that never ends)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


@dataclass(frozen=True)
class DrainConfig:
    """Where the worker is and how to dial it; how long to serve on first and to wait for the drain."""

    host: str = flag("127.0.0.1", "the worker's address (default 127.0.0.1: the hook runs in the worker's container)")
    port: int | None = flag(None, "the worker's gRPC port (default: $PDSERVE_WORKER_PORT)", parse=int,
                            env="PDSERVE_WORKER_PORT")
    after_s: float = flag(0.0, "let the worker serve on this long before the drain, so that routers drop it first "
                               "(the preStop sleep)", parse=seconds)
    timeout_s: float = flag(60.0, "give up waiting this long after the drain started (exit 1; the worker drains on "
                                  "within its own --drain-timeout-s); 0: no limit", parse=seconds)
    kv_auth_token: str | None = flag(None, "the workers' cluster token (default: $PDSERVE_KV_AUTH_TOKEN)",
                                     env="PDSERVE_KV_AUTH_TOKEN", secret=True)
    tls: TLSConfig | None = None  # mTLS with this process's certificate: the --tls-* flags the workers take


class DrainFailed(Exception):
    """The command's failure: the line it prints and its exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def add_drain_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``drain`` subcommand to the CLI's subparsers and return its parser."""
    p = sub.add_parser("drain", help="drain a worker and wait until it is drained (the workers' preStop hook)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, DrainConfig)
    add_tls_arguments(p)
    p.set_defaults(func=run_drain)
    return p


def run_drain(args: argparse.Namespace) -> int:
    """The subcommand: the exit status (see the module docstring)."""
    config = config_from_args(DrainConfig, args, tls=tls_from_args(args))
    if config.port is None:
        raise ValueError("pdserve drain needs the worker's port: --port or $PDSERVE_WORKER_PORT")
    try:
        answer = drain(config)
    except DrainFailed as e:
        print(f"pdserve drain: {e}", file=sys.stderr, flush=True)
        return e.status
    address = join_host_port(config.host, config.port)
    print(json.dumps({"drained": answer.num_left == 0, "address": address, "role": answer.role,
                      "seconds": round(answer.seconds, 3), "num_migrated": answer.num_migrated,
                      "num_left": answer.num_left}), flush=True)
    if answer.num_left:
        print(f"pdserve drain: the {answer.role} worker at {address} gave up {answer.num_left} outstanding "
              "requests or tickets at its --drain-timeout-s; they are cut when it stops", file=sys.stderr, flush=True)
        return NOT_DRAINED
    return DRAINED


def drain(config: DrainConfig) -> worker_pb2.DrainResponse:
    """Check the worker answers, wait ``after_s``, drain it and wait for the end; DrainFailed otherwise."""
    address = join_host_port(config.host, config.port or 0)
    metadata = ((METADATA_KEY, bearer(config.kv_auth_token)),) if config.kv_auth_token else ()
    with open_blocking_channel(address, config.tls) as channel:
        stub, info = _find_worker(channel, address, metadata)
        time.sleep(config.after_s)  # the worker serves on meanwhile
        try:
            answer = stub.Drain(worker_pb2.DrainRequest(), timeout=config.timeout_s or None, metadata=metadata)
        except grpc.RpcError as e:
            raise _drain_failed(e, stub, info.role, address, config.timeout_s, metadata) from None
    answer.role = answer.role or info.role
    return answer


def _find_worker(channel: grpc.Channel, address: str,
                 metadata: tuple[tuple[str, str], ...]) -> tuple[Stub, worker_pb2.WorkerInfo]:
    """The worker's stub and Info: its prefill service, else its decode service (either drains the worker)."""
    for stub in (worker_pb2_grpc.PrefillWorkerStub(channel), worker_pb2_grpc.DecodeWorkerStub(channel)):
        try:
            return stub, stub.Info(worker_pb2.InfoRequest(), timeout=CONNECT_TIMEOUT_S, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise _unreachable(e, address) from None
    raise DrainFailed(f"{address} serves neither pdserve worker service: is it a worker's gRPC port?", NOT_STARTED)


def _unreachable(e: grpc.RpcError, address: str) -> DrainFailed:
    """Why nothing could start: no worker there, a refused token, no answer."""
    code = e.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        why = ("it refused the cluster token: give the workers' token with --kv-auth-token or "
               "$PDSERVE_KV_AUTH_TOKEN")
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        why = f"no answer within {CONNECT_TIMEOUT_S:g}s"
    else:
        why = f"{code.name}: {e.details()}"
    return DrainFailed(f"cannot reach the worker at {address} ({why}); nothing was drained", NOT_STARTED)


def _drain_failed(e: grpc.RpcError, stub: Stub, role: str, address: str, timeout_s: float,
                  metadata: tuple[tuple[str, str], ...]) -> DrainFailed:
    """Why the drain was not seen to end: the timeout (with what is still outstanding), no Drain, the worker gone."""
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DrainFailed(f"the {role} worker at {address} did not drain within --timeout-s {timeout_s:g}s "
                           f"({_outstanding(stub, metadata)}); it drains on, and SIGTERM stops it when drained",
                           NOT_DRAINED)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return DrainFailed(f"the {role} worker at {address} predates the Drain RPC (an older pdserve); nothing was "
                           "drained (SIGTERM still drains it)", NOT_STARTED)
    if code == grpc.StatusCode.UNAVAILABLE:
        return DrainFailed(f"the {role} worker at {address} went away during the drain ({e.details()}): it "
                           "stopped or was killed before it was drained", NOT_DRAINED)
    return DrainFailed(f"the {role} worker at {address} failed the drain ({code.name}: {e.details()})", NOT_DRAINED)


def _outstanding(stub: Stub, metadata: tuple[tuple[str, str], ...]) -> str:
    """What the worker still runs and holds, from its Info (best effort: the message must not fail)."""
    try:
        info = stub.Info(worker_pb2.InfoRequest(), timeout=2.0, metadata=metadata)
    except grpc.RpcError as e:
        return f"its Info failed too: {e.code().name}"
    return (f"still {info.num_running} running, {info.num_waiting} waiting, {info.kv_blocks_pinned} KV blocks "
            "pinned for transfers")
