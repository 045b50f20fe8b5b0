"""The router's HTTP surface around the generation routes: bad bytes, the API key, request ids,
``/openapi.json`` and ``/docs``, ``/tokenize`` and ``/detokenize``.

Bad bodies are sent to a real uvicorn server over one keep-alive connection (``http.client``),
and a good request on that same connection must still be answered: a server error there used to
close it. The rest talks to the app in-process, as ``test_router_app.py`` does.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import msgspec
import pytest
import uvicorn

from services.router.app import create_app
from services.router.cli_args import add_router_parser, router_config_from_args
from services.router.config import DEFAULT_MAX_REQUEST_BYTES, RouterConfig
from services.router.http_guards import MAX_REQUEST_ID_LENGTH
from services.router.pairing import Role, WorkerIdentity
from services.router.protocol import ChatCompletionRequest, CompletionRequest
from services.text.tokenizer import Tokenizer
from tests.unit.router._kv_fakes import SilentKVSource

NOWHERE = "127.0.0.1:1"  # nothing listens on port 1: an RPC there fails at once
KEY = "sk-test-key"


class Probe:
    """Every listed address is healthy (nothing listens there: a request that goes out fails)."""

    def __init__(self, up: dict[str, WorkerIdentity]) -> None:
        self.up = up

    async def __call__(self, role: Role, address: str) -> WorkerIdentity:
        if address not in self.up:
            raise ConnectionRefusedError(address)
        return self.up[address]


def _app(model_dir: Path, tokenizer: Tokenizer, **config):
    up = {"127.0.0.1:2": WorkerIdentity("prefill-0", "prefill", "h", max_model_len=64),
          NOWHERE: WorkerIdentity("decode-0", "decode", "h", max_model_len=64)}
    fields = {"model": str(model_dir), "prefill": ("127.0.0.1:2",), "decode": (NOWHERE,),
              "health_interval_s": 3600, **config}
    return create_app(RouterConfig(**fields), tokenizer_loader=lambda _: tokenizer, probe=Probe(up),
                      kv_source=SilentKVSource())


@asynccontextmanager
async def _client(model_dir: Path, tokenizer: Tokenizer, **config) -> AsyncIterator[httpx.AsyncClient]:
    app = _app(model_dir, tokenizer, **config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            yield http


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- a real server, one keep-alive connection --------------------------------------------------------


@contextmanager
def _serving(app) -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the router did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def server_port(model_dir: Path, tokenizer: Tokenizer) -> Iterator[int]:
    with _serving(_app(model_dir, tokenizer, max_request_bytes=LIMIT)) as port:
        yield port


def _exchange(conn: http.client.HTTPConnection, method: str, path: str, body=None,
              headers: dict | None = None, chunked: bool = False) -> tuple[int, dict, bytes]:
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})},
                 encode_chunked=chunked)
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


N = 100_000
LIMIT = 256 * 1024  # the test server's --max-request-bytes: the deeply nested bodies (~200 KB) fit
BAD_BODIES = {
    "not-utf8": (b'{"prompt": "\xff\xfe caf\xe9", "max_tokens": 1}', 400),
    "not-utf8-key": (b'{"pr\xffompt": "x"}', 400),
    "truncated": (b'{"prompt": "a long prompt that stops in the mid', 400),
    "deeply-nested-arrays": (b'{"prompt": "x", "extra": ' + b"[" * N + b"]" * N + b"}", 400),
    "deeply-nested-unclosed": (b'{"prompt": "x", "extra": ' + b"[" * N, 400),
    "deeply-nested-objects": (b'{"prompt": "x", "extra": ' + b'{"a":' * (N // 4) + b"1" + b"}" * (N // 4) + b"}", 400),
    "nested-top-level": (b"[" * N + b"]" * N, 400),
    "over-the-limit": (b'{"prompt": "' + b"x" * LIMIT + b'"}', 413),
    "empty": (b"", 400),
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_bytes_are_4xx_and_the_connection_stays_usable(server_port: int, name: str, path: str) -> None:
    body, status = BAD_BODIES[name]
    conn = http.client.HTTPConnection("127.0.0.1", server_port, timeout=30)
    try:
        got, headers, payload = _exchange(conn, "POST", path, body)
        assert got == status, payload[:300]
        error = json.loads(payload)["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if status == 413:
            assert error["code"] == "request_too_large"
        assert headers.get("connection", "").lower() != "close"
        sock = conn.sock
        got, _, payload = _exchange(conn, "GET", "/v1/models")
        assert got == 200 and json.loads(payload)["data"][0]["object"] == "model"
        assert conn.sock is sock, "the keep-alive connection was closed"
    finally:
        conn.close()


def test_a_chunked_body_over_the_limit_is_413_and_the_connection_stays_usable(server_port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server_port, timeout=30)
    try:
        chunks = (b'{"prompt": "', *([b"y" * 8192] * 40), b'"}')  # 320 KiB, no Content-Length
        status, _, payload = _exchange(conn, "POST", "/v1/completions", iter(chunks), chunked=True)
        assert status == 413 and json.loads(payload)["error"]["code"] == "request_too_large"
        sock = conn.sock
        assert _exchange(conn, "GET", "/health")[0] == 200
        assert conn.sock is sock
    finally:
        conn.close()


def test_a_body_under_the_limit_still_goes_through(server_port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server_port, timeout=30)
    try:
        body = json.dumps({"prompt": "z" * 1000}).encode()
        status, _, payload = _exchange(conn, "POST", "/tokenize", body)
        assert status == 200 and json.loads(payload)["count"] == 1000
    finally:
        conn.close()


def test_the_request_decoders_refuse_bad_bytes_with_400() -> None:
    from services.router.errors import InvalidRequest
    from services.router.protocol import decode_request

    for kind in (CompletionRequest, ChatCompletionRequest):
        for body, status in BAD_BODIES.values():
            if status == 413:
                continue
            with pytest.raises(InvalidRequest):
                decode_request(body, kind)


# ---- the API key -----------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_api_key(model_dir: Path, tokenizer: Tokenizer, anyio_backend: str) -> None:
    async with _client(model_dir, tokenizer, api_key=KEY) as http:
        protected = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                     ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                     ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                     ("GET", "/v1/nothing-here", None)]
        for method, path, body in protected:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                            {"Authorization": f"Bearer {KEY}x"}, {"Authorization": "Bearer"}):
                response = await http.request(method, path, json=body, headers=headers)
                error = _error(response, 401)
                assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
                assert KEY not in response.text and response.headers["WWW-Authenticate"] == "Bearer"
        right = {"Authorization": f"Bearer {KEY}"}
        assert (await http.get("/v1/models", headers=right)).status_code == 200
        assert (await http.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})).status_code == 200
        assert (await http.post("/tokenize", json={"prompt": "hi"}, headers=right)).json()["count"] == 2
        assert _error(await http.post("/v1/completions", json={"prompt": 1}, headers=right), 400)
        assert _error(await http.get("/v1/nothing-here", headers=right), 404)
        for path in ("/health", "/metrics", "/openapi.json", "/docs"):
            assert (await http.get(path)).status_code == 200, path
        metrics = (await http.get("/metrics")).text
        assert 'pdserve_router_requests_total{endpoint="/v1/models",status="401"}' in metrics


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_without_a_key_everything_is_open(model_dir: Path, tokenizer: Tokenizer, anyio_backend: str) -> None:
    async with _client(model_dir, tokenizer) as http:
        assert (await http.get("/v1/models")).status_code == 200
        assert (await http.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer x"})).is_success


def test_api_key_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(*argv: str) -> RouterConfig:
        parser = argparse.ArgumentParser()
        add_router_parser(parser.add_subparsers(dest="command"))
        return router_config_from_args(parser.parse_args(["router", "--decode", "d:1", *argv]))

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    config = parse()
    assert config.api_key is None and config.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    assert parse("--api-key", "k1", "--max-request-bytes", "1000").api_key == "k1"
    assert parse("--max-request-bytes", "1000").max_request_bytes == 1000
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert parse().api_key == "from-env" and parse("--api-key", "k2").api_key == "k2"
    assert "from-env" not in repr(parse())
    with pytest.raises(ValueError, match="max_request_bytes"):
        RouterConfig(decode=("d:1",), max_request_bytes=0)


# ---- request ids -----------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_request_ids(model_dir: Path, tokenizer: Tokenizer, anyio_backend: str,
                           caplog: pytest.LogCaptureFixture) -> None:
    async with _client(model_dir, tokenizer) as http:
        generated = (await http.get("/v1/models")).headers["X-Request-Id"]
        assert len(generated) == 32 and generated != (await http.get("/health")).headers["X-Request-Id"]
        assert (await http.get("/v1/models", headers={"X-Request-Id": "abc-123"})).headers["X-Request-Id"] == "abc-123"
        for bad in ("has space", "x" * (MAX_REQUEST_ID_LENGTH + 1), "tab\there", ""):
            echoed = (await http.get("/health", headers={"X-Request-Id": bad})).headers["X-Request-Id"]
            assert echoed != bad and len(echoed) == 32
        # Errors carry it too; so does a request that reaches the (unreachable) workers, whose log line names it.
        response = await http.post("/v1/completions", json={"prompt": 5}, headers={"X-Request-Id": "bad-body-1"})
        assert response.status_code == 400 and response.headers["X-Request-Id"] == "bad-body-1"
        with caplog.at_level(logging.INFO, logger="services.router.flow"):
            response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                       headers={"X-Request-Id": "trace-me-42"})
        assert response.status_code == 503 and response.headers["X-Request-Id"] == "trace-me-42"
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request id=")]
        assert len(lines) == 1 and lines[0].startswith("request id=cmpl-trace-me-42-"), lines


# ---- /openapi.json and /docs -------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_openapi_describes_the_validated_schemas(model_dir: Path, tokenizer: Tokenizer,
                                                       anyio_backend: str) -> None:
    async with _client(model_dir, tokenizer) as http:
        response = await http.get("/openapi.json")
        docs = await http.get("/docs")
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    spec = response.json()
    assert spec["openapi"].startswith("3.1")
    schemas = spec["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/tokenize", "/detokenize"):
        assert path in spec["paths"], path
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                       ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        operation = spec["paths"][path]["post"]
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}"
        assert operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    # The very schemas msgspec validates with.
    for kind in (CompletionRequest, ChatCompletionRequest):
        _, own = msgspec.json.schema_components([kind], ref_template="#/components/schemas/{name}")
        assert schemas[kind.__name__] == own[kind.__name__]
    completion = schemas["CompletionRequest"]
    assert completion["required"] == ["prompt"]
    assert completion["properties"]["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1,
                                                                   "maximum": 2**31 - 1}
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    _resolve_every_ref(spec, spec)
    assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]
    assert "/openapi.json" in docs.text


def _resolve_every_ref(node, spec: dict) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if ref is not None:
            assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in spec["components"]["schemas"]
        for value in node.values():
            _resolve_every_ref(value, spec)
    elif isinstance(node, list):
        for value in node:
            _resolve_every_ref(value, spec)


# ---- /tokenize and /detokenize -------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_tokenize_and_detokenize(model_dir: Path, tokenizer: Tokenizer, anyio_backend: str) -> None:
    async with _client(model_dir, tokenizer) as http:
        answer = (await http.post("/tokenize", json={"prompt": "héllo"})).json()
        assert answer == {"count": 6, "max_model_len": 64, "tokens": tokenizer.encode("héllo")}
        assert (await http.post("/detokenize", json={"tokens": answer["tokens"]})).json() == {"prompt": "héllo"}

        messages = [{"role": "user", "content": "hi"}]
        chat = (await http.post("/tokenize", json={"messages": messages})).json()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        assert chat["count"] == len(chat["tokens"])
        bare = (await http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
        assert bare["count"] < chat["count"]
        special = (await http.post("/detokenize", json={"tokens": chat["tokens"]})).json()["prompt"]
        assert special == text

        for path, body, param in (
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"messages": []}, "messages"),
            ("/tokenize", {"messages": [{"content": "x"}]}, "messages[0].role"),
            ("/detokenize", {"tokens": [tokenizer.vocab_size]}, "tokens[0]"),
            ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
            ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
            ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
            ("/detokenize", {"tokens": 3}, "tokens"),
            ("/detokenize", {}, "tokens"),
        ):
            assert _error(await http.post(path, json=body), 400)["param"] == param, (path, body)
        assert _error(await http.post("/tokenize", content=b"{not json"), 400)
        assert _error(await http.post("/tokenize", json={"prompt": "x", "model": "other"}), 404)["code"] == \
            "model_not_found"
        assert _error(await http.get("/tokenize"), 405)


def test_an_unexpected_error_is_a_500_and_the_connection_stays_usable(model_dir: Path, tokenizer: Tokenizer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("services.router.app.tokenize", broken)
    with _serving(_app(model_dir, tokenizer)) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            status, headers, payload = _exchange(conn, "POST", "/tokenize", b'{"prompt": "x"}',
                                                 headers={"X-Request-Id": "oops-1"})
            assert status == 500 and headers["x-request-id"] == "oops-1"
            assert json.loads(payload)["error"]["type"] == "server_error"
            sock = conn.sock
            assert _exchange(conn, "GET", "/health")[0] == 200
            assert conn.sock is sock
        finally:
            conn.close()
