"""The decode servicer's side of ``require_pull``, over real gRPC with a scripted policy: the flag reaches the
policy, and a required pull that cannot be done is FAILED_PRECONDITION with the reason, counted as the
``pull_required`` outcome, before any chunk."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from services.common.metrics import WorkerMetrics
from services.decode.pull_policy import PullRequired
from services.decode.server import PULL_REQUIRED_OUTCOME, DecodeServicer
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from services.worker.grpc_server import InFlight


class RefusingPolicy:
    """Records each start; refuses the pull when it is required."""

    def __init__(self) -> None:
        self.starts: list[bool] = []

    async def start(self, rid, prompt, params, ticket, *, require_pull: bool = False):
        self.starts.append(require_pull)
        if require_pull:
            raise PullRequired("KV pull from prefill@a failed (handshake refused)")
        raise ValueError("scripted: not required, so refused as bad input")


def _generate(require_pull: bool) -> tuple[grpc.StatusCode, str, list[bool], float]:
    async def run() -> tuple[grpc.StatusCode, str, list[bool], float]:
        metrics, policy = WorkerMetrics("decode"), RefusingPolicy()
        servicer = DecodeServicer(SimpleNamespace(in_flight=InFlight()), None, policy, None, "decode-test", 0, metrics)
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                ticket = kv_pb2.TransferTicket(engine_id="prefill@a", epoch=1, request_id="r", num_tokens=3)
                call = worker_pb2_grpc.DecodeWorkerStub(channel).Generate(worker_pb2.GenerateRequest(
                    request_id="r", prompt_token_ids=[1, 2, 3], params=worker_pb2.SamplingParams(max_tokens=4),
                    ticket=ticket, require_pull=require_pull), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    async for _ in call:
                        raise AssertionError("no chunk may come before the refusal")
        finally:
            await server.stop(0)
        refused = metrics.registry.get_sample_value("pdserve_requests_total",
                                                    {"role": "decode", "outcome": PULL_REQUIRED_OUTCOME})
        return failed.value.code(), failed.value.details(), policy.starts, refused

    return asyncio.run(run())


def test_a_required_pull_that_cannot_be_done_is_failed_precondition_with_the_reason() -> None:
    code, details, starts, refused = _generate(require_pull=True)
    assert starts == [True]
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert "KV pull from prefill@a failed (handshake refused)" in details
    assert refused == 1


def test_the_pull_required_outcome_starts_at_zero_and_require_pull_defaults_off() -> None:
    code, _, starts, refused = _generate(require_pull=False)
    assert starts == [False] and code is grpc.StatusCode.INVALID_ARGUMENT
    assert refused == 0  # the series exists before the first refusal
