"""Strict disaggregation (``--enforce-disagg``) and the route every response reports, on the router's side.

The pure parts directly (the flag and its environment variable, the config's rules, ``pdserve up``
passing the flag on, the route ranking, the gRPC status mapping, serving status); the flow against
the scripted servicers of ``test_router_flow`` (NOT an end-to-end test: real workers are in
``tests/e2e/test_enforce_disagg.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import grpc
import pytest

from services.cli import build_parser
from services.launch.up import up_router_argv
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.router.app import create_app
from services.router.cli_args import add_router_parser, router_config_from_args
from services.router.config import RouterConfig
from services.router.errors import DisaggregationFailed, InvalidRequest, from_rpc_error
from services.router.pairing import PairingPolicy, Role, ServingStatus, WorkerIdentity
from services.router.routes import ROUTE_HEADER, Route, worst_route
from services.text.tokenizer import Tokenizer
from tests.unit.router.test_router_flow import ANSWER, ScriptedPrefill, _events, _info, _serving

pytestmark = pytest.mark.anyio


# ---- pure: config, flags, routes, status mapping ---------------------------------------------------


def _router_args(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["router", "--prefill", "p:1", "--decode", "d:1", *argv])


def test_enforce_disagg_is_off_by_default_and_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_ENFORCE_DISAGG", raising=False)
    assert not router_config_from_args(_router_args([])).enforce_disagg
    assert router_config_from_args(_router_args(["--enforce-disagg"])).enforce_disagg


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("ON", True), ("0", False),
                                                 ("no", False), ("", False)])
def test_enforce_disagg_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("PDSERVE_ENFORCE_DISAGG", value)
    assert router_config_from_args(_router_args([])).enforce_disagg is expected
    assert router_config_from_args(_router_args(["--enforce-disagg"])).enforce_disagg  # the flag still turns it on


def test_a_bad_environment_value_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_ENFORCE_DISAGG", "maybe")
    with pytest.raises(SystemExit) as exited:
        _router_args([])
    assert exited.value.code == 2


def test_strict_config_needs_prefill_workers_and_ignores_the_direct_threshold() -> None:
    with pytest.raises(ValueError, match="--enforce-disagg needs prefill workers"):
        RouterConfig(decode=("d:1",), enforce_disagg=True)
    strict = RouterConfig(prefill=("p:1",), decode=("d:1",), direct_decode_threshold=32, enforce_disagg=True)
    assert strict.pairing_threshold == 0
    assert RouterConfig(prefill=("p:1",), decode=("d:1",), direct_decode_threshold=32).pairing_threshold == 32
    assert RouterConfig(prefill_dns=("p:1",), decode=("d:1",), enforce_disagg=True).enforce_disagg


def test_a_strict_router_says_once_that_it_ignores_the_direct_threshold(tokenizer: Tokenizer,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="services.router.app"):
        app = create_app(RouterConfig(prefill=("p:1",), decode=("d:1",), direct_decode_threshold=16,
                                      enforce_disagg=True), tokenizer_loader=lambda _: tokenizer)
        create_app(RouterConfig(prefill=("p:1",), decode=("d:1",), enforce_disagg=True),
                   tokenizer_loader=lambda _: tokenizer)
    (record,) = [r for r in caplog.records if "--direct-decode-threshold" in r.getMessage()]
    assert "16 is ignored" in record.getMessage()
    assert app.state.runtime.policy.direct_decode_threshold == 0


def test_up_passes_enforce_disagg_to_its_router() -> None:
    parser = build_parser()
    assert "--enforce-disagg" in up_router_argv(parser.parse_args(["up", "--enforce-disagg"]))
    assert up_router_argv(parser.parse_args(["up"])) == []
    both = up_router_argv(parser.parse_args(["up", "--served-model-name", "m", "--enforce-disagg"]))
    assert both == ["--served-model-name", "m", "--enforce-disagg"]


def test_a_response_reports_the_worst_route_of_its_choices() -> None:
    assert worst_route(["disaggregated", "disaggregated"]) is Route.DISAGGREGATED
    assert worst_route(["disaggregated", "direct"]) is Route.DIRECT
    assert worst_route(["direct", "fallback", "disaggregated"]) is Route.FALLBACK
    assert worst_route(["", "disaggregated"]) is Route.DISAGGREGATED  # a choice not routed yet is skipped
    assert worst_route(["", ""]) is None and worst_route([]) is None


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_failed_precondition_is_a_502_only_when_the_pull_was_required() -> None:
    refused = _rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "the KV pull is required and could not be done: x")
    error = from_rpc_error(refused, "decode", "d:1", pull_required=True)
    assert isinstance(error, DisaggregationFailed) and error.status_code == 502
    assert error.body().error.code == "disaggregation_failed" and "could not be done: x" in error.message
    assert isinstance(from_rpc_error(refused, "decode", "d:1"), InvalidRequest)  # as before: a 400
    other = from_rpc_error(_rpc_error(grpc.StatusCode.INTERNAL, "boom"), "decode", "d:1", pull_required=True)
    assert other.status_code == 502 and not isinstance(other, DisaggregationFailed)


def test_a_strict_router_without_a_pair_is_unavailable_not_degraded() -> None:
    for strict, expected in ((False, ServingStatus.DEGRADED), (True, ServingStatus.UNAVAILABLE)):
        policy = PairingPolicy(enforce_disagg=strict)
        policy.set_addresses(Role.DECODE, ["d:1"])
        policy.mark_healthy(Role.DECODE, "d:1", WorkerIdentity("decode-0", "decode", "h"))
        assert policy.serving_status() is expected
        policy.set_addresses(Role.PREFILL, ["p:1"])
        policy.mark_healthy(Role.PREFILL, "p:1", WorkerIdentity("prefill-0", "prefill", "h"))
        assert policy.serving_status() is ServingStatus.OK


# ---- the flow against scripted workers ----------------------------------------------------------------


@dataclass
class ScriptedDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Generates ``tokens`` (with a ticket, the first is the ticket's, repeated); ``pull_fails``: each
    ticketed request whose id ends with ``only`` (default: all) recomputes the prompt, or with
    ``require_pull`` is refused as a real decode worker refuses it (unless ``older``: a worker that
    predates the field and recomputes anyway)."""

    tokens: list[int]
    pull_fails: bool = False
    only: str = ""
    older: bool = False
    requests: list = field(default_factory=list)
    aborted: list = field(default_factory=list)

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        failed = self.pull_fails and request.HasField("ticket") and request.request_id.endswith(self.only)
        if failed and request.require_pull and not self.older:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the KV pull is required and could not be done: scripted handshake refusal")
        parts = [self.tokens[:1], self.tokens[1:]] if request.HasField("ticket") else [self.tokens]
        for i, ids in enumerate(parts):
            last = i == len(parts) - 1
            yield worker_pb2.TokenChunk(token_ids=ids, logprobs=[-0.5] * len(ids), finished=last,
                                        finish_reason="stop" if last else "", recomputed_locally=failed,
                                        num_prompt_tokens=len(request.prompt_token_ids))

    async def Abort(self, request, context):  # noqa: N802
        self.aborted.append(request.request_id)
        return worker_pb2.AbortResponse(aborted=True)

    async def Info(self, request, context):  # noqa: N802
        return _info("decode")


