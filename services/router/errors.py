"""Every failure the router reports, and the one place it becomes an HTTP status and an OpenAI error body.

Code that detects a problem raises a :class:`RouterError` subclass (or lets a msgspec decode error
or a gRPC error through); :func:`to_router_error` turns anything into a ``RouterError`` and
:func:`error_response` into the response. The same body goes into an SSE ``error`` event when a
stream fails after its headers were sent (:func:`reported`).

What the client reads and what the log gets differ where the message is the router's business: a
failure of a worker, the workers' load, a timeout, an internal error. Their ``message`` (built
anywhere, with the worker's address and its gRPC status and details) goes into one log line with the
request id, and the client gets the kind's fixed ``client_message`` with the same status, ``type``
and ``code``: nothing of the cluster's addresses or of gRPC's text leaves the router. Errors about
the client's own request (400s, 401, 404, 413) keep their precise message.
"""

from __future__ import annotations

import logging
import re
from typing import TypeVar

import grpc
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

log = logging.getLogger(__name__)


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    """OpenAI's error format: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class RouterError(Exception):
    """A failure with its HTTP status; subclasses fix the status and OpenAI error type."""

    status_code = 500
    error_type = "server_error"
    code: str | None = None
    # Statuses a client should retry (429, 503) always carry Retry-After.
    default_retry_after_s: int | None = None
    # What the client reads instead of ``message`` when that is the router's business (see the module
    # docstring); ``{worker}`` becomes "the decode worker" (the failed call's role, when known) or "a worker".
    # None: ``message`` is about the client's request and goes out as it is.
    client_message: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None, role: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s if retry_after_s is not None else self.default_retry_after_s
        self.role = role

    @property
    def sanitized(self) -> bool:
        """Whether the client reads less than ``message`` (then the log has it)."""
        return self.client_message is not None

    def public_message(self) -> str:
        """The message as the client reads it."""
        if self.client_message is None:
            return self.message
        return self.client_message.format(worker=f"the {self.role} worker" if self.role else "a worker")

    def body(self) -> ErrorBody:
        """The client's error body (OpenAI's format)."""
        return ErrorBody(ErrorDetail(self.public_message(), self.error_type, self.param, self.code))


class InvalidRequest(RouterError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class InvalidApiKey(RouterError):
    """``--api-key`` is set and the request's ``Authorization: Bearer`` key is missing or wrong."""

    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class RequestTooLarge(RouterError):
    """The body is longer than ``--max-request-bytes``."""

    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RequestTooLargeForWorkers(RequestTooLarge):
    """A worker refused the call's message as larger than its gRPC receive limit (services/worker/receive_limit.py):
    the request fits the router's ``--max-request-bytes`` but not what this deployment's workers were given, so
    retrying never helps. The log line has the sizes, to tell the operator which limit to raise."""

    client_message = "the request is larger than {worker} accepts"


