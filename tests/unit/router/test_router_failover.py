"""Decode failover against scripted gRPC servicers (the router's side only; tests/faults/test_chaos.py runs it
on real workers): a broken decode stream continues at another decode worker from the prompt and the tokens
sent so far, a silent stream on a worker marked down is cut after the grace, and the bounds hold."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from services.proto_gen.pdserve.v1 import worker_pb2
from services.router.failover import DecodeWatch
from services.router.pairing import PairingPolicy, Role
from services.text.tokenizer import Tokenizer
from tests.unit.router.test_router_flow import ANSWER, ScriptedDecode, ScriptedPrefill, _events, _outstanding, _serving

pytestmark = pytest.mark.anyio


@dataclass
class BreaksFirst(ScriptedDecode):
    """Of the Generate calls on every servicer sharing ``calls``, the first streams ``chunks`` and then breaks
    (``then``: ``fail`` with ``code``, ``end`` early, or ``hang`` silent); later ones stream ``rest`` and finish."""

    rest: list[list[int]] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    calls: list[int] = field(default_factory=lambda: [0])

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        self.calls[0] += 1
        first = self.calls[0] == 1
        chunks = self.chunks if first else self.rest
        for i, token_ids in enumerate(chunks):
            last = not first and i == len(chunks) - 1
            yield worker_pb2.TokenChunk(token_ids=token_ids, logprobs=[-0.5] * len(token_ids), finished=last,
                                        finish_reason="stop" if last else "",
                                        num_prompt_tokens=len(request.prompt_token_ids))
        if not first or self.then == "end":
            return
        if self.then == "hang":
            try:
                await asyncio.Event().wait()
            finally:
                self.cancelled.set()
        await context.abort(self.code, "scripted break")


def _pair(ids: list[int], then: str = "fail", **kwargs) -> tuple[BreaksFirst, BreaksFirst]:
    """Two decode workers: whichever gets the request first streams the first token (repeated, as a ticketed
    stream starts) and two more, then breaks; the other serves the rest."""
    calls = [0]
    return tuple(BreaksFirst(chunks=[ids[:3]], rest=[ids[3:]], then=then, calls=calls, **kwargs) for _ in range(2))


def _split(workers: tuple[BreaksFirst, BreaksFirst]) -> tuple[BreaksFirst, BreaksFirst]:
    """(the worker that broke, the one that took over)."""
    broke = next(w for w in workers if w.requests and w.requests[0].HasField("ticket"))
    return broke, next(w for w in workers if w is not broke)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("then", ["fail", "end"])
async def test_a_broken_decode_stream_continues_on_another_worker(tokenizer: Tokenizer, stream: bool,
                                                                  then: str) -> None:
    ids = tokenizer.encode(ANSWER)
    workers = _pair(ids, then)
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), *workers[:1], workers[1:]) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "stream": stream, "max_tokens": 30})
        assert response.status_code == 200, response.text
        if stream:
            events = _events(response.text)
            assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events
            text = "".join(e["choices"][0]["text"] for e in events[:-1])
        else:
            text = response.json()["choices"][0]["text"]
        assert text == ANSWER  # every token once, in order, although two workers produced them
        broke, took = _split(workers)
        (prefill_request,) = s.prefill.requests
        (replay,) = took.requests
        assert not replay.HasField("ticket")
        assert list(replay.prompt_token_ids) == [*prefill_request.prompt_token_ids, *ids[:3]]
        assert replay.num_output_tokens == 3 and replay.params.max_tokens == 27
        assert not s.runtime.policy.get(Role.DECODE, s.runtime.config.decode[workers.index(broke)]).healthy
        assert s.prefill.released == [prefill_request.request_id]  # what the broken reader may not have pulled
        assert _outstanding(s.runtime) == [0, 0, 0]
        reason = "broken" if then == "fail" else "ended"
        assert f'pdserve_router_decode_failovers_total{{reason="{reason}"}} 1.0' in (await s.http.get("/metrics")).text


async def test_a_silent_stream_on_a_worker_marked_down_is_cut_after_the_grace(tokenizer: Tokenizer) -> None:
    """A blackholed link breaks nothing: the stream just stops. Once the worker is marked down (here as a failed
    health check would), the stream is cut after the grace and the request continues elsewhere."""
    ids = tokenizer.encode(ANSWER)
    workers = _pair(ids, "hang")
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), *workers[:1], workers[1:],
                        decode_failover_grace_s=0.2) as s:
        answer = asyncio.ensure_future(s.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 30}))
        while not any(w.requests for w in workers):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # its chunks are out; the stream is silent now
        broke = next(w for w in workers if w.requests)
        s.runtime.policy.mark_unhealthy(Role.DECODE, s.runtime.config.decode[workers.index(broke)], "no answer")
        response = await asyncio.wait_for(answer, 5)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == ANSWER
        await asyncio.wait_for(broke.cancelled.wait(), 5)  # the silent stream was cancelled on its worker
        assert 'pdserve_router_decode_failovers_total{reason="marked_down"} 1.0' in (await s.http.get("/metrics")).text


@pytest.mark.parametrize("bound", [{"enforce_disagg": True}, {"max_decode_failovers": 0}])
async def test_a_cut_stream_obeys_the_failover_bounds(tokenizer: Tokenizer, bound: dict) -> None:
    """The watch's cut is a break like any other: no failover under --enforce-disagg or with none left."""
    ids = tokenizer.encode(ANSWER)
    workers = _pair(ids, "hang")
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), *workers[:1], workers[1:],
                        decode_failover_grace_s=0.2, **bound) as s:
        answer = asyncio.ensure_future(s.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 30}))
        while not any(w.requests for w in workers):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        broke = next(w for w in workers if w.requests)
        s.runtime.policy.mark_unhealthy(Role.DECODE, s.runtime.config.decode[workers.index(broke)], "no answer")
        response = await asyncio.wait_for(answer, 5)
        assert response.status_code == 502 and response.json()["error"]["code"] == "worker_failure"
        assert sum(len(w.requests) for w in workers) == 1
        await asyncio.wait_for(broke.cancelled.wait(), 5)


