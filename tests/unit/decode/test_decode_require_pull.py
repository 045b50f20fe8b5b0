"""The decode servicer's side of ``require_pull``, over real gRPC with a scripted policy: the flag reaches the
policy, and a required pull that cannot be done is FAILED_PRECONDITION with the reason, counted as the
``pull_required`` outcome, before any chunk."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.metrics import WorkerMetrics
from services.decode.pull_policy import PullRequired
from services.decode.server import PULL_REQUIRED_OUTCOME
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2
from tests.unit.decode.servicer import decode_stub


class RefusingPolicy:
    """Records each start; refuses the pull when it is required."""

    def __init__(self) -> None:
        self.starts: list[bool] = []

    async def start(self, rid, prompt, params, ticket, *, require_pull: bool = False, num_output_tokens: int = 0):
        self.starts.append(require_pull)
        if require_pull:
            raise PullRequired("KV pull from prefill@a failed (handshake refused)")
        raise ValueError("scripted: not required, so refused as bad input")


def _generate(require_pull: bool) -> tuple[grpc.StatusCode, str, list[bool], float]:
    async def run() -> tuple[grpc.StatusCode, str, list[bool], float]:
        metrics, policy = WorkerMetrics("decode"), RefusingPolicy()
        async with decode_stub(metrics, policy) as stub:
            ticket = kv_pb2.TransferTicket(engine_id="prefill@a", epoch=1, request_id="r", num_tokens=3)
            call = stub.Generate(worker_pb2.GenerateRequest(
                request_id="r", prompt_token_ids=[1, 2, 3], params=worker_pb2.SamplingParams(max_tokens=4),
                ticket=ticket, require_pull=require_pull), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in call:
                    raise AssertionError("no chunk may come before the refusal")
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
