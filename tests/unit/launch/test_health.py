"""``pdserve health`` against a real grpc.health.v1 server on 127.0.0.1: its exit status for a serving, a
non-serving and an unreachable worker, plaintext and with mTLS (certificates from deploy/tls/make-certs.sh)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.cli import main
from services.common.tls import TLSConfig
from services.launch.health import NOT_SERVING, SERVING, UNREACHABLE
from services.launch.spawn import free_port

MAKE_CERTS = Path(__file__).resolve().parents[3] / "deploy" / "tls" / "make-certs.sh"


@contextmanager
def worker_health(tls: TLSConfig | None = None) -> Iterator[tuple[int, health.HealthServicer]]:
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials()) if tls else \
        server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(0)


def certs(directory: Path, name: str) -> dict[str, str]:
    subprocess.run(["sh", str(MAKE_CERTS), str(directory), name], check=True, capture_output=True)
    return {"PDSERVE_TLS_CERT": str(directory / "tls.crt"), "PDSERVE_TLS_KEY": str(directory / "tls.key"),
            "PDSERVE_TLS_CA": str(directory / "ca.crt")}


def run(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    status = main(["health", *args])
    return status, capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PDSERVE_WORKER_PORT", "PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA",
                 "PDSERVE_TLS_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)


def test_plaintext_status_follows_the_worker(capsys, monkeypatch) -> None:
    with worker_health() as (port, servicer):
        monkeypatch.setenv("PDSERVE_WORKER_PORT", str(port))
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run(capsys) == (SERVING, "")
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        status, err = run(capsys)
        assert status == NOT_SERVING and f"127.0.0.1:{port} is NOT_SERVING" in err
    port = free_port()
    status, err = run(capsys, "--port", str(port), "--timeout-s", "1")
    assert status == UNREACHABLE and f"127.0.0.1:{port} did not answer (UNAVAILABLE" in err


def test_mtls_probe_dials_with_the_containers_certificate_and_server_name(capsys, monkeypatch, tmp_path) -> None:
    """With mTLS on, a plaintext probe (a kubelet's gRPC probe) fails on a healthy worker; the same probe with
    the PDSERVE_TLS_* variables the container has passes, checking the worker's name, not 127.0.0.1's."""
    env = certs(tmp_path / "cluster", "worker.pd.svc")
    tls = TLSConfig.from_files(env["PDSERVE_TLS_CERT"], env["PDSERVE_TLS_KEY"], env["PDSERVE_TLS_CA"])
    with worker_health(tls) as (port, servicer):
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        status, err = run(capsys, "--port", str(port), "--timeout-s", "2")
        assert status == UNREACHABLE and "did not answer" in err
        for name, value in {**env, "PDSERVE_TLS_SERVER_NAME": "worker.pd.svc"}.items():
            monkeypatch.setenv(name, value)
        assert run(capsys, "--port", str(port)) == (SERVING, "")
        monkeypatch.setenv("PDSERVE_TLS_SERVER_NAME", "another.pd.svc")  # the certificate does not name it
        status, err = run(capsys, "--port", str(port), "--timeout-s", "2")
        assert status == UNREACHABLE, err
        for name, value in certs(tmp_path / "other", "worker.pd.svc").items():  # a CA the worker does not trust
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("PDSERVE_TLS_SERVER_NAME", "worker.pd.svc")
        status, err = run(capsys, "--port", str(port), "--timeout-s", "2")
        assert status == UNREACHABLE, err


def test_server_name_without_certificates_is_a_usage_error(capsys) -> None:
    status, err = run(capsys, "--port", "1", "--tls-server-name", "worker.pd.svc")
    assert status == 2 and "--tls-server-name is for mTLS" in err
