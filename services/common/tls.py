"""Mutual TLS for the workers' gRPC: every process presents a certificate signed by the cluster CA.

Optional, beside (or instead of) the cluster token: with ``--tls-cert``, ``--tls-key`` and ``--tls-ca``
a worker serves TLS only and requires a client certificate the CA signed; the router and the decode
worker's handshake channel dial with their own. A worker's certificate must name what its peers check:
by default the address they dial (a subjectAltName with the IP or DNS name of ``--advertise-host``);
with ``--tls-server-name`` every dialer checks that one name instead. Containers and pods get a new IP
each time they start, so a certificate made before cannot name it: there, every worker's certificate
names one cluster-wide DNS name (e.g. ``pdserve-worker``) and every process dials with
``--tls-server-name`` set to it (compose and the Helm chart do, docs/deployment.md).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

ENV = {"cert": "PDSERVE_TLS_CERT", "key": "PDSERVE_TLS_KEY", "ca": "PDSERVE_TLS_CA",
       "server-name": "PDSERVE_TLS_SERVER_NAME"}


@dataclass(frozen=True)
class TLSConfig:
    """PEM bytes of this process's certificate chain and key, and of the CA that signs every peer; the name
    a peer's certificate is checked against when it is not the dialed host."""

    cert: bytes
    key: bytes
    ca: bytes
    server_name: str | None = None

    @classmethod
    def from_files(cls, cert: str | None, key: str | None, ca: str | None,
                   server_name: str | None = None) -> TLSConfig | None:
        """None when none is given; ValueError naming the problem when only some are, or one is unreadable."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            if server_name:
                raise ValueError("--tls-server-name is for mTLS: give --tls-cert, --tls-key and --tls-ca too")
            return None
        missing = [flag for flag, path in given.items() if not path]
        if missing:
            raise ValueError(f"mTLS needs --tls-cert, --tls-key and --tls-ca together; missing {', '.join(missing)}")
        contents = {}
        for flag, path in given.items():
            try:
                contents[flag] = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{flag} {path}: {exc.strerror}") from None
            if b"-----BEGIN" not in contents[flag]:
                raise ValueError(f"{flag} {path}: not a PEM file")
        return cls(contents["--tls-cert"], contents["--tls-key"], contents["--tls-ca"], server_name or None)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        """gRPC channel options: the name checked on the peer's certificate, when it is not the dialed host."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    for name, help_text in (("cert", "this process's certificate chain (PEM), signed by --tls-ca"),
                            ("key", "its private key (PEM)"),
                            ("ca", "the CA (PEM) that signs every worker and router certificate")):
        p.add_argument(f"--tls-{name}", default=os.environ.get(ENV[name]) or None, metavar="FILE",
                       help=f"mTLS for worker gRPC: {help_text} (default ${ENV[name]}); give all three or none")
    p.add_argument("--tls-server-name", default=os.environ.get(ENV["server-name"]) or None, metavar="NAME",
                   help="with mTLS: the name every worker certificate is checked against instead of the address "
                        "dialed (containers and pods, whose IPs no certificate can name; default "
                        f"${ENV['server-name']})")


def tls_from_args(args: argparse.Namespace) -> TLSConfig | None:
    return TLSConfig.from_files(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def open_channel(address: str, tls: TLSConfig | None, **kwargs) -> grpc.aio.Channel:
    """An asyncio channel to a worker: TLS with this process's certificate when configured."""
    if tls is None:
        return grpc.aio.insecure_channel(address, **kwargs)
    options = [*(kwargs.pop("options", None) or ()), *tls.channel_options()]
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options, **kwargs)


def open_blocking_channel(address: str, tls: TLSConfig | None) -> grpc.Channel:
    """A blocking channel to a worker, for the one-shot commands (``pdserve drain``, ``pdserve health``):
    TLS with this process's certificate and server name when configured."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())
