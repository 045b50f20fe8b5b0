"""The router's FastAPI app: OpenAI-compatible routes over the pairing policy and the worker pool.

Everything stateful (the worker pool with its channels, the pairing table, discovery's refresh
task, the metrics registry) is made per app (``runtime.py``) and kept on ``app.state.runtime``; channels
and the refresh task live from the lifespan's start to its end. A request is validated, checked against
the served model and the context length, and tokenized before any worker is contacted, so bad
input gets a 4xx and the workers never see it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.router import overhead
from services.router.admin import ADMIN_PATHS, add_admin_routes
from services.router.answers import ChatAnswer, CompletionAnswer, answer_for
from services.router.chat_output import ChatOutput
from services.router.choices import Choice, stream_choices
from services.router.config import RouterConfig
from services.router.discovery import PairProber, Probe, Resolver, resolve
from services.router.errors import ModelNotFound, WorkerFailure, install_error_handlers, reported
from services.router.generation import Delta, GenerationRequest, Outcome
from services.router.http_guards import (
    AnswerUnexpected,
    ApiKeyAuth,
    RequestIds,
    presents_api_key,
    read_body,
    worker_request_id,
)
from services.router.kv_subscriber import KVSource
from services.router.metrics import CONTENT_TYPE, RouterMetrics
from services.router.openapi import openapi_document
from services.router.pair_probes import PairProbe, PairState
from services.router.pairing import PairingPolicy, Role, ServingStatus, WorkerState
from services.router.planner_loop import RoleSwitcher
from services.router.prompt_prep import OFF_LOOP_BYTES, PromptSetting, prepare_off_loop
from services.router.protocol import (
    AnyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    RequestT,
    decode_request,
    to_sampling_params,
)
from services.router.responses import (
    ChatCompletionChunk,
    CompletionChunk,
    ModelCard,
    ModelList,
    Usage,
    join_deltas,
    usage_of,
)
from services.router.responses_answer import ResponsesAnswer
from services.router.responses_request import ResponsesRequest, decode_responses_request
from services.router.routes import ROUTE_HEADER, Route, worst_route
from services.router.runtime import RouterRuntime, build_runtime
from services.router.streaming import SSEResponse, run_until_disconnect, sse_event
from services.router.tokenize_api import DetokenizeRequest, TokenizeRequest, decode_body, detokenize, tokenize
from services.router.tokenizing import echo_texts, load_tokenizer
from services.router.worker_labels import WorkerLabels
from services.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
ChunkT = TypeVar("ChunkT", CompletionChunk, ChatCompletionChunk)

_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
              "/detokenize", *ADMIN_PATHS)
# Status reported for a request whose client went away (nginx's convention); nobody reads it.
_CLIENT_CLOSED = 499


def create_app(
    config: RouterConfig,
    *,
    tokenizer_loader: Callable[[str | None], Tokenizer | None] = load_tokenizer,
    probe: Probe | None = None,
    resolver: Resolver = resolve,
    pair_prober: PairProber | None = None,
    kv_source: KVSource | None = None,
    role_switcher: RoleSwitcher | None = None,
) -> FastAPI:
    """The router app. The tokenizer is loaded now (a bad ``--model`` fails before serving).

    ``probe`` (default: the worker's ``Info`` RPC through the pool), ``resolver`` (default: the
    system resolver), ``pair_prober`` (default: the decode worker's ``Probe`` RPC through the pool) and
    ``kv_source`` (default: the workers' ``KVEvents``/``KVSnapshot`` through the pool) are the seams
    discovery is tested through. ``role_switcher``: what the P:D planner calls to switch a worker's role
    under ``--role-planner`` (default: the router's own in-place switch, ``role_switch.py``).
    """
    tokenizer = tokenizer_loader(config.model)
    if config.enforce_disagg and config.direct_decode_threshold:
        log.warning("--enforce-disagg: --direct-decode-threshold %d is ignored; short prompts are disaggregated too",
                    config.direct_decode_threshold)
    runtime = build_runtime(config, tokenizer, probe=probe, resolver=resolver, pair_prober=pair_prober,
                            kv_source=kv_source, role_switcher=role_switcher)
    app = FastAPI(title="pdserve router", lifespan=runtime.lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.runtime = runtime
    install_error_handlers(app)
    _add_middleware(app, config, runtime.metrics)
    _add_routes(app)
    add_admin_routes(app)
    return app


def _add_middleware(app: FastAPI, config: RouterConfig, metrics: RouterMetrics) -> None:
    """The last added runs first: every response (a 401 or 500 too) is counted and carries its request id."""
    app.add_middleware(AnswerUnexpected)
    if config.api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=config.api_key)
    app.add_middleware(_CountRequests, metrics=metrics)
    app.add_middleware(RequestIds)
    app.add_middleware(overhead.TimeStages, histogram=metrics.router_overhead)  # outermost: relay ends at the server


def _runtime(request: Request) -> RouterRuntime:
    return request.app.state.runtime


def _add_routes(app: FastAPI) -> None:
    """Every route but the admin API's (``admin.py``)."""
    _add_generation_routes(app)
    _add_status_routes(app)
    _add_tokenizer_routes(app)
    _add_docs_routes(app)


def _add_generation_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, ChatCompletionRequest)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _responses(request)


def _add_status_routes(app: FastAPI) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        rt = _runtime(request)
        card = ModelCard(rt.model_name, rt.created, max_model_len=rt.max_model_len() or msgspec.UNSET)
        return _json(ModelList([card]))

    @app.get("/health")
    async def health(request: Request) -> Response:
        return _health(_runtime(request), request)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_runtime(request).metrics.render(), media_type=CONTENT_TYPE)


def _health(rt: RouterRuntime, request: Request) -> Response:
    """200 while requests can be served (``degraded``: only by decode workers prefilling locally, which
    the body says), 503 only when nothing can (under --enforce-disagg: no pair). With --api-key, a caller
    without the key reads the status alone (probes need no more); with the key, or with no --api-key, the
    body names why, every worker's state, and every compatible pair's probe state."""
    status = rt.status()
    code = 503 if status == ServingStatus.UNAVAILABLE else 200
    if not presents_api_key(request.scope, rt.config.api_key):
        return _json({"status": status.value}, status_code=code)
    counts = {role.value: sum(w.available for w in rt.policy.workers(role)) for role in Role}
    body: dict[str, object] = {"status": status.value, "healthy_workers": counts,
                               "decode_only": rt.config.decode_only}
    if status == ServingStatus.DEGRADED:
        body["reason"] = f"{rt.policy.no_pair_reason()}: decode workers prefill every prompt themselves"
    elif status == ServingStatus.UNAVAILABLE and rt.policy.has_healthy_decode():
        body["reason"] = (f"--enforce-disagg: {rt.policy.no_pair_reason()}, and decode workers may not "
                          "prefill prompts themselves")
    body["workers"] = [_worker_health(rt.policy, w, rt.worker_labels) for w in rt.policy.workers()]
    if rt.policy.probes is not None:
        body["pairs"] = [_pair_health(entry) for entry in rt.policy.probes.pairs()]
    return _json(body, status_code=code)


def _add_tokenizer_routes(app: FastAPI) -> None:
    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        rt = _runtime(request)
        body = decode_body(await read_body(request, rt.config.max_request_bytes), TokenizeRequest)
        _check_model(body.model, rt)
        return _json(tokenize(body, rt.tokenizer, rt.max_model_len()))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        rt = _runtime(request)
        body = decode_body(await read_body(request, rt.config.max_request_bytes), DetokenizeRequest)
        _check_model(body.model, rt)
        return _json(detokenize(body, rt.tokenizer))


def _add_docs_routes(app: FastAPI) -> None:
    document = msgspec.json.encode(openapi_document(app.title))

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return Response(document, media_type="application/json")

    @app.get("/docs")
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title}: API")


