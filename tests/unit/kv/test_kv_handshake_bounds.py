"""The KV handshake's server side is open to every caller (the token is checked inside the request), so it reads
no big request: a body over ``MAX_HANDSHAKE_REQUEST_BYTES`` is refused RESOURCE_EXHAUSTED unparsed, while an
ordinary one still gets its version and token checked and the engine described (a real grpc.aio server)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.kv_synthetic import identity_for, layout_for
from services.kv.owner.handshake import (
    MAX_HANDSHAKE_REQUEST_BYTES,
    HandshakeServicer,
    add_handshake_service,
    bounded_handshake_request,
)
from services.kv.reader.peers import fetch_description
from services.kv.spec.compat import PROTOCOL_VERSION, CompatInfo
from services.kv.spec.description import EngineDescription, HandshakeError, RankExport
from services.kv.spec.wire import MemoryRegion
from services.proto_gen.pdserve.v1 import kv_pb2

TOKEN = "cluster-s3cret"
METHOD = "/pdserve.v1.KVHandshake/Handshake"
CFG = dict(kind="cross_layer", order="NHD", num_blocks=8, num_kv_heads=2, head_dim=8, dtype="float16",
           num_layers=2, block_size=4, seed=1)


def _description() -> EngineDescription:
    layout = layout_for(CFG, 1)
    regions = tuple(MemoryRegion(b.index, 1 << 40, b.num_bytes, 0, "DRAM") for b in layout.buffers())
    return EngineDescription("owner", 7, "m", 2, 2, 8, CompatInfo.of_identity(identity_for(CFG, layout)),
                             layout.groups, (RankExport(0, "owner-tp0", b"", regions, layout),))


def test_the_deserializer_refuses_an_oversized_body_without_parsing_it() -> None:
    garbage = b"\xff" * (MAX_HANDSHAKE_REQUEST_BYTES + 1)  # not a protobuf message: parsing it would raise
    assert bounded_handshake_request(garbage) is None
    request = kv_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, auth_token=TOKEN)
    assert bounded_handshake_request(request.SerializeToString()) == request


def test_an_oversized_handshake_is_refused_and_an_ordinary_one_served() -> None:
    described: list[int] = []

    def describe() -> EngineDescription:
        described.append(1)
        return _description()

    async def run() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        add_handshake_service(server, HandshakeServicer(describe, TOKEN))
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                raw = channel.unary_unary(METHOD, response_deserializer=kv_pb2.HandshakeResponse.FromString)
                for body in (b"\xff" * (8 << 20),  # garbage: parsed, it would fail as undecodable instead
                             kv_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION,
                                                     auth_token="x" * (8 << 20)).SerializeToString()):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await raw(body, timeout=10)
                    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert described == []
            with pytest.raises(HandshakeError, match="PERMISSION_DENIED"):
                await fetch_description(address, reader_engine_id="reader", auth_token="wrong")
            assert (await fetch_description(address, reader_engine_id="reader", auth_token=TOKEN)).epoch == 7
            assert described == [1]
        finally:
            await server.stop(None)

    asyncio.run(run())
