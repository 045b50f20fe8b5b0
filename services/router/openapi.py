"""``/openapi.json``: an OpenAPI 3.1 document built from the msgspec types that decode and encode the wire.

The request schemas are the very Structs the routes decode with (fields, types, ranges, which are
required), so the description cannot drift from what is validated. FastAPI's own generator is off:
the routes take a raw ``Request`` and would be described as taking nothing.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.router.errors import ErrorBody
from services.router.protocol import ChatCompletionRequest, CompletionRequest
from services.router.responses import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, ModelList
from services.router.responses_request import ResponsesRequest
from services.router.tokenize_api import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

_REF = "#/components/schemas/{name}"
_TYPES = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest, Completion,
          CompletionChunk, ChatCompletion, ChatCompletionChunk, ModelList, TokenizeResponse, DetokenizeResponse,
          ErrorBody)


def _ref(kind: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=kind.__name__)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    """Error responses, all in OpenAI's error format."""
    texts = {400: "invalid request", 401: "missing or wrong API key (only with --api-key)",
             404: "unknown model", 413: "request body over --max-request-bytes", 429: "overloaded",
             502: "a worker failed (with --enforce-disagg also: the prefill worker failed or the KV pull did)",
             503: "no healthy worker, or a worker became unavailable while serving the request (with "
                  "--enforce-disagg also: no prefill worker that can pair)",
             504: "request timed out"}
    return {str(s): _json({"$ref": "#/components/schemas/ErrorBody"}, texts[s]) for s in statuses}


def _operation(summary: str, request: type | None, ok: dict[str, Any], *statuses: int,
               secured: bool = True) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok, **_errors(*statuses)}}
    if request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    if not secured:
        op["security"] = []
    return op


def _stream_or(kind: type, chunk: type) -> dict[str, Any]:
    return {"description": f"a {kind.__name__}, or with stream=true server-sent events of {chunk.__name__} "
                           "ending with `data: [DONE]`",
            "content": {"application/json": {"schema": _ref(kind)},
                        "text/event-stream": {"schema": {"type": "string"}, "x-event-schema": _ref(chunk)}}}


def openapi_document(title: str = "pdserve router", version: str = "0.1.0") -> dict[str, Any]:
    """The router's API description (OpenAPI 3.1, whose schema dialect is msgspec's JSON Schema)."""
    _, components = msgspec.json.schema_components(_TYPES, ref_template=_REF)
    generation_errors = (400, 401, 404, 413, 429, 502, 503, 504)
    paths = {
        "/v1/completions": {"post": _operation("Complete a prompt", CompletionRequest,
                                               _stream_or(Completion, CompletionChunk), *generation_errors)},
        "/v1/chat/completions": {"post": _operation("Answer a chat", ChatCompletionRequest,
                                                    _stream_or(ChatCompletion, ChatCompletionChunk),
                                                    *generation_errors)},
        "/v1/responses": {"post": _operation(
            "Answer input items (stateless: no stored responses)", ResponsesRequest,
            {"description": "a response object, or with stream=true server-sent events typed by their `event:` "
                            "line, from response.created to response.completed",
             "content": {"application/json": {"schema": {"type": "object"}},
                         "text/event-stream": {"schema": {"type": "string"}}}}, *generation_errors)},
        "/v1/models": {"get": _operation("The served model", None, _json(_ref(ModelList), "the model list"), 401)},
        "/tokenize": {"post": _operation("Token ids of a prompt or chat", TokenizeRequest,
                                         _json(_ref(TokenizeResponse), "the token ids"), 400, 401, 404, 413)},
        "/detokenize": {"post": _operation("Text of token ids", DetokenizeRequest,
                                           _json(_ref(DetokenizeResponse), "the text"), 400, 401, 404, 413)},
        "/health": {"get": {
            "summary": "Whether requests can be served; every worker's state too with the API key (or without "
                       "--api-key)", "security": [],
            "responses": {"200": _json({"type": "object"}, "ok or degraded"),
                          "503": _json({"type": "object"}, "nothing can be served")}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "the router's --api-key, when set"}}},
        "security": [{"bearer": []}],
    }