def _worker_health(policy: PairingPolicy, worker: WorkerState, labels: WorkerLabels) -> dict[str, object]:
    """One worker on ``/health``: what it last reported and, if it can pair with nobody, why not; ``worker`` is
    its id on /metrics."""
    identity = worker.identity
    entry: dict[str, object] = {
        "address": worker.address,
        "worker": labels(worker.address),
        "role": worker.role.value,
        "state": policy.worker_state(worker),
        "healthy": worker.healthy,
        "draining": bool(identity and identity.draining),
        "engine_id": identity.engine_id if identity else None,
        "tp_size": identity.tp_size if identity else None,
        "block_size": identity.block_size if identity else None,
        "last_error": worker.last_error,
    }
    reason = policy.unpaired_reason(worker)
    if reason is not None:
        entry["unpaired_reason"] = reason
    return entry


def _pair_health(entry: PairProbe) -> dict[str, object]:
    """One compatible pair of available workers on ``/health``: its probe state and, failed, why."""
    pair: dict[str, object] = {"prefill": entry.prefill, "decode": entry.decode, "state": entry.state.value}
    if entry.state is PairState.FAILED:
        pair["reason"] = entry.reason
    if entry.unprobed:
        pair["unprobed"] = True  # the decode worker predates the Probe RPC
    return pair


