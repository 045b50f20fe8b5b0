"""The router's request flow against scripted gRPC servicers: NOT an end-to-end test.

The servicers below answer the worker contract (``worker.proto``) with fixed scripts and record
what the router asked; they compute nothing. What is tested is the router's side only: the
order of RPCs, the ticket hand-over, skipping the first token the decode stream repeats, SSE and
JSON output, clean-up (Abort, Release) on disconnect and on failures, and health marking. The
real workers are exercised by the e2e tests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from services.contract.wire import ROLE_REFUSED_KEY
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from services.router.app import create_app
from services.router.config import RouterConfig
from services.router.pairing import Role
from services.router.runtime import RouterRuntime
from services.text.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

ANSWER = "Paris is nice."


def _info(role: str) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(engine_id=f"{role}-0", role=role, compat_hash="h", tp_size=2 if role == "decode"
                                 else 1, block_size=16, max_model_len=512, epoch=7)


@dataclass
class ScriptedPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    first_token_id: int = 0
    fail_with: grpc.StatusCode | None = None
    hang: bool = False
    requests: list = field(default_factory=list)
    released: list = field(default_factory=list)
    aborted: list = field(default_factory=list)

    async def Prefill(self, request, context):  # noqa: N802
        self.requests.append(request)
        if self.fail_with is not None:
            await context.abort(self.fail_with, "scripted failure")
        if self.hang:
            await asyncio.Event().wait()
        ticket = kv_pb2.TransferTicket(engine_id="prefill-0", epoch=7, request_id=request.request_id,
                                       num_tokens=len(request.prompt_token_ids), first_token_id=self.first_token_id,
                                       groups=[kv_pb2.GroupBlocks(group_id=0, block_ids=[3, 4])])
        return worker_pb2.PrefillResponse(ticket=ticket, first_token_id=self.first_token_id, first_logprob=-0.25,
                                          num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=16)

    async def Release(self, request, context):  # noqa: N802
        self.released.append(request.request_id)
        return worker_pb2.ReleaseResponse(released=True)

    async def Abort(self, request, context):  # noqa: N802
        self.aborted.append(request.request_id)
        return worker_pb2.AbortResponse(aborted=True)

    async def Info(self, request, context):  # noqa: N802
        return _info("prefill")


@dataclass
class ScriptedDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Streams ``chunks`` (lists of token ids), then finishes, fails or hangs."""

    chunks: list[list[int]] = field(default_factory=list)
    then: str = "finish"  # "finish" | "fail" | "hang"
    requests: list = field(default_factory=list)
    aborted: list = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    # Shared by several servicers: while [n > 0], a Generate is refused as a worker that switched to prefill does.
    role_refusals: list[int] = field(default_factory=lambda: [0])

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        if self.role_refusals[0] > 0:
            self.role_refusals[0] -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker serves the prefill role now",
                                trailing_metadata=((ROLE_REFUSED_KEY, "decode"),))
        for i, token_ids in enumerate(self.chunks):
            last = i == len(self.chunks) - 1 and self.then == "finish"
            yield worker_pb2.TokenChunk(token_ids=token_ids, logprobs=[-0.5] * len(token_ids), finished=last,
                                        finish_reason="stop" if last else "",
                                        num_prompt_tokens=len(request.prompt_token_ids))
        if self.then == "fail":
            await context.abort(grpc.StatusCode.INTERNAL, "scripted crash")
        if self.then == "hang":
            try:
                await asyncio.Event().wait()
            finally:
                self.cancelled.set()

    async def Abort(self, request, context):  # noqa: N802
        self.aborted.append(request.request_id)
        return worker_pb2.AbortResponse(aborted=True)

    async def Info(self, request, context):  # noqa: N802
        return _info("decode")


@dataclass
class Setup:
    http: httpx.AsyncClient
    runtime: RouterRuntime
    app: object
    prefill: ScriptedPrefill
    decode: ScriptedDecode


@asynccontextmanager
async def _serving(tokenizer: Tokenizer, prefill: ScriptedPrefill, decode: ScriptedDecode,
                   more_decode: tuple[ScriptedDecode, ...] = (), **config) -> AsyncIterator[Setup]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, server)
    prefill_port = server.add_insecure_port("127.0.0.1:0")
    decode_servers, decode_addresses = [], []
    for servicer in (decode, *more_decode):
        decode_servers.append(grpc.aio.server())
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, decode_servers[-1])
        decode_addresses.append(f"127.0.0.1:{decode_servers[-1].add_insecure_port('127.0.0.1:0')}")
    await server.start()
    for decode_server in decode_servers:
        await decode_server.start()
    try:
        fields = {"model": "tiny", "prefill": (f"127.0.0.1:{prefill_port}",), "decode": tuple(decode_addresses),
                  "health_interval_s": 3600, "decode_failover_wait_s": 0.2, **config}
        app = create_app(RouterConfig(**fields), tokenizer_loader=lambda _: tokenizer)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=10) as http:
                yield Setup(http, app.state.runtime, app, prefill, decode)
    finally:
        await server.stop(0)
        for decode_server in decode_servers:
            await decode_server.stop(0)