def _routed(metrics: str) -> dict[str, float]:
    return {route.value: float(line.rsplit(" ", 1)[1]) for route in Route for line in metrics.splitlines()
            if line.startswith(f'pdserve_router_routed_requests_total{{route="{route.value}"}}')}


def _text(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


async def test_every_response_carries_its_route(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), ScriptedDecode(ids),
                        direct_decode_threshold=3) as s:
        long = await s.http.post("/v1/completions", json={"prompt": "the capital of France", "max_tokens": 30})
        assert long.status_code == 200 and long.headers[ROUTE_HEADER] == "disaggregated"
        assert "pdserve_route" not in long.json()  # a plain OpenAI body: the header says it
        short = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 30})  # 2 tokens
        assert short.status_code == 200 and short.headers[ROUTE_HEADER] == "direct"
        chat = await s.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "the capital of France"}], "max_tokens": 30, "stream": True})
        chat_events = _events(chat.text)
        assert chat.headers[ROUTE_HEADER] == "disaggregated"
        assert chat_events[-2]["choices"][0]["finish_reason"] == "stop"
        assert chat_events[-2]["pdserve_route"] == "disaggregated"
        streamed = await s.http.post("/v1/completions", json={"prompt": "the capital of France", "stream": True})
        events = _events(streamed.text)
        assert streamed.headers[ROUTE_HEADER] == "disaggregated" and _text(events) == ANSWER
        assert [e.get("pdserve_route") for e in events[:-1]] == [None] * (len(events) - 2) + ["disaggregated"]
        assert _routed((await s.http.get("/metrics")).text) == {"disaggregated": 3, "direct": 1, "fallback": 0}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_side_recompute_is_reported_as_fallback(tokenizer: Tokenizer, stream: bool) -> None:
    ids = tokenizer.encode(ANSWER)
    prefill = ScriptedPrefill(first_token_id=ids[0])
    async with _serving(tokenizer, prefill, ScriptedDecode(ids, pull_fails=True)) as s:
        response = await s.http.post("/v1/completions", json={
            "prompt": "the capital of France", "max_tokens": 30, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None})
        assert response.status_code == 200
        assert not s.decode.requests[0].require_pull  # not strict: the worker may recompute
        if stream:
            # The header left with the first token, before the pull failed; the last chunk says how it ended.
            events = _events(response.text)
            assert response.headers[ROUTE_HEADER] == "disaggregated" and _text(events) == ANSWER
            assert events[-2]["choices"] == [] and events[-2]["pdserve_route"] == "fallback"  # the usage chunk
            assert all("pdserve_route" not in e for e in events[:-2])
        else:
            assert response.headers[ROUTE_HEADER] == "fallback" and response.json()["choices"][0]["text"] == ANSWER
        assert _routed((await s.http.get("/metrics")).text) == {"disaggregated": 0, "direct": 0, "fallback": 1}
        # The decode worker recomputed: nobody will read the ticket (or the parts after a failed one), so the
        # prefill worker frees its blocks now, not at the lease.
        assert prefill.released == [s.decode.requests[0].request_id]


