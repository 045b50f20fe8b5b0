"""What every HTTP request goes through before a route sees it: its request id, the API key, a bounded body.

Pure ASGI middlewares (streaming-safe, like the request counter in ``app.py``):

* :class:`RequestIds` takes a client's ``X-Request-Id`` when it is printable ASCII of bounded length
  (else makes one), puts it on ``request.state.request_id`` and echoes it on every response.
* :class:`ApiKeyAuth` asks for ``Authorization: Bearer <--api-key>`` on everything but the open
  paths (health, metrics, the API description), compared in constant time; else 401. An open path
  that shows more to a caller with the key (``/health``'s workers) asks :func:`presents_api_key`.
* :class:`AnswerUnexpected` answers an exception no handler took with the 500 error body instead of
  letting it reach the server, which would close the client's keep-alive connection.

:func:`read_body` reads a body up to ``--max-request-bytes`` (413 beyond it).
"""

from __future__ import annotations

import hmac
import re
import uuid

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.router import overhead
from services.router.errors import InvalidApiKey, RequestTooLarge, error_response, request_id_of

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_LENGTH = 128
# Printable ASCII without the space: the id goes into log lines (``id=...``) and worker request ids.
_VALID_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID_LENGTH)
# Paths anyone may read: probes, scrapers and the API description. What they show names no worker
# (/health lists the workers only to a caller with the key; /metrics labels them by an opaque id).
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs"})


def _authorization(scope: Scope) -> bytes | None:
    return next((value for name, value in scope["headers"] if name == b"authorization"), None)


def _key_matches(given: bytes, api_key: str) -> bool:
    """``Bearer <api_key>``: the scheme case-insensitive, the key compared in constant time."""
    scheme, _, key = given.partition(b" ")
    return hmac.compare_digest(scheme.lower() + b" " + key.strip(), b"bearer " + api_key.encode())


def presents_api_key(scope: Scope, api_key: str | None) -> bool:
    """Whether the request may see what the API key guards: it carries the key, or the router has none."""
    if api_key is None:
        return True
    given = _authorization(scope)
    return given is not None and _key_matches(given, api_key)


def client_request_id(scope: Scope) -> str | None:
    """The request's ``X-Request-Id`` if it is acceptable, else None."""
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return value.decode("ascii") if _VALID_REQUEST_ID.fullmatch(value) else None
    return None


class RequestIds:
    """Give each request an id (the client's ``X-Request-Id`` or a new one) and return it in the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = client_request_id(scope)
        request_id = given or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["request_id_from_client"] = request_id, given is not None
        header = (REQUEST_ID_HEADER.lower().encode(), request_id.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


def worker_request_id(request: Request, prefix: str) -> str:
    """The id the workers get (and the response's ``id``): it contains the HTTP request id, so every
    log line about the request, the router's and the workers', can be found by it. A client's id
    gets a random suffix: two requests reusing one id must not collide on a worker."""
    state = request.scope.get("state", {})
    request_id = state.get("request_id") or uuid.uuid4().hex
    if state.get("request_id_from_client"):
        return f"{prefix}-{request_id}-{uuid.uuid4().hex[:12]}"
    return f"{prefix}-{request_id}"


class ApiKeyAuth:
    """401 in OpenAI's error format unless ``Authorization: Bearer <api_key>`` (paths in OPEN_PATHS are open)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = _authorization(scope)
        if given is None:
            error = InvalidApiKey("You didn't provide an API key. You need to provide your API key in an "
                                  "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        elif _key_matches(given, self.api_key):
            await self.app(scope, receive, send)
            return
        else:
            error = InvalidApiKey("Incorrect API key provided.")
        response = error_response(error)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


class AnswerUnexpected:
    """An exception no handler took becomes the 500 error body, and the connection stays open."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_watching(message: Message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_watching)
        except Exception as exc:
            if started:  # too late for a status: the server cuts the response short
                raise
            await error_response(exc, request_id_of(scope))(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or RequestTooLarge (413) once it is known to be longer than ``limit`` bytes.

    What is left unread of a refused body is skipped by the server, so the connection stays usable.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"the request body is {int(declared)} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"the request body is longer than the limit of {limit} bytes")
        chunks.append(chunk)
    overhead.mark("body_read")
    return b"".join(chunks)
