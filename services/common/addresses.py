"""``host:port`` strings as gRPC dials them: IPv6 literals in brackets, both ways."""

from __future__ import annotations

import contextlib
import ipaddress


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