async def test_one_route_per_response_the_worst_of_its_choices(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    decode = ScriptedDecode(ids, pull_fails=True, only="-1")  # choice 1's pull fails, choice 0's does not
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), decode) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "the capital of France", "n": 2})
        assert response.status_code == 200 and response.headers[ROUTE_HEADER] == "fallback"
        assert len(response.json()["choices"]) == 2
        # The metric and the log line count each choice's own route.
        assert _routed((await s.http.get("/metrics")).text) == {"disaggregated": 1, "direct": 0, "fallback": 1}


async def test_strict_without_a_prefill_worker_is_503_and_the_decode_worker_is_not_asked(
        tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    async with _serving(tokenizer, ScriptedPrefill(), ScriptedDecode(ids), enforce_disagg=True,
                        direct_decode_threshold=1000) as s:
        prefill_address = s.runtime.config.prefill[0]
        short = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert short.status_code == 200 and short.headers[ROUTE_HEADER] == "disaggregated"  # no short-prompt bypass
        s.runtime.policy.mark_unhealthy(Role.PREFILL, prefill_address, "test: gone")
        health = await s.http.get("/health")
        assert health.status_code == 503 and "--enforce-disagg" in health.json()["reason"]
        for stream in (False, True):
            response = await s.http.post("/v1/completions", json={"prompt": "hello", "stream": stream})
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert ROUTE_HEADER not in response.headers
            error = response.json()["error"]
            assert error["code"] == "disaggregation_unavailable" and error["type"] == "service_unavailable"
            assert "no healthy prefill worker" in error["message"]
        assert len(s.decode.requests) == 1  # only the served request reached it
        assert [w.outstanding_requests for w in s.runtime.policy.workers()] == [0, 0]
        assert _routed((await s.http.get("/metrics")).text) == {"disaggregated": 1, "direct": 0, "fallback": 0}


def _logged_answer(caplog: pytest.LogCaptureFixture, request_id: str) -> str:
    """The router's log line about the error it answered ``request_id`` with (the message the client did not get)."""
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"request {request_id} answered")]
    return line