class ModelNotFound(RouterError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class NotFound(RouterError):
    status_code = 404
    error_type = "invalid_request_error"


class MethodNotAllowed(RouterError):
    status_code = 405
    error_type = "invalid_request_error"


class Overloaded(RouterError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "overloaded"
    default_retry_after_s = 1
    client_message = "the server is overloaded; retry the request later"


class NoHealthyWorkers(RouterError):
    status_code = 503
    error_type = "service_unavailable"
    code = "no_healthy_workers"
    default_retry_after_s = 1
    client_message = "no healthy decode worker is available; retry the request later"


class WorkerFailure(RouterError):
    """A worker broke (internal error, stream cut short): it is marked unhealthy."""

    status_code = 502
    error_type = "server_error"
    code = "worker_failure"
    client_message = "{worker} failed while serving the request"


class WorkerUnavailable(WorkerFailure):
    """A worker could not be reached or its connection was lost (gRPC UNAVAILABLE: killed, restarting, cut off)."""

    status_code = 503
    error_type = "service_unavailable"
    code = "worker_unavailable"
    default_retry_after_s = 1
    client_message = "{worker} became unavailable while serving the request; retry the request"


class DisaggregationUnavailable(RouterError):
    """``--enforce-disagg`` and no healthy prefill worker can pair with a decode worker: the request is
    refused rather than prefilled on the decode worker."""

    status_code = 503
    error_type = "service_unavailable"
    code = "disaggregation_unavailable"
    default_retry_after_s = 1


class DisaggregationFailed(RouterError):
    """``--enforce-disagg`` and the request could not be served from the prefill worker's KV (the prefill
    worker failed, or the decode worker could not pull): refused rather than recomputed."""

    status_code = 502
    error_type = "server_error"
    code = "disaggregation_failed"
    client_message = ("the request could not be served from the prefill worker's KV, and strict disaggregation "
                      "(--enforce-disagg) forbids serving it otherwise")


class RequestTimeout(RouterError):
    status_code = 504
    error_type = "timeout"
    code = "request_timeout"
    client_message = "the request did not finish within the server's request timeout"


class InternalError(RouterError):
    """An exception nothing expected (a bug): the log has its stack."""

    client_message = "internal server error"


# gRPC codes that say the worker itself is broken or gone, not that the request was bad.
WORKER_FAULT_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNIMPLEMENTED,
})
# A decode stream that fails with one of these broke with its worker (gone, reset, crashed), not because of the
# request: the request fails over to another decode worker (request_run.py). UNIMPLEMENTED is a worker that cannot serve
# the call at all; anywhere else the same call would fail the same way for the same request.
FAILOVER_CODES = WORKER_FAULT_CODES - {grpc.StatusCode.UNIMPLEMENTED}

T = TypeVar("T")

_MSGSPEC_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING_FIELD = re.compile(r"missing required field `(?P<field>[^`]+)`")
# grpc core's details when the receiving side's max_receive_message_length refused a message:
# "SERVER: Received message larger than max (5000 vs. 1000)" (the peer that refused prefixes its side; older
# cores write none). "CLIENT: ..." is the router refusing a worker's answer, which is not the request's size.
_RECEIVER_REFUSED_SIZE = re.compile(r"^(?!CLIENT: ).*Received message larger than max", re.DOTALL)


def from_decode_error(exc: msgspec.DecodeError | UnicodeError | RecursionError) -> InvalidRequest:
    """A msgspec error as a 400 naming the offending parameter (``max_tokens``, ``messages[0].role``).

    Bytes that are not UTF-8 (``UnicodeError``) and JSON nested beyond the decoder's recursion limit
    (``RecursionError``) are bad bodies too, not server errors.
    """
    if isinstance(exc, UnicodeError):
        return InvalidRequest(f"the request body is not valid UTF-8: {exc}")
    if isinstance(exc, RecursionError):
        return InvalidRequest("the request body is not valid JSON: it is nested too deeply")
    message = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return InvalidRequest(f"the request body is not valid JSON: {message}")
    path_match = _MSGSPEC_PATH.search(message)
    # msgspec writes a mapping's value as `[...]` (`logit_bias[...]`): the param is the mapping.
    path = path_match["path"].lstrip(".").replace("[...]", "") if path_match else ""
    missing = _MISSING_FIELD.search(message)
    if missing:
        path = f"{path}.{missing['field']}" if path else missing["field"]
    return InvalidRequest(message, param=path or None)


