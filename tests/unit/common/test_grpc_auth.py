"""The cluster token (services/common/grpc_auth.py) over a real grpc.aio worker server in this process: the
client interceptors put the token on calls of all four kinds (the router's GenerateParts is stream-stream), and a
call without it is refused UNAUTHENTICATED before its body is parsed, whatever its kind and size."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from services.common.grpc_auth import METADATA_KEY, bearer, token_interceptors
from services.proto_gen.pdserve.v1 import worker_pb2
from services.worker.grpc_server import WorkerServer

TOKEN = "cluster-s3cret"
SERVICE = "pdserve.test.Calls"
KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
OLD_LIMIT = 64 << 20  # the receive limit workers had: under it, the interceptor alone keeps big bodies unparsed


class CountingServer:
    """A worker server with one method of each kind, whose request deserializer counts its calls."""

    def __init__(self) -> None:
        self.parsed = 0
        self.worker = WorkerServer([], TOKEN, max_receive_bytes=OLD_LIMIT)

        def parse(data: bytes) -> worker_pb2.PrefillRequest:
            self.parsed += 1
            return worker_pb2.PrefillRequest.FromString(data)

        async def unary(request, context) -> worker_pb2.ReleaseResponse:
            return worker_pb2.ReleaseResponse(released=True)

        async def streamed(request, context) -> AsyncIterator[worker_pb2.ReleaseResponse]:
            yield worker_pb2.ReleaseResponse(released=True)

        async def from_stream(requests, context) -> worker_pb2.ReleaseResponse:
            return worker_pb2.ReleaseResponse(released=bool([r async for r in requests]))

        async def stream_from_stream(requests, context) -> AsyncIterator[worker_pb2.ReleaseResponse]:
            async for _ in requests:
                yield worker_pb2.ReleaseResponse(released=True)

        codecs = {"request_deserializer": parse,
                  "response_serializer": worker_pb2.ReleaseResponse.SerializeToString}
        handlers = {"unary_unary": grpc.unary_unary_rpc_method_handler(unary, **codecs),
                    "unary_stream": grpc.unary_stream_rpc_method_handler(streamed, **codecs),
                    "stream_unary": grpc.stream_unary_rpc_method_handler(from_stream, **codecs),
                    "stream_stream": grpc.stream_stream_rpc_method_handler(stream_from_stream, **codecs)}
        self.worker.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    async def __aenter__(self) -> str:
        port = self.worker.bind("127.0.0.1", 0)
        await self.worker.server.start()
        return f"127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        await self.worker.server.stop(None)


async def call(channel: grpc.aio.Channel, kind: str, body: bytes, metadata=()) -> list[worker_pb2.ReleaseResponse]:
    """One call of ``kind`` carrying ``body`` (a serialized PrefillRequest) as its message, its answers."""
    method: Callable = getattr(channel, kind)(f"/{SERVICE}/{kind}", request_serializer=None,
                                              response_deserializer=worker_pb2.ReleaseResponse.FromString)

    async def requests() -> AsyncIterator[bytes]:
        yield body

    request = requests() if kind.startswith("stream") else body
    answer = method(request, timeout=30, metadata=metadata)
    if kind.endswith("_stream"):
        return [r async for r in answer]
    return [await answer]


def big_prefill(num_bytes: int) -> bytes:
    """A serialized PrefillRequest of about ``num_bytes``: prompt token ids of four varint bytes each."""
    request = worker_pb2.PrefillRequest(request_id="big", prompt_token_ids=[1 << 21] * (num_bytes // 4))
    return request.SerializeToString()


@pytest.mark.parametrize("kind", KINDS)
def test_the_token_interceptors_authenticate_calls_of_every_kind(kind: str) -> None:
    async def run() -> None:
        server = CountingServer()
        async with server as address, grpc.aio.insecure_channel(
                address, interceptors=token_interceptors(TOKEN)) as channel:
            answers = await call(channel, kind, worker_pb2.PrefillRequest(request_id="r").SerializeToString())
        assert [a.released for a in answers] == [True]
        assert server.parsed == 1

    asyncio.run(run())


@pytest.mark.parametrize("metadata", [(), ((METADATA_KEY, bearer("wrong")),)], ids=["no token", "wrong token"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_call_without_the_token_is_refused_without_parsing_its_body(kind: str, metadata) -> None:
    async def run() -> None:
        server = CountingServer()
        body = big_prefill(12 << 20)  # 12 MiB, under the receive limit: only the refusal stands in the way
        async with server as address, grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(channel, kind, body, metadata)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert server.parsed == 0

    asyncio.run(run())