async def test_strict_with_a_failed_prefill_is_502_without_decoding(tokenizer: Tokenizer,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    prefill = ScriptedPrefill(fail_with=grpc.StatusCode.INTERNAL)
    async with _serving(tokenizer, prefill, ScriptedDecode([1, 2]), enforce_disagg=True) as s:
        with caplog.at_level(logging.WARNING, logger="services.router.errors"):
            response = await s.http.post("/v1/completions", json={"prompt": "hello"}, headers={"X-Request-Id": "p1"})
        error = response.json()["error"]
        assert response.status_code == 502 and error["code"] == "disaggregation_failed"
        # The client reads the kind; the worker, its address and its gRPC status are in the router's log.
        prefill_address = s.runtime.config.prefill[0]
        assert "scripted failure" not in response.text and prefill_address not in response.text
        assert "--enforce-disagg" in error["message"] and s.decode.requests == []
        assert f"{prefill_address} failed (INTERNAL: scripted failure)" in _logged_answer(caplog, "p1")
        assert not s.runtime.policy.has_healthy_pair()  # the broken prefill worker is out of rotation


async def test_strict_with_a_failed_pull_is_502(tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    ids = tokenizer.encode(ANSWER)
    prefill = ScriptedPrefill(first_token_id=ids[0])
    async with _serving(tokenizer, prefill, ScriptedDecode(ids, pull_fails=True), enforce_disagg=True) as s:
        with caplog.at_level(logging.WARNING, logger="services.router.errors"):
            response = await s.http.post("/v1/completions", json={"prompt": "the capital of France", "max_tokens": 30},
                                         headers={"X-Request-Id": "p2"})
        error = response.json()["error"]
        assert response.status_code == 502 and error["code"] == "disaggregation_failed", error
        assert "scripted handshake refusal" not in response.text and ROUTE_HEADER not in response.headers
        assert "scripted handshake refusal" in _logged_answer(caplog, "p2")
        (generate,) = s.decode.requests
        assert generate.require_pull and generate.HasField("ticket")
        assert prefill.released == [generate.request_id]  # its pinned blocks are freed at once
        assert s.runtime.policy.has_healthy_pair()  # nobody is broken: the pull could not be done
        assert _routed((await s.http.get("/metrics")).text) == {"disaggregated": 0, "direct": 0, "fallback": 0}


@pytest.mark.parametrize("older_worker", [False, True], ids=["refused", "recomputed-anyway"])
async def test_strict_stream_whose_pull_fails_ends_with_an_error_event(tokenizer: Tokenizer,
                                                                        older_worker: bool) -> None:
    """The first token is out when the pull fails: the stream ends with an error event and [DONE], never
    with recomputed tokens. A decode worker that predates require_pull recomputes anyway: the router
    refuses its tokens the same way."""
    ids = tokenizer.encode(ANSWER)
    decode = ScriptedDecode(ids, pull_fails=True, older=older_worker)
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), decode, enforce_disagg=True) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "the capital of France", "stream": True,
                                                              "stream_options": {"include_usage": True}})
        assert response.status_code == 200 and response.headers[ROUTE_HEADER] == "disaggregated"
        events = _events(response.text)
        assert events[-1] == "[DONE]" and _text(events[:-2]) == tokenizer.decode(ids[:1])  # the first token only
        error = events[-2]["error"]
        assert error["code"] == "disaggregation_failed" and error["type"] == "server_error"
        assert all("usage" not in e or e["usage"] is None for e in events[:-2])  # no usage chunk: it failed
        assert json.dumps(events).count("pdserve_route") == 0
