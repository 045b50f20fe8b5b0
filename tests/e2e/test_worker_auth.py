"""The cluster token on worker RPCs, with real daemons: workers started with ``$PDSERVE_KV_AUTH_TOKEN``
refuse every call without it (UNAUTHENTICATED) but health checks; the router, which has the same
token, serves completions through them (prefill, handshake with the token, pull, decode): the tokens of the
model run colocated, with the KV pulled (the decode worker counts bytes and no local recompute). The
model is a small random checkpoint whose tokens depend on the whole context
(``tests/unit/test_context_checkpoint.py``), so KV that is wrong or missing changes them."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_auth import METADATA_KEY, bearer
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import colocated_tokens, make_checkpoint
from tests.e2e.stack import completion_tokens, metric_total, stack

pytestmark = pytest.mark.slow

TOKEN = "cluster-s3cret"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))
    return str(directory)


def _info(address: str, stub_type, metadata=()) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as channel:
        return stub_type(channel).Info(worker_pb2.InfoRequest(), timeout=5, metadata=metadata)


def test_workers_refuse_calls_without_the_cluster_token(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_KV_AUTH_TOKEN", TOKEN)  # the daemons and the router inherit it
    args = ("--block-size", "16", "--num-kv-blocks", "64", "--dtype", "float32")
    with stack(model, prefill_args=args, decode_args=args) as s:
        prompt = list(range(100, 140))  # 40 tokens: disaggregated (--direct-decode-threshold is 0), 3 blocks
        first = completion_tokens(s.url, prompt, 4, stream=False)
        assert len(first) == 4 and completion_tokens(s.url, prompt, 4, stream=True) == first
        assert first == colocated_tokens(model, prompt, 4)
        # Disaggregated for real: the decode worker pulled the KV over the authenticated handshake and
        # recomputed no prompt (a recompute would give the same tokens).
        (decode,) = s.decode
        assert metric_total(decode, "pdserve_kv_transfer_bytes_total", 'role="decode"') > 0
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total", 'role="decode"') == 0
        for daemon, stub_type in ((s.prefill[0], worker_pb2_grpc.PrefillWorkerStub),
                                  (s.decode[0], worker_pb2_grpc.DecodeWorkerStub)):
            for metadata in ((), ((METADATA_KEY, bearer("wrong")),), ((METADATA_KEY, TOKEN),)):
                with pytest.raises(grpc.RpcError) as refused:
                    _info(daemon.address, stub_type, metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert _info(daemon.address, stub_type, ((METADATA_KEY, bearer(TOKEN)),)).role
            with grpc.insecure_channel(daemon.address) as channel:  # probes need no token
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            with grpc.insecure_channel(daemon.address) as channel:  # a streaming RPC is refused the same way
                if stub_type is worker_pb2_grpc.DecodeWorkerStub:
                    stream = worker_pb2_grpc.DecodeWorkerStub(channel).Generate(
                        worker_pb2.GenerateRequest(request_id="x", prompt_token_ids=prompt), timeout=5)
                    with pytest.raises(grpc.RpcError) as refused:
                        next(iter(stream))
                    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