async def test_no_failover_under_enforce_disagg(tokenizer: Tokenizer) -> None:
    """Continuing would prefill prompt and output on a decode worker, which --enforce-disagg forbids."""
    ids = tokenizer.encode(ANSWER)
    workers = _pair(ids)
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), *workers[:1], workers[1:],
                        enforce_disagg=True) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 30})
        assert response.status_code == 503 and response.json()["error"]["code"] == "worker_unavailable"
        assert sum(len(w.requests) for w in workers) == 1


async def test_failovers_are_bounded(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    workers = tuple(ScriptedDecode(chunks=[ids[:3]], then="fail") for _ in range(2))  # both break, every time
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), *workers[:1], workers[1:],
                        max_decode_failovers=1) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 30})
        assert response.status_code == 502
        assert sum(len(w.requests) for w in workers) == 2  # the first try and one failover
        assert _outstanding(s.runtime) == [0, 0, 0]


async def test_a_break_after_the_last_token_ends_the_request_without_a_failover(tokenizer: Tokenizer) -> None:
    """Every token was out: nothing is left to generate, so the request ends with ``length`` at once, though
    no other decode worker could take it on."""
    ids = tokenizer.encode(ANSWER)
    (worker,) = _pair(ids)[:1]
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), worker) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        choice = response.json()["choices"][0]
        assert response.status_code == 200 and choice["finish_reason"] == "length"
        assert choice["text"] == tokenizer.decode(ids[:3])
        assert len(worker.requests) == 1  # nothing was left to generate elsewhere
        metrics = (await s.http.get("/metrics")).text
        assert 'pdserve_router_decode_failovers_total{reason="broken"} 0.0' in metrics


@dataclass(eq=False)
class _Stream:
    last_chunk_s: float
    lost: str | None = None
    num_cuts: int = 0

    def lose_decode(self, reason: str) -> None:
        self.lost = reason
        self.num_cuts += 1


async def test_the_watch_spares_a_worker_back_within_the_grace_and_a_stream_that_delivers() -> None:
    now = [100.0]
    policy = PairingPolicy()
    policy.set_addresses(Role.DECODE, ["a", "b"])
    watch = DecodeWatch(policy, grace_s=0.05, clock=lambda: now[0])
    silent, talking, elsewhere = _Stream(90.0), _Stream(100.0), _Stream(90.0)
    watch.track(silent, "a")
    watch.track(talking, "a")
    watch.track(elsewhere, "b")
    policy.get(Role.DECODE, "b").healthy = True
    policy.mark_unhealthy(Role.DECODE, "a", "no answer within 1 s")
    await asyncio.sleep(0.1)
    assert silent.lost == "no answer within 1 s" and talking.lost is None and elsewhere.lost is None
    now[0] = 101.0  # the talking stream has been silent for a second now: looked at again, it is cut too
    await asyncio.sleep(0.1)
    assert talking.lost is not None
    assert silent.num_cuts == talking.num_cuts == 1  # a cut stream is no longer tracked: never cut twice
    policy.mark_unhealthy(Role.DECODE, "a", "still down")
    await asyncio.sleep(0.1)
    assert silent.num_cuts == talking.num_cuts == 1
    back = _Stream(90.0)
    watch.track(back, "b")
    policy.mark_unhealthy(Role.DECODE, "b", "flap")
    policy.get(Role.DECODE, "b").healthy = True  # answered its next health check within the grace
    await asyncio.sleep(0.1)
    assert back.lost is None and elsewhere.lost is None
