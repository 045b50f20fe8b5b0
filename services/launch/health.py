"""``pdserve health``: a worker's grpc.health.v1 status, asked the way its peers dial it.

Container health checks and Kubernetes probes ask a worker whether it serves. A kubelet's own gRPC probe and
a plaintext one-liner cannot present a client certificate, so with mTLS on (``--tls-*``, which a worker then
requires of every caller) they would fail on a healthy worker. This command dials the worker in its own
container (127.0.0.1, its port) with the process's certificate and ``--tls-server-name`` from the same
``PDSERVE_TLS_*`` variables the worker reads, and plaintext without them: one probe for both.

Exit status: 0 serving; 1 answering but not serving (starting, or draining); 2 not answering (not up yet,
refused the TLS handshake, or gone). A failure is one line on stderr saying which.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.addresses import join_host_port
from services.common.config_flags import add_flags, config_from_args, flag
from services.common.tls import TLSConfig, add_tls_arguments, open_blocking_channel, tls_from_args
from services.launch.drain import seconds

SERVING, NOT_SERVING, UNREACHABLE = 0, 1, 2


@dataclass(frozen=True)
class HealthConfig:
    """Where the worker is, how long to wait for its answer, and how to dial it."""

    host: str = flag("127.0.0.1", "the worker's address (default 127.0.0.1: the probe runs in the worker's container)")
    port: int | None = flag(None, "the worker's gRPC port (default: $PDSERVE_WORKER_PORT)", parse=int,
                            env="PDSERVE_WORKER_PORT")
    timeout_s: float = flag(4.0, "give up on the answer after this long (exit 2)", parse=seconds)
    service: str = flag("", "the health service name to ask (default: the whole worker)")
    tls: TLSConfig | None = None  # mTLS with this process's certificate: the --tls-* flags the workers take


def add_health_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``health`` subcommand to the CLI's subparsers and return its parser."""
    p = sub.add_parser("health", help="exit 0 when the worker serves (container health checks and probes, mTLS "
                                      "included)", description=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, HealthConfig)
    add_tls_arguments(p)
    p.set_defaults(func=run_health)
    return p


def run_health(args: argparse.Namespace) -> int:
    """The subcommand: the exit status (see the module docstring)."""
    config = config_from_args(HealthConfig, args, tls=tls_from_args(args))
    if config.port is None:
        raise ValueError("pdserve health needs the worker's port: --port or $PDSERVE_WORKER_PORT")
    address = join_host_port(config.host, config.port)
    try:
        status = check(config)
    except grpc.RpcError as e:
        print(f"pdserve health: {address} did not answer ({e.code().name}: {e.details()})", file=sys.stderr)
        return UNREACHABLE
    if status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        print(f"pdserve health: {address} is {name}", file=sys.stderr)
        return NOT_SERVING
    return SERVING


def check(config: HealthConfig) -> int:
    """The worker's ``HealthCheckResponse.ServingStatus``; grpc.RpcError when it does not answer in time."""
    address = join_host_port(config.host, config.port or 0)
    with open_blocking_channel(address, config.tls) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=config.service),
                                                           timeout=config.timeout_s)
    return answer.status
