"""``host:port`` strings as gRPC dials them: IPv6 literals in brackets, both ways."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket

log = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def split_host_port(entry: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port); ValueError for anything else."""
    host, sep, port_text = entry.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{entry!r} is not host:port (a port in 1..65535; IPv6 as [addr]:port)")
    return host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    """The gRPC target of an address: IPv6 literals in brackets."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    return f"{host}:{port}"


def advertised_host(listen_host: str) -> str:
    """The host peers dial to reach a daemon listening on ``listen_host``: that host itself, or for a
    wildcard address (which names no machine) the address this machine's name resolves to, which is
    the container's or pod's own IP. ``--advertise-host`` overrides it."""
    if listen_host not in WILDCARD_HOSTS:
        return listen_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        log.warning("cannot resolve this host's name (%s): advertising 127.0.0.1; set --advertise-host", e)
        return "127.0.0.1"
