"""``pdserve_router_overhead_seconds{stage}`` (overhead.py) against scripted workers: every stage is observed
once per answered request, and the workers' time is in none of them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.router.overhead import STAGES
from services.text.tokenizer import Tokenizer
from tests.unit.router.test_router_flow import ANSWER, ScriptedDecode, ScriptedPrefill, _serving

pytestmark = pytest.mark.anyio
WORKER_S = 0.3  # each scripted worker answers this late: none of it is the router's


@dataclass
class SlowPrefill(ScriptedPrefill):
    async def Prefill(self, request, context):  # noqa: N802
        await asyncio.sleep(WORKER_S)
        return await super().Prefill(request, context)


@dataclass
class SlowDecode(ScriptedDecode):
    async def Generate(self, request, context):  # noqa: N802
        await asyncio.sleep(WORKER_S)
        async for chunk in super().Generate(request, context):
            yield chunk


def _stages(metrics: str) -> dict[str, tuple[float, float]]:
    """(count, sum) of each stage's series."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name != "pdserve_router_overhead_seconds":
            continue
        for sample in family.samples:
            kind = sample.name.removeprefix("pdserve_router_overhead_seconds")
            if kind in ("_count", "_sum"):
                out.setdefault(sample.labels["stage"], [0.0, 0.0])[kind == "_sum"] = sample.value
    return {stage: (count, total) for stage, (count, total) in out.items()}


async def test_a_streamed_request_observes_every_stage_once_without_the_workers_time(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    decode = SlowDecode(chunks=[ids[:3], ids[3:]])
    async with _serving(tokenizer, SlowPrefill(first_token_id=ids[0]), decode) as s:
        before = _stages((await s.http.get("/metrics")).text)
        assert set(before) == set(STAGES) and all(count == 0 for count, _ in before.values())
        response = await s.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "capital of France?"}], "stream": True, "max_tokens": 20})
        assert response.status_code == 200
        stages = _stages((await s.http.get("/metrics")).text)
    assert {stage: count for stage, (count, _) in stages.items()} == dict.fromkeys(STAGES, 1.0)
    assert all(0 <= total < WORKER_S / 2 for _, total in stages.values()), stages


async def test_a_collected_request_of_two_choices_counts_each_stage_once(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    async with _serving(tokenizer, SlowPrefill(first_token_id=ids[0]), SlowDecode(chunks=[ids])) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "capital of France?", "n": 2,
                                                              "max_tokens": 20})
        assert response.status_code == 200 and len(response.json()["choices"]) == 2
        stages = _stages((await s.http.get("/metrics")).text)
    assert {stage: count for stage, (count, _) in stages.items()} == dict.fromkeys(STAGES, 1.0)
    # Collected: the relay runs from the last delta (after both choices decoded) to the body, not from the first.
    assert stages["relay"][1] < WORKER_S / 2 and stages["pick_pair"][1] < WORKER_S / 2


async def test_a_refused_request_is_not_observed(tokenizer: Tokenizer) -> None:
    async with _serving(tokenizer, ScriptedPrefill(), ScriptedDecode()) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})
        assert response.status_code == 400
        stages = _stages((await s.http.get("/metrics")).text)
    assert all(count == 0 for count, _ in stages.values())
