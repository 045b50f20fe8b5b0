"""The cluster token on worker RPCs: workers refuse calls that do not carry it; callers add it.

With ``--kv-auth-token`` (or ``$PDSERVE_KV_AUTH_TOKEN``) set, a worker answers every call (``Prefill``,
``PrefillStream``, ``Generate``, ``GenerateParts``, ``Release``, ``Abort``, ``Info``, ``Probe``, ...) only for a
caller whose metadata holds ``authorization: Bearer <token>`` (compared in constant time), else
``UNAUTHENTICATED``: without it, anyone who can reach a worker's port could submit work or free another
request's KV. A refused call's body is never parsed (its handler takes raw bytes), so a stranger's big message
costs the worker no more than receiving it. Health checks stay open (probes carry no token), and so does the
KV handshake, which checks the same token in its request before it gives out agent metadata.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import grpc

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/pdserve.v1.KVHandshake/")


def bearer(token: str) -> str:
    return f"Bearer {token}"


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every call outside ``OPEN_METHOD_PREFIXES`` that lacks the token."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty token would let everyone in")
        self._expected = bearer(token).encode()

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        given = next((value for key, value in details.invocation_metadata or () if key == METADATA_KEY), "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected):
            return handler
        log.warning("refused %s: missing or wrong cluster token", details.method)
        return _refusing(handler)


_REFUSAL = "missing or wrong cluster token (authorization: Bearer <--kv-auth-token>)"


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts with UNAUTHENTICATED, without a request
    deserializer: the body arrives as bytes and is dropped unparsed (parsing a stranger's 60 MiB of token ids
    is the CPU and memory the token is there to keep for callers who have it)."""
    async def deny(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    async def deny_stream(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
        yield  # makes this a generator: a streaming handler

    codecs = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **codecs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **codecs)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **codecs)


def token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Channel interceptors adding ``authorization: Bearer <token>`` to calls of every kind (the router's to
    its workers, ``GenerateParts`` among them; a decode worker's pair probe to a prefill worker). One object
    per kind: a channel files each interceptor under the first kind it is an instance of, so an object that
    is several kinds at once would add the token to one of them only."""
    entry = (METADATA_KEY, bearer(token))
    return [_UnaryUnaryToken(entry), _UnaryStreamToken(entry), _StreamUnaryToken(entry), _StreamStreamToken(entry)]


def _with_token(details: grpc.aio.ClientCallDetails, entry: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), entry)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _AddsToken:
    """What the interceptor of every call kind does: the call goes on with the token in its metadata."""

    def __init__(self, entry: tuple[str, str]) -> None:
        self._entry = entry

    async def _intercept(self, continuation, client_call_details, request_or_iterator):
        return await continuation(_with_token(client_call_details, self._entry), request_or_iterator)


class _UnaryUnaryToken(_AddsToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AddsToken._intercept


class _UnaryStreamToken(_AddsToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AddsToken._intercept


class _StreamUnaryToken(_AddsToken, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _AddsToken._intercept


class _StreamStreamToken(_AddsToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AddsToken._intercept
