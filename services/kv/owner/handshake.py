"""The owner's side of the KV handshake over gRPC (grpc.aio): :class:`HandshakeServicer` answers ``Handshake``
with the engine's :class:`~services.kv.spec.description.EngineDescription`.

Agent metadata makes registered memory readable, so it is only handed to a peer that presents the shared token
when one is set; a request over ``MAX_HANDSHAKE_REQUEST_BYTES`` is refused before it is parsed.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import grpc

from services.kv.spec.compat import PROTOCOL_VERSION
from services.kv.spec.description import (
    EngineDescription,
    description_to_proto,
)
from services.proto_gen.pdserve.v1 import kv_pb2, kv_pb2_grpc

# A HandshakeRequest is a version, an engine id and the token: a few hundred bytes. The handshake is open to every
# caller (the token is checked inside the request), so a bigger body is refused before it is parsed.
MAX_HANDSHAKE_REQUEST_BYTES = 64 * 1024


HANDSHAKE_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KVHandshake"].full_name


def bounded_handshake_request(data: bytes) -> kv_pb2.HandshakeRequest | None:
    """The handshake's request deserializer: ``None`` (refused unread) for a body over
    ``MAX_HANDSHAKE_REQUEST_BYTES``, so a stranger cannot make the owner parse megabytes."""
    if len(data) > MAX_HANDSHAKE_REQUEST_BYTES:
        return None
    return kv_pb2.HandshakeRequest.FromString(data)


class HandshakeServicer(kv_pb2_grpc.KVHandshakeServicer):
    """Thin servicer: check size, version and token, then describe the engine."""

    def __init__(self, describe: Callable[[], EngineDescription], auth_token: str | None = None) -> None:
        self._describe = describe
        self._token = auth_token

    async def Handshake(self, request: kv_pb2.HandshakeRequest | None,  # noqa: N802
                        context: grpc.aio.ServicerContext):
        if request is None:  # bounded_handshake_request refused it unread
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"handshake request over {MAX_HANDSHAKE_REQUEST_BYTES} bytes")
        if request.protocol_version != PROTOCOL_VERSION:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} is not supported (this engine speaks {PROTOCOL_VERSION})",
            )
        if self._token and not hmac.compare_digest(request.auth_token.encode(), self._token.encode()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "handshake refused: missing or wrong auth token")
        return description_to_proto(self._describe())


def add_handshake_service(server: grpc.aio.Server, servicer: HandshakeServicer) -> None:
    """The generated registration, with ``bounded_handshake_request`` as the request deserializer."""
    handlers = {"Handshake": grpc.unary_unary_rpc_method_handler(
        servicer.Handshake, request_deserializer=bounded_handshake_request,
        response_serializer=kv_pb2.HandshakeResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(HANDSHAKE_SERVICE, handlers),))
    server.add_registered_method_handlers(HANDSHAKE_SERVICE, handlers)