def _json(payload: object, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status_code, media_type="application/json",
                    headers=headers)


def _route_header(outcomes: _Outcomes) -> dict[str, str] | None:
    """``x-pdserve-route`` with the response's route as known now (exact once every choice ended)."""
    route = outcomes.route()
    return {ROUTE_HEADER: route.value} if route is not None else None


async def _generate(request: Request, kind: type[RequestT]) -> Response:
    """Validate, tokenize, then run the request's choices over worker pairs, streamed or collected."""
    arrival_s = time.monotonic()
    rt = _runtime(request)
    raw = await read_body(request, rt.config.max_request_bytes)
    body = decode_request(raw, kind)
    overhead.mark("decode")
    return await _serve(request, rt, body, arrival_s, len(raw))


async def _responses(request: Request) -> Response:
    """``/v1/responses``: the chat request it amounts to, answered in the Responses shapes."""
    arrival_s = time.monotonic()
    rt = _runtime(request)
    raw = await read_body(request, rt.config.max_request_bytes)
    responses = decode_responses_request(raw)
    overhead.mark("decode")
    return await _serve(request, rt, responses.to_chat(), arrival_s, len(raw), responses)


def _prompt_setting(rt: RouterRuntime, body_bytes: int) -> PromptSetting:
    key_specs = frozenset(rt.policy.prompt_key_specs()) if body_bytes >= OFF_LOOP_BYTES else frozenset()
    return PromptSetting(rt.tokenizer, rt.chat_formats, rt.vocab_size, rt.max_model_len(), key_specs)


async def _serve(request: Request, rt: RouterRuntime, body: AnyRequest, arrival_s: float, body_bytes: int,
                 responses: ResponsesRequest | None = None) -> Response:
    _check_model(body.model, rt)
    prepared = await prepare_off_loop(body, _prompt_setting(rt, body_bytes), body_bytes)
    plan, prompts, max_tokens = prepared.plan, prepared.token_ids, prepared.max_tokens
    overhead.mark("tokenize")
    prefix = "resp" if responses is not None else "chatcmpl" if plan is not None else "cmpl"
    request_id = worker_request_id(request, prefix)
    prompt_outcomes = [Outcome(num_prompt_tokens=len(ids)) for ids in prompts]
    choices = []
    per_prompt = body.num_candidates
    for p, ids in enumerate(prompts):
        for i in range(per_prompt):
            index = p * per_prompt + i
            choice_id = request_id if len(prompts) * per_prompt == 1 else f"{request_id}-{index}"
            params = to_sampling_params(body, max_tokens[p], index, plan.grammar if plan else None)
            generation = GenerationRequest(choice_id, ids, params, arrival_s, bool(plan and plan.keep_special_tokens),
                                           prepared.keys[p])
            outcome = prompt_outcomes[p] if i == 0 else Outcome(num_prompt_tokens=len(ids))
            choices.append(Choice(index, p, generation, outcome))
    echo = echo_texts(body, prompts, rt.tokenizer) if isinstance(body, CompletionRequest) and body.echo else None
    answer = ResponsesAnswer(request_id, rt.model_name, responses, plan.new_output) if responses is not None \
        and plan is not None else answer_for(request_id, rt.model_name, body, rt.tokenizer, prompts, echo,
                                             plan.new_output if plan is not None else ChatOutput)
    outcomes = _Outcomes(prompt_outcomes, [c.outcome for c in choices])
    deltas = stream_choices(rt.dispatcher, choices)
    if body.stream:
        # Wait for the first token before answering, so failures up to there get their HTTP status. The
        # route header leaves with it: the route as known then (the final one is on the last chunk).
        first, gone = await run_until_disconnect(request.receive, _first(deltas))
        if gone:
            rt.metrics.client_disconnects.inc()
            return Response(status_code=_CLIENT_CLOSED)
        return SSEResponse(_events(first, deltas, answer, outcomes, len(choices), rt, request.state.request_id),
                           _route_header(outcomes))
    collected, gone = await run_until_disconnect(request.receive, _collect(deltas))
    if gone:
        rt.metrics.client_disconnects.inc()
        return Response(status_code=_CLIENT_CLOSED)
    joined = {index: join_deltas(parts) for index, parts in collected.items()}
    if per_prompt > body.n:
        joined = best_of(joined, len(prompts), per_prompt, body.n)
    return _json(answer.full(joined, outcomes.usage()), headers=_route_header(outcomes))


