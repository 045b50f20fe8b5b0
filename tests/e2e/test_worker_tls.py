"""mTLS on worker gRPC, with real daemons: workers started with a certificate, key and CA serve TLS only and
require a client certificate the CA signed; the router and the decode worker's handshake dial with theirs,
so a disaggregated completion works end to end, while a plaintext client, or one whose certificate
another CA signed, is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.common.tls import TLSConfig
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import colocated_tokens, make_checkpoint
from tests.e2e.stack import completion_tokens, metric_total, stack

pytestmark = pytest.mark.slow


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca_and_cert(directory: Path, name: str, san: str = "IP:127.0.0.1,DNS:localhost"
                      ) -> tuple[Path, Path, Path]:
    """A throwaway CA and a certificate it signed for ``san``: (cert, key, ca)."""
    directory.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", f"/CN={name}-ca",
             cwd=directory)
    _openssl("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", f"/CN={name}-node", cwd=directory)
    (directory / "san.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.pem", "-days", "1", "-extfile", "san.ext", cwd=directory)
    return directory / "node.pem", directory / "node.key", directory / "ca.pem"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    root = tmp_path_factory.mktemp("pki")
    return {"cluster": _make_ca_and_cert(root / "cluster", "cluster"),
            "rogue": _make_ca_and_cert(root / "rogue", "rogue"),
            # As in containers and pods: the certificate names one cluster-wide name, no address.
            "named": _make_ca_and_cert(root / "named", "named", "DNS:pdserve-worker")}


def _info(address: str, credentials: grpc.ChannelCredentials | None, options: list | None = None
          ) -> worker_pb2.WorkerInfo:
    channel = grpc.secure_channel(address, credentials, options=options) if credentials else \
        grpc.insecure_channel(address)
    with channel:
        return worker_pb2_grpc.PrefillWorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """Greedy output that depends on the whole context (tests/unit/test_context_checkpoint.py)."""
    directory, _ = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))
    return str(directory)


@pytest.mark.parametrize("certificate", ["cluster", "named"], ids=["names-the-address", "server-name"])
def test_mtls_end_to_end_and_refusals(pki, model: str, certificate: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``named``: the workers' certificate names only pdserve-worker, which every process checks instead of
    127.0.0.1 (PDSERVE_TLS_SERVER_NAME): the router's calls and the decode worker's handshake both work."""
    cert, key, ca = pki[certificate]
    for name, path in (("CERT", cert), ("KEY", key), ("CA", ca)):
        monkeypatch.setenv(f"PDSERVE_TLS_{name}", str(path))  # the daemons and the router inherit them
    server_name = "pdserve-worker" if certificate == "named" else None
    if server_name:
        monkeypatch.setenv("PDSERVE_TLS_SERVER_NAME", server_name)
    args = ("--block-size", "16", "--num-kv-blocks", "64", "--dtype", "float32")
    with stack(model, prefill_args=args, decode_args=args) as s:
        prompt = list(range(100, 140))
        assert completion_tokens(s.url, prompt, 4, stream=True) == colocated_tokens(model, prompt, 4)
        # Disaggregated: the decode worker handshook with the prefill worker over TLS, pulled, and its
        # tokens came from that KV (equal to colocated, nothing recomputed).
        assert metric_total(s.decode[0], "pdserve_kv_transfer_bytes_total") > 0
        assert metric_total(s.decode[0], "pdserve_local_recompute_fallbacks_total") == 0
        prefill = s.prefill[0].address
        tls = TLSConfig.from_files(str(cert), str(key), str(ca), server_name)
        assert _info(prefill, tls.channel_credentials(), tls.channel_options()).role
        if server_name:  # checked against the address dialed, the certificate does not match
            with pytest.raises(grpc.RpcError) as refused:
                _info(prefill, tls.channel_credentials())
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        rogue_cert, rogue_key, _ = pki["rogue"]
        # A client whose certificate another CA signed (it trusts the cluster CA, so the server is fine).
        rogue = grpc.ssl_channel_credentials(ca.read_bytes(), rogue_key.read_bytes(), rogue_cert.read_bytes())
        no_cert = grpc.ssl_channel_credentials(ca.read_bytes())
        for credentials in (None, rogue, no_cert):
            with pytest.raises(grpc.RpcError) as refused:
                _info(prefill, credentials, tls.channel_options())
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


def test_partial_tls_flags_stop_the_worker_with_a_clear_error(pki) -> None:
    cert, _, _ = pki["cluster"]
    done = subprocess.run([sys.executable, "-m", "services.cli", "prefill", "--model", "dummy:tiny",
                           "--host", "127.0.0.1", "--port", "0", "--tls-cert", str(cert)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--tls-key" in done.stdout + done.stderr and "--tls-ca" in done.stdout + done.stderr