def _events(body: str) -> list:
    """SSE body as decoded JSON events, with the final [DONE] kept as a string."""
    events = []
    for block in body.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _outstanding(runtime: RouterRuntime) -> list[int]:
    return [w.outstanding_requests for w in runtime.policy.workers()]


async def test_disaggregated_stream(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    # The decode stream repeats the ticket's first token, as the engine reports it.
    decode = ScriptedDecode(chunks=[ids[:3], ids[3:8], ids[8:]])
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), decode) as s:
        response = await s.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "capital of France?"}], "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, "max_tokens": 40, "logprobs": True})
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = _events(response.text)
        assert events[-1] == "[DONE]"
        chunks, usage = events[:-2], events[-2]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[1]["choices"][0]["delta"]["content"] == ANSWER[0]  # the prefill worker's token, alone
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == ANSWER
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        logprobs = [t["logprob"] for c in chunks if c["choices"][0]["logprobs"]
                    for t in c["choices"][0]["logprobs"]["content"]]
        assert logprobs == [-0.25] + [-0.5] * (len(ids) - 1)
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(ids)
        assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}

        (prefill_request,) = s.prefill.requests
        (generate,) = s.decode.requests
        assert prefill_request.reader_tp_size == 2 and prefill_request.params.temperature == 0
        assert prefill_request.reader_block_size == 16  # the digest unit divides the decode engine's blocks
        assert prefill_request.params.max_tokens == 40 and prefill_request.params.logprobs
        assert generate.HasField("ticket") and generate.ticket.first_token_id == ids[0]
        assert list(generate.prompt_token_ids) == list(prefill_request.prompt_token_ids)
        assert generate.request_id == prefill_request.request_id
        assert s.prefill.released == [] and s.decode.aborted == []  # finished cleanly: nothing to clean
        assert _outstanding(s.runtime) == [0, 0]
        metrics = (await s.http.get("/metrics")).text
        assert 'pdserve_router_routed_requests_total{route="disaggregated"} 1.0' in metrics
        assert 'pdserve_router_time_to_first_token_seconds_count{route="disaggregated"} 1.0' in metrics
        assert 'pdserve_router_e2e_request_latency_seconds_count{route="disaggregated"} 1.0' in metrics
        assert f"pdserve_router_inter_token_latency_seconds_count {len(ids) - 1}.0" in metrics


async def test_a_decode_worker_refusing_for_its_role_is_a_migration_not_a_failure(tokenizer: Tokenizer) -> None:
    """A decode worker whose role switch ended while the request's Generate was on its way refuses it
    (UNAVAILABLE marked ``ROLE_REFUSED_KEY``): the request goes on at the other decode worker, replaying
    prompt + first token, and the refusing worker is not marked failed."""
    ids = tokenizer.encode(ANSWER)
    refusals = [1]  # whichever decode worker the request is paired with refuses once
    workers = (ScriptedDecode(chunks=[ids[1:4], ids[4:]], role_refusals=refusals),
               ScriptedDecode(chunks=[ids[1:4], ids[4:]], role_refusals=refusals))
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), workers[0], workers[1:]) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "stream": True, "max_tokens": 30})
        events = _events(response.text)
        assert response.status_code == 200 and events[-1] == "[DONE]", events
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ANSWER
        refused, served = sorted((w.requests for w in workers), key=lambda r: r[0].HasField("ticket"), reverse=True)
        assert len(refused) == len(served) == 1 and refusals == [0]
        (prefill_request,) = s.prefill.requests
        assert refused[0].HasField("ticket") and not served[0].HasField("ticket")
        assert list(served[0].prompt_token_ids) == [*prefill_request.prompt_token_ids, ids[0]]
        assert served[0].num_output_tokens == 1 and served[0].params.max_tokens == 29
        assert all(w.healthy for w in s.runtime.policy.workers(Role.DECODE))
        assert s.prefill.released == [prefill_request.request_id]  # the unpulled ticket's blocks are freed
        metrics = (await s.http.get("/metrics")).text
        assert "pdserve_router_migrated_requests_total 1.0" in metrics


async def test_short_prompt_goes_straight_to_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    decode = ScriptedDecode(chunks=[ids[:5], ids[5:]])
    async with _serving(tokenizer, ScriptedPrefill(), decode, direct_decode_threshold=100) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 30})
        body = response.json()
        assert response.status_code == 200, body
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == ANSWER
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": len(ids), "total_tokens": 2 + len(ids),
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        assert s.prefill.requests == [] and not s.decode.requests[0].HasField("ticket")