def best_of(candidates: dict[int, Delta], num_prompts: int, per_prompt: int, n: int) -> dict[int, Delta]:
    """Per prompt, the ``n`` candidates with the highest mean token logprob (OpenAI's "best"), numbered
    ``prompt * n + rank``; ties keep the earlier candidate."""
    def score(delta: Delta) -> float:
        return sum(delta.logprobs) / len(delta.logprobs) if delta.logprobs else -math.inf

    chosen: dict[int, Delta] = {}
    for p in range(num_prompts):
        ranked = sorted(range(p * per_prompt, (p + 1) * per_prompt), key=lambda i: -score(candidates[i]))
        for rank, i in enumerate(ranked[:n]):
            chosen[p * n + rank] = candidates[i]
    return chosen


@dataclass(frozen=True)
class _Outcomes:
    """Where a request's usage and route are read from (final once its choices are done)."""

    prompts: list[Outcome]
    choices: list[Outcome]

    def usage(self) -> Usage:
        return usage_of(self.prompts, self.choices)

    def route(self) -> Route | None:
        """The worst of the choices' routes known so far (routes.py)."""
        return worst_route(o.route for o in self.choices)


def _with_route(chunk: ChunkT, route: Route | None) -> ChunkT:
    """The stream's last chunk, carrying the final route as a top-level ``pdserve_route``."""
    return msgspec.structs.replace(chunk, pdserve_route=route.value) if route is not None else chunk


def _check_model(model: str | None, rt: RouterRuntime) -> None:
    if model is not None and model != rt.model_name:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")


async def _first(deltas: AsyncIterator[tuple[int, Delta]]) -> tuple[int, Delta]:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        raise WorkerFailure("the request ended without a token") from None


async def _collect(deltas: AsyncIterator[tuple[int, Delta]]) -> dict[int, list[Delta]]:
    collected: dict[int, list[Delta]] = {}
    async for index, delta in deltas:
        collected.setdefault(index, []).append(delta)
    return collected


async def _events(first: tuple[int, Delta], deltas: AsyncIterator[tuple[int, Delta]],
                  answer: CompletionAnswer | ChatAnswer | ResponsesAnswer, outcomes: _Outcomes, num_choices: int,
                  rt: RouterRuntime, request_id: str) -> AsyncIterator[bytes]:
    """SSE: chunks, the usage chunk if asked for, [DONE]; a failure mid-stream is an error event (the client's
    body; the full message is logged with ``request_id``). The last chunk before [DONE] carries the final route
    (``pdserve_route``)."""
    try:
        index, delta = first
        unfinished = num_choices
        while True:
            chunks = answer.chunks(index, delta)
            if chunks and delta.finish_reason is not None and unfinished == 1 and not answer.include_usage:
                chunks[-1] = _with_route(chunks[-1], outcomes.route())
            for chunk in chunks:
                yield answer.sse(chunk)
            if delta.finish_reason is not None:
                unfinished -= 1
                if not unfinished:
                    break
            index, delta = await anext(deltas)
        if answer.include_usage:
            yield answer.sse(_with_route(answer.usage_chunk(outcomes.usage()), outcomes.route()))
    except StopAsyncIteration:
        yield sse_event(reported(WorkerFailure("the stream ended before the request finished"), request_id).body())
    except Exception as exc:  # the headers are out: report it in the stream, in the same error format
        yield sse_event(reported(exc, request_id).body())
    except (asyncio.CancelledError, GeneratorExit):
        rt.metrics.client_disconnects.inc()
        raise
    finally:
        await deltas.aclose()  # runs the flows' clean-up now if they did not finish
    if answer.done_event:
        yield answer.done_event


class _CountRequests:
    """Pure ASGI middleware counting responses by endpoint and status (streaming-safe)."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
