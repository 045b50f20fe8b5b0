"""A worker's gRPC receive limit (services/worker/receive_limit.py): the largest legitimate message of each kind
fits under it for workers of several shapes, and a message over it is refused RESOURCE_EXHAUSTED by grpc core
before any deserializer sees it (a real grpc.aio worker server in this process)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.contract.sampling_params import DEFAULT_MAX_REQUEST_BYTES, MAX_LOGIT_BIAS
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2
from services.worker.grpc_server import WorkerServer
from services.worker.receive_limit import max_receive_bytes

MAX_ID = (1 << 32) - 1  # the longest varint a uint32 has


def largest_params(max_request_bytes: int) -> worker_pb2.SamplingParams:
    """Sampling params as big as a body of ``max_request_bytes`` can make them: the schema takes the body (its
    JSON text is at least as long as the proto's string), the logit bias its most entries of the longest ids."""
    return worker_pb2.SamplingParams(
        max_tokens=MAX_ID, stop_token_ids=[MAX_ID] * 8, logit_bias={MAX_ID - i: -100.0 for i in range(MAX_LOGIT_BIAS)},
        structured_output=worker_pb2.StructuredOutput(kind="json_schema", schema="x" * max_request_bytes))


def largest_ticket(num_tokens: int, num_groups: int, tp_size: int) -> kv_pb2.TransferTicket:
    """A ticket of owner blocks of one token in both tiers, a digest per token per reading rank, eight owner
    ranks' staged offsets and realistic ids."""
    blocks = [kv_pb2.GroupBlocks(group_id=g, block_ids=[MAX_ID] * num_tokens) for g in range(num_groups)]
    return kv_pb2.TransferTicket(
        engine_id="prefill@[2001:db8:ffff:ffff:ffff:ffff:ffff:ffff]:65535", epoch=(1 << 64) - 1,
        request_id="cmpl-" + "f" * 64, groups=blocks, host_groups=blocks, num_tokens=MAX_ID, first_token_id=MAX_ID,
        first_token_logprob=-1.0, handshake_address="[2001:db8:ffff:ffff:ffff:ffff:ffff:ffff]:65535",
        num_host_tokens=MAX_ID, notify_nonce="f" * 64, signature=b"\xff" * 32,
        digests=[kv_pb2.GroupDigests(group_id=g, reader_rank=r, unit=1, digests=[(1 << 64) - 1] * num_tokens)
                 for g in range(num_groups) for r in range(tp_size)],
        part_start_token=MAX_ID, num_prompt_tokens=MAX_ID, has_state=True, state_slot=MAX_ID,
        state_digests=[(1 << 64) - 1] * tp_size, staged_offsets=[(1 << 64) - 1] * 8)


@pytest.mark.parametrize(("max_model_len", "num_groups", "tp_size"), [(64, 1, 1), (2048, 2, 2), (32768, 3, 8)])
def test_the_largest_legitimate_message_of_each_kind_fits_the_limit(max_model_len, num_groups, tp_size) -> None:
    limit = max_receive_bytes(max_model_len, num_groups, tp_size, DEFAULT_MAX_REQUEST_BYTES)
    prompt = [MAX_ID] * max_model_len
    params = largest_params(DEFAULT_MAX_REQUEST_BYTES)
    ticket = largest_ticket(max_model_len, num_groups, tp_size)
    generate = worker_pb2.GenerateRequest(request_id="cmpl-" + "f" * 64, prompt_token_ids=prompt, params=params,
                                          ticket=ticket, require_pull=True, num_output_tokens=MAX_ID)
    messages = [
        worker_pb2.PrefillRequest(request_id="cmpl-" + "f" * 64, prompt_token_ids=prompt, params=params,
                                  reader_tp_size=MAX_ID, reader_block_size=MAX_ID),
        generate,
        worker_pb2.GenerateInput(start=generate),  # GenerateParts' first input; every later one is a part ticket
        worker_pb2.GenerateInput(part=ticket),
        worker_pb2.SwitchRoleRequest(role="prefill", drain_timeout_s=1e9),
    ]
    for message in messages:
        assert message.ByteSize() <= limit, (type(message).__name__, message.ByteSize(), limit)
    # Not a loose bound: the largest Generate takes most of it.
    assert generate.ByteSize() > 0.9 * limit


def test_bounds_below_one_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="max_model_len=0"):
        max_receive_bytes(0, 1, 1, DEFAULT_MAX_REQUEST_BYTES)


def test_a_message_over_the_limit_is_refused_before_it_is_deserialized() -> None:
    limit = max_receive_bytes(1024, 1, 1, 1 << 20)
    parsed: list[int] = []

    def parse(data: bytes) -> bytes:
        parsed.append(len(data))
        return data

    async def echo(request: bytes, context) -> bytes:
        return b"ok"

    async def run() -> None:
        worker = WorkerServer([], max_receive_bytes=limit)
        handler = grpc.unary_unary_rpc_method_handler(echo, request_deserializer=parse)
        worker.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.test.Limit",
                                                                                     {"Echo": handler}),))
        port = worker.bind("127.0.0.1", 0)
        await worker.server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                echo_call = channel.unary_unary("/pdserve.test.Limit/Echo")
                assert await echo_call(b"\0" * (limit - 64), timeout=10) == b"ok"  # framing aside, at the limit
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await echo_call(b"\0" * (limit + 1), timeout=10)
        finally:
            await worker.server.stop(None)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert parsed == [limit - 64]  # the one under the limit only

    asyncio.run(run())
