"""What a client reads of a failure: the kind (status, type, code, a fixed message), never a worker's address or
gRPC's status text; the router's log line has those, with the request id. Errors about the client's own
request keep their precise message.

The HTTP cases run a scripted decode worker (a real grpc.aio server answering the worker contract with a fixed
script, computing nothing) behind a decode-only router.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import httpx
import pytest

from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.router.app import create_app
from services.router.config import RouterConfig
from services.router.errors import (
    DisaggregationFailed,
    InvalidRequest,
    Overloaded,
    RequestTimeout,
    RequestTooLargeForWorkers,
    WorkerFailure,
    WorkerUnavailable,
    error_response,
    from_rpc_error,
    to_router_error,
)
from services.text.tokenizer import Tokenizer
from tests.unit.router.test_router_app import assert_no_internals

pytestmark = pytest.mark.anyio

ADDRESS = "10.0.0.7:9002"
# What a worker's failure looks like to gRPC: its status, and details naming a peer.
DETAILS = f"Socket closed: connection to ipv4:{ADDRESS} reset (StatusCode.UNAVAILABLE)"


def _rpc_error(code: grpc.StatusCode, details: str = DETAILS) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(("code", "kind", "status", "client_code"), [
    (grpc.StatusCode.UNAVAILABLE, WorkerUnavailable, 503, "worker_unavailable"),
    (grpc.StatusCode.INTERNAL, WorkerFailure, 502, "worker_failure"),
    (grpc.StatusCode.UNKNOWN, WorkerFailure, 502, "worker_failure"),
    (grpc.StatusCode.DATA_LOSS, WorkerFailure, 502, "worker_failure"),
    (grpc.StatusCode.CANCELLED, WorkerFailure, 502, "worker_failure"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded, 429, "overloaded"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, RequestTimeout, 504, "request_timeout"),
])
def test_a_workers_status_reaches_the_client_as_its_kind(code: grpc.StatusCode, kind: type, status: int,
                                                         client_code: str) -> None:
    error = from_rpc_error(_rpc_error(code), "decode", ADDRESS)
    assert type(error) is kind and error.status_code == status
    body = json.loads(error_response(error).body)["error"]
    assert body["code"] == client_code and body["message"]
    assert_no_internals(json.dumps(body))
    assert ADDRESS in error.message and code.name in error.message and DETAILS in error.message  # for the log


def test_the_failed_role_is_named_but_not_the_worker() -> None:
    body = from_rpc_error(_rpc_error(grpc.StatusCode.INTERNAL), "prefill", ADDRESS).body().error
    assert body.message == "the prefill worker failed while serving the request"
    unnamed = WorkerFailure(f"decode worker {ADDRESS} ended the stream before the request finished").body().error
    assert unnamed.message == "a worker failed while serving the request"


def test_a_required_pull_that_failed_says_so_without_the_workers_reason() -> None:
    refused = _rpc_error(grpc.StatusCode.FAILED_PRECONDITION, f"the KV pull is required and could not be done: "
                                                              f"handshake with {ADDRESS} refused")
    error = from_rpc_error(refused, "decode", "10.0.0.8:9003", pull_required=True)
    assert isinstance(error, DisaggregationFailed) and "handshake with" in error.message
    body = error.body().error
    assert body.code == "disaggregation_failed" and "--enforce-disagg" in body.message
    assert_no_internals(body.message)


def test_the_clients_own_errors_keep_their_message() -> None:
    """A worker refusing the request's input (a 400) says precisely what was wrong with it."""
    details = "max_tokens must be >= 1, got 0"
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION):
        error = from_rpc_error(_rpc_error(code, details), "decode", ADDRESS)
        assert isinstance(error, InvalidRequest) and error.body().error.message == details
    empty = from_rpc_error(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, ""), "decode", ADDRESS)
    assert empty.body().error.message == "the decode worker refused the request"
    assert InvalidRequest("prompt must not be empty", param="prompt").body().error.message == "prompt must not be empty"


async def _refused_for_its_size() -> grpc.aio.AioRpcError:
    """What a call gets from a real grpc server whose receive limit (a worker's, receive_limit.py) its message
    exceeds: grpc core's own status and details, not a hand-written copy of them."""
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1000)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary("/t.Echo/Echo")(b"x" * 5000)
    finally:
        await server.stop(0)
    return refused.value