async def test_prefill_failure_falls_back_to_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    prefill = ScriptedPrefill(fail_with=grpc.StatusCode.INTERNAL)
    async with _serving(tokenizer, prefill, ScriptedDecode(chunks=[ids])) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 30})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == ANSWER
        assert not s.decode.requests[0].HasField("ticket")
        assert not s.runtime.policy.has_healthy_pair() and s.runtime.policy.has_healthy_decode()
        assert prefill.aborted == [] and prefill.released == []  # a failed worker is not asked to clean up


async def test_prefill_rejecting_the_request_is_a_400(tokenizer: Tokenizer) -> None:
    prefill = ScriptedPrefill(fail_with=grpc.StatusCode.INVALID_ARGUMENT)
    async with _serving(tokenizer, prefill, ScriptedDecode()) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "stream": True})
        assert response.status_code == 400 and response.json()["error"]["message"] == "scripted failure"
        assert s.decode.requests == [] and s.runtime.policy.has_healthy_pair()


async def test_decode_failure_mid_stream_is_an_error_event(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    prefill = ScriptedPrefill(first_token_id=ids[0])
    async with _serving(tokenizer, prefill, ScriptedDecode(chunks=[ids[:4]], then="fail")) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "stream": True, "max_tokens": 30})
        events = _events(response.text)
        assert response.status_code == 200 and events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == ANSWER[:4]
        error = events[-2]["error"]
        assert error["code"] == "worker_failure" and "scripted crash" not in error["message"]  # the log has it
        assert not s.runtime.policy.has_healthy_decode()
        assert prefill.released == [s.decode.requests[0].request_id]  # its pinned blocks are freed now
        assert s.decode.aborted == [] and _outstanding(s.runtime) == [0, 0]


async def test_decode_failure_without_streaming_is_502(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]),
                        ScriptedDecode(chunks=[ids[:4]], then="fail")) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 30})
        assert response.status_code == 502 and response.json()["error"]["type"] == "server_error"


async def test_stop_string_found_by_the_router_aborts_the_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    decode = ScriptedDecode(chunks=[ids[:4], ids[4:]], then="hang")  # a worker that would not stop
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), decode) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "stop": " is", "max_tokens": 30})
        choice = response.json()["choices"][0]
        assert choice["text"] == "Paris" and choice["finish_reason"] == "stop"
        assert decode.aborted == [decode.requests[0].request_id]
        assert s.prefill.released == [decode.requests[0].request_id]


async def test_client_disconnect_aborts_and_releases(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    decode = ScriptedDecode(chunks=[ids[:4]], then="hang")
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), decode) as s:
        await _stream_until(s.app, b'{"prompt": "hello", "stream": true, "max_tokens": 30}', ANSWER[:4])
        await asyncio.wait_for(decode.cancelled.wait(), 5)  # the Generate stream was cancelled
        request_id = decode.requests[0].request_id
        assert decode.aborted == [request_id] and s.prefill.released == [request_id]
        assert _outstanding(s.runtime) == [0, 0] and s.runtime.dispatcher.num_in_flight == 0
        metrics = (await s.http.get("/metrics")).text
        assert "pdserve_router_client_disconnects_total 1.0" in metrics


async def _stream_until(app, body: bytes, text: str | None) -> str:
    """Drive the ASGI app directly: read until ``text`` has arrived (None: until the worker is asked),
    then disconnect."""
    received: list[str] = []
    gone = asyncio.Event()
    request_sent = False

    async def receive() -> dict:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if text is None:
            await asyncio.sleep(0.2)
            gone.set()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            received.append(message["body"].decode())
            so_far = "".join(e["choices"][0]["text"] for e in _events("".join(received)) if isinstance(e, dict))
            if so_far == text:
                gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("router", 80)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    assert gone.is_set(), received
    return "".join(received)


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_during_prefill_aborts_and_releases_it(tokenizer: Tokenizer, stream: bool) -> None:
    prefill = ScriptedPrefill(hang=True)
    async with _serving(tokenizer, prefill, ScriptedDecode()) as s:
        body = json.dumps({"prompt": "hello", "stream": stream}).encode()
        await _stream_until(s.app, body, None)
        request_id = prefill.requests[0].request_id
        assert prefill.aborted == [request_id] and prefill.released == [request_id]
        assert s.decode.requests == [] and _outstanding(s.runtime) == [0, 0]


async def test_unfinished_stream_end_is_a_worker_failure(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    decode = ScriptedDecode(chunks=[ids[:3]], then="end")  # ends without a finished chunk
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), decode) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 30})
        assert response.status_code == 502 and response.json()["error"]["code"] == "worker_failure"
        assert not s.runtime.policy.get(Role.DECODE, s.runtime.config.decode[0]).healthy