def decode_json(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """A JSON body through ``decoder``, or a 400 naming the field at fault (``from_decode_error``)."""
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, UnicodeError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deeply
        raise from_decode_error(exc) from None


def from_rpc_error(exc: grpc.aio.AioRpcError, role: str, address: str, *,
                   pull_required: bool = False) -> RouterError:
    """A worker's gRPC status as the router's answer; the message (for the log) names the worker.

    ``pull_required``: the call was a decode worker's ``Generate`` with ``require_pull``, whose
    FAILED_PRECONDITION says the KV pull could not be done (a 502, not the client's fault). A refusal
    of the request itself (INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION) is a 400 with the
    worker's reason, which is about the client's input. A RESOURCE_EXHAUSTED is the worker's load (a 429),
    unless grpc says the worker refused the message for its size (a 413: a retry would be refused again).
    """
    code = exc.code()
    detail = f"{role} worker {address}: {code.name}: {exc.details()}"
    if pull_required and code == grpc.StatusCode.FAILED_PRECONDITION:
        return DisaggregationFailed(f"{role} worker {address} could not use the prefill worker's KV and "
                                    f"--enforce-disagg forbids recomputing the prompt: {exc.details()}", role=role)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.FAILED_PRECONDITION):
        return InvalidRequest(exc.details() or f"the {role} worker refused the request", role=role)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if _RECEIVER_REFUSED_SIZE.match(exc.details() or ""):
            return RequestTooLargeForWorkers(f"{detail} (the worker's gRPC receive limit follows from its "
                                             "context length and its --max-request-bytes)", role=role)
        return Overloaded(detail, role=role)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestTimeout(detail, role=role)
    if code == grpc.StatusCode.UNAVAILABLE:
        return WorkerUnavailable(detail, role=role)
    return WorkerFailure(detail, role=role)


def to_router_error(exc: BaseException) -> RouterError:
    """Any exception as a RouterError; unexpected ones become a 500 and are logged with their stack."""
    if isinstance(exc, RouterError):
        return exc
    if isinstance(exc, msgspec.DecodeError):
        return from_decode_error(exc)
    if isinstance(exc, StarletteHTTPException):
        if exc.status_code == 404:
            return NotFound(str(exc.detail))
        if exc.status_code == 405:
            return MethodNotAllowed(str(exc.detail))
        error = RouterError(str(exc.detail))
        error.status_code = exc.status_code
        return error
    log.error("unexpected error while serving a request", exc_info=exc)
    return InternalError(f"internal error: {type(exc).__name__}: {exc}")


def reported(exc: BaseException, request_id: str | None) -> RouterError:
    """``exc`` as the RouterError the client gets, logged first with the request id (its ``X-Request-Id``)
    when it is a server-side failure (WARNING: the default level shows it) or the client reads less of it
    (INFO: a 429, a worker's 413)."""
    error = to_router_error(exc)
    if error.sanitized or error.status_code >= 500:
        log.log(logging.WARNING if error.status_code >= 500 else logging.INFO,
                "request %s answered %d %s: %s", request_id or "-", error.status_code,
                error.code or error.error_type, error.message)
    return error


def error_response(exc: BaseException, request_id: str | None = None) -> Response:
    """The HTTP answer to ``exc`` (:func:`reported`: logged, the client's body)."""
    error = reported(exc, request_id)
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return Response(msgspec.json.encode(error.body()), status_code=error.status_code,
                    media_type="application/json", headers=headers)


def request_id_of(scope: Scope) -> str | None:
    """The HTTP request's id (``http_guards.RequestIds`` puts it in the scope's state), for log lines."""
    return scope.get("state", {}).get("request_id")


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception a handler lets out through :func:`error_response`."""

    async def handle(request: Request, exc: Exception) -> Response:
        if isinstance(exc, StarletteHTTPException) and exc.status_code == 404 and exc.detail == "Not Found":
            # No route: say so as OpenAI does, naming the endpoint (a bare "Not Found" reads as a missing model).
            exc = NotFound(f"Invalid URL ({request.method} {request.url.path}): this endpoint does not exist",
                           code="unknown_url")
        return error_response(exc, request_id_of(request.scope))

    app.add_exception_handler(RouterError, handle)
    app.add_exception_handler(msgspec.DecodeError, handle)
    app.add_exception_handler(StarletteHTTPException, handle)
    app.add_exception_handler(Exception, handle)