async def test_a_message_over_the_workers_receive_limit_is_a_413_not_a_retry() -> None:
    """Retrying a request its workers refuse for its size never helps: 413 request_too_large, no Retry-After; the
    log line keeps grpc's sizes. A RESOURCE_EXHAUSTED that is the worker's load stays a 429."""
    refused = await _refused_for_its_size()
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    error = from_rpc_error(refused, "decode", ADDRESS)
    assert isinstance(error, RequestTooLargeForWorkers) and error.status_code == 413
    assert error.retry_after_s is None and "Received message larger than max" in error.message
    response = error_response(error)
    assert response.status_code == 413 and "retry-after" not in response.headers
    body = json.loads(response.body)["error"]
    assert body == {"message": "the request is larger than the decode worker accepts",
                    "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert_no_internals(json.dumps(body))
    for details in ("too many requests in flight",  # the worker's load
                    "CLIENT: Received message larger than max (70000000 vs. 67108864)"):  # the router refused an answer
        assert type(from_rpc_error(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, details), "decode",
                                   ADDRESS)) is Overloaded


def test_an_unexpected_exception_is_an_internal_error_for_the_client(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="services.router.errors"):
        response = error_response(RuntimeError(f"dict lookup {ADDRESS}"), "req-9")
    assert response.status_code == 500
    assert json.loads(response.body)["error"] == {"message": "internal server error", "type": "server_error",
                                                  "param": None, "code": None}
    assert any(r.getMessage() == f"request req-9 answered 500 server_error: internal error: RuntimeError: dict lookup "
               f"{ADDRESS}" for r in caplog.records)
    assert to_router_error(RuntimeError("x")).public_message() == "internal server error"


# ---- over HTTP: a scripted decode worker that breaks mid-stream ---------------------------------------


class BreakingDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Streams two tokens, then fails INTERNAL with details naming a peer."""

    async def Generate(self, request, context):  # noqa: N802
        yield worker_pb2.TokenChunk(token_ids=[5, 6], logprobs=[-0.5, -0.5],
                                    num_prompt_tokens=len(request.prompt_token_ids))
        await context.abort(grpc.StatusCode.INTERNAL, DETAILS)

    async def Info(self, request, context):  # noqa: N802
        return worker_pb2.WorkerInfo(engine_id="decode-0", role="decode", compat_hash="h", tp_size=1, block_size=16,
                                     max_model_len=512, epoch=7)


@asynccontextmanager
async def _router(tokenizer: Tokenizer) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A decode-only router (no failover: the request fails as its worker did) in front of BreakingDecode."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(BreakingDecode(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        config = RouterConfig(model="tiny", decode=(address,), health_interval_s=3600, max_decode_failovers=0)
        app = create_app(config, tokenizer_loader=lambda _: tokenizer)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=10) as http:
                yield http, address
    finally:
        await server.stop(0)


def _answered(caplog: pytest.LogCaptureFixture, request_id: str) -> str:
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"request {request_id} answered")]
    return line


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_worker_that_breaks_gives_the_client_its_kind_and_the_log_its_detail(
        tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture, stream: bool) -> None:
    async with _router(tokenizer) as (http, address):
        with caplog.at_level(logging.WARNING, logger="services.router.errors"):
            response = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "stream": stream},
                                       headers={"X-Request-Id": "broken-7"})
    if stream:  # the headers were out: an error event in the same format, then [DONE]
        assert response.status_code == 200
        blocks = [b.removeprefix("data: ") for b in response.text.split("\n\n") if b]
        assert blocks[-1] == "[DONE]"
        error = json.loads(blocks[-2])["error"]
    else:
        assert response.status_code == 502
        error = response.json()["error"]
    assert error == {"message": "the decode worker failed while serving the request", "type": "server_error",
                     "param": None, "code": "worker_failure"}
    assert_no_internals(response.text)
    assert address.split(":")[1] not in response.text
    line = _answered(caplog, "broken-7")
    assert line.startswith("request broken-7 answered 502 worker_failure: decode worker ") and address in line
    assert f"INTERNAL: {DETAILS}" in line
