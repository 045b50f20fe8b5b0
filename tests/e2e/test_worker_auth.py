"""The cluster token on worker RPCs, with real daemons: workers started with ``$PDSERVE_KV_AUTH_TOKEN``
refuse every call without it (UNAUTHENTICATED) but health checks; the router, which has the same
token, serves completions through them (prefill, handshake with the token, pull, decode): the tokens of the
model run colocated, with the KV pulled (the decode worker counts bytes and no local recompute). The prefill
worker computes in chunks of 16 tokens, so a long prompt's KV goes in part tickets through the decode worker's
``GenerateParts`` (stream-stream: the token must be on it too). A message over a worker's receive limit is
refused RESOURCE_EXHAUSTED, and so is a handshake over its bound. The model is a small random checkpoint whose
tokens depend on the whole context (``tests/unit/test_context_checkpoint.py``), so KV that is wrong or missing
changes them."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_auth import METADATA_KEY, bearer
from services.contract.sampling_params import DEFAULT_MAX_REQUEST_BYTES, SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.kv.spec.compat import PROTOCOL_VERSION
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from services.worker.receive_limit import max_receive_bytes
from tests.checkpoints import colocated_tokens, make_checkpoint
from tests.e2e.stack import completion_tokens, metric_total, random_prompt, stack

pytestmark = pytest.mark.slow

TOKEN = "cluster-s3cret"
CHUNK = 16  # the prefill worker's token budget per step: a prompt over it is prefilled (and sent) in parts


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
    with stack(model, prefill_args=(*args, "--max-num-batched-tokens", str(CHUNK)), decode_args=args) as s:
        prompt = list(range(100, 112))  # 12 tokens, one chunk: disaggregated (--direct-decode-threshold is 0)
        first = completion_tokens(s.url, prompt, 4, stream=False)
        assert len(first) == 4 and completion_tokens(s.url, prompt, 4, stream=True) == first
        assert first == colocated_tokens(model, prompt, 4)
        # 100 tokens, 7 chunks: 6 part tickets, then the last with the first token, all through GenerateParts.
        # Two prompts (no cache hit on the prefill worker), streamed and not.
        (prefill,), (decode,) = s.prefill, s.decode
        parts_before = metric_total(prefill, "pdserve_requests_total", 'outcome="kv_part"')
        long_prompts = [random_prompt(46, 100), random_prompt(47, 100)]
        got = [completion_tokens(s.url, p, 6, stream) for p, stream in zip(long_prompts, (True, False), strict=True)]
        assert got == _chunked_reference(model, long_prompts, 6)
        assert metric_total(prefill, "pdserve_requests_total", 'outcome="kv_part"') - parts_before == 2 * 6
        # Disaggregated for real: the decode worker pulled the KV over the authenticated handshake and
        # recomputed no prompt (a recompute would give the same tokens).
        assert metric_total(decode, "pdserve_kv_transfer_bytes_total", 'role="decode"') > 0
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total", 'role="decode"') == 0
        _check_limits(prefill.address, metadata=((METADATA_KEY, bearer(TOKEN)),))
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


def _chunked_reference(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The colocated greedy tokens of an engine prefilling in the prefill worker's chunks (the same KV to the bit)."""
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=CHUNK, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [engine.generate([prompt], params)[0].token_ids for prompt in prompts]


def _check_limits(address: str, metadata) -> None:
    """A message over the worker's receive limit is refused by grpc core whoever sends it; one under it without
    the token is refused UNAUTHENTICATED (unparsed: tests/unit/common/test_grpc_auth.py); a handshake over its
    bound is refused before its token is even read."""
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        info = stub.Info(worker_pb2.InfoRequest(), timeout=5, metadata=metadata)
        limit = max_receive_bytes(info.max_model_len, 1, info.tp_size, DEFAULT_MAX_REQUEST_BYTES)
        prefill = channel.unary_unary("/pdserve.v1.PrefillWorker/Prefill")  # raw bytes: nothing parsed here
        for body, refusal in ((b"\0" * (limit + 1), grpc.StatusCode.RESOURCE_EXHAUSTED),
                              (worker_pb2.PrefillRequest(prompt_token_ids=[1 << 21] * (limit // 5)).SerializeToString(),
                               grpc.StatusCode.UNAUTHENTICATED)):
            with pytest.raises(grpc.RpcError) as refused:
                prefill(body, timeout=30)
            assert refused.value.code() is refusal, (len(body), limit)
        big_token = kv_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, auth_token="x" * (1 << 20))
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/pdserve.v1.KVHandshake/Handshake")(big_token.SerializeToString(), timeout=30)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
