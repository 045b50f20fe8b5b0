"""``pdserve drain`` against scripted workers (real gRPC servers on 127.0.0.1): its exit status and the line that
says why, for every way it can end. The drain itself on real workers is tests/e2e/test_drain.py."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from services.cli import main
from services.common.tls import TLSConfig
from services.launch.drain import DRAINED, NOT_DRAINED, NOT_STARTED
from services.launch.spawn import free_port
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc

Drain = Callable[[grpc.ServicerContext], worker_pb2.DrainResponse]


def drained(context: grpc.ServicerContext) -> worker_pb2.DrainResponse:
    return worker_pb2.DrainResponse(role="decode", seconds=0.5, num_migrated=2)


class Scripted:
    """Info (load from ``running``) and a Drain answered by ``drain``; ``token``: refuse calls without it."""

    def __init__(self, drain: Drain | None = drained, token: str | None = None) -> None:
        self.drain = drain
        self.token = token
        self.calls: list[tuple[str, float]] = []

    def _check(self, context: grpc.ServicerContext) -> None:
        if self.token and dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    def Info(self, request, context):  # noqa: N802
        self._check(context)
        self.calls.append(("Info", time.monotonic()))
        return worker_pb2.WorkerInfo(role="decode", num_running=3, kv_blocks_pinned=0)

    def Drain(self, request, context):  # noqa: N802
        self._check(context)
        self.calls.append(("Drain", time.monotonic()))
        if self.drain is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        return self.drain(context)


class DecodeOnly(Scripted, worker_pb2_grpc.DecodeWorkerServicer):
    pass


@contextmanager
def worker(script: Scripted, tls: TLSConfig | None = None) -> Iterator[tuple[int, grpc.Server]]:
    """A decode worker's service (only: the command must find it after the prefill one answers UNIMPLEMENTED)."""
    server = grpc.server(ThreadPoolExecutor(4))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(script, server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    try:
        yield port, server
    finally:
        server.stop(0)


def run(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    status = main(["drain", *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(autouse=True)
def _no_worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PDSERVE_WORKER_PORT", "PDSERVE_KV_AUTH_TOKEN", "PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY",
                 "PDSERVE_TLS_CA"):
        monkeypatch.delenv(name, raising=False)


def test_an_unreachable_worker_is_a_clear_error(capsys) -> None:
    port = free_port()  # nothing listens there
    status, out, err = run(capsys, "--port", str(port), "--after-s", "30")
    assert status == NOT_STARTED and not out
    assert f"cannot reach the worker at 127.0.0.1:{port}" in err and "nothing was drained" in err


def test_the_port_is_required(capsys) -> None:
    status, _, err = run(capsys)
    assert status == 2 and "--port or $PDSERVE_WORKER_PORT" in err


def test_drained_after_serving_on(capsys, monkeypatch) -> None:
    script = DecodeOnly()
    with worker(script) as (port, _):
        monkeypatch.setenv("PDSERVE_WORKER_PORT", str(port))
        status, out, err = run(capsys, "--after-s", "0.3")
    assert status == DRAINED, err
    assert json.loads(out) == {"drained": True, "address": f"127.0.0.1:{port}", "role": "decode", "seconds": 0.5,
                               "num_migrated": 2, "num_left": 0}
    (info, info_at), (drain, drain_at) = script.calls
    assert (info, drain) == ("Info", "Drain") and drain_at - info_at >= 0.3  # it served on first


def test_a_drain_that_outlasts_the_timeout_fails_with_what_is_left(capsys) -> None:
    def slow(context: grpc.ServicerContext) -> worker_pb2.DrainResponse:
        time.sleep(3)
        return drained(context)

    with worker(DecodeOnly(slow)) as (port, _):
        started = time.monotonic()
        status, out, err = run(capsys, "--port", str(port), "--timeout-s", "0.3")
        assert time.monotonic() - started < 2.5
    assert status == NOT_DRAINED and not out
    assert "did not drain within --timeout-s 0.3s" in err and "still 3 running" in err


def test_work_given_up_at_the_worker_bound_is_not_drained(capsys) -> None:
    def gave_up(context: grpc.ServicerContext) -> worker_pb2.DrainResponse:
        return worker_pb2.DrainResponse(role="prefill", seconds=30.0, num_left=2)

    with worker(DecodeOnly(gave_up)) as (port, _):
        status, out, err = run(capsys, "--port", str(port))
    assert status == NOT_DRAINED
    assert json.loads(out)["drained"] is False and "gave up 2 outstanding" in err


def test_the_cluster_token_comes_from_the_flag_or_the_environment(capsys, monkeypatch) -> None:
    with worker(DecodeOnly(token="s3cret")) as (port, _):
        status, _, err = run(capsys, "--port", str(port))
        assert status == NOT_STARTED and "refused the cluster token" in err and "--kv-auth-token" in err
        assert run(capsys, "--port", str(port), "--kv-auth-token", "s3cret")[0] == DRAINED
        monkeypatch.setenv("PDSERVE_KV_AUTH_TOKEN", "s3cret")
        assert run(capsys, "--port", str(port))[0] == DRAINED


def test_a_worker_without_drain_is_named(capsys) -> None:
    with worker(DecodeOnly(drain=None)) as (port, _):
        status, _, err = run(capsys, "--port", str(port))
    assert status == NOT_STARTED and "predates the Drain RPC" in err


def test_a_worker_that_goes_away_mid_drain_is_not_drained(capsys) -> None:
    holder: list[grpc.Server] = []

    def die(context: grpc.ServicerContext) -> worker_pb2.DrainResponse:
        threading.Thread(target=holder[0].stop, args=(0,)).start()
        time.sleep(2)
        return drained(context)

    with worker(DecodeOnly(die)) as (port, server):
        holder.append(server)
        status, out, err = run(capsys, "--port", str(port), "--timeout-s", "10")
    assert status == NOT_DRAINED and not out and f"worker at 127.0.0.1:{port}" in err


def _pki(directory: Path, san: str) -> tuple[str, str, str]:
    """A throwaway CA and one certificate it signed for ``san`` (both sides use it): (cert, key, ca) paths."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca")
    openssl("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=node")
    (directory / "san.ext").write_text(f"subjectAltName={san}\n")
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "node.pem", "-days", "1", "-extfile", "san.ext")
    return str(directory / "node.pem"), str(directory / "node.key"), str(directory / "ca.pem")


def test_mtls_dials_with_the_process_certificate_and_a_server_name(capsys, tmp_path) -> None:
    """The worker's certificate names the pod, not 127.0.0.1: --tls-server-name says which name to check."""
    cert, key, ca = _pki(tmp_path, "DNS:worker.pd.svc")
    flags = ("--tls-cert", cert, "--tls-key", key, "--tls-ca", ca)
    with worker(DecodeOnly(), TLSConfig.from_files(cert, key, ca)) as (port, _):
        status, _, err = run(capsys, "--port", str(port))  # plaintext to a TLS-only worker
        assert status == NOT_STARTED and "cannot reach" in err
        status, _, err = run(capsys, "--port", str(port), *flags)  # the certificate does not name 127.0.0.1
        assert status == NOT_STARTED and "cannot reach" in err
        status, out, err = run(capsys, "--port", str(port), *flags, "--tls-server-name", "worker.pd.svc")
        assert status == DRAINED, err
        assert json.loads(out)["drained"] is True
