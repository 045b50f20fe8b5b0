"""The operator API (``/admin/workers``, ``/admin/planner``): refused without the API key, closed when the router
has none (unless ``--admin-without-api-key``), and what it lists. Workers come from an injected health probe."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from services.router.app import create_app
from services.router.config import RouterConfig
from services.router.pair_probes import ProbeOutcome
from services.router.pairing import Role, WorkerIdentity
from services.router.runtime import RouterRuntime
from services.router.traffic import FinishedRequest
from services.router.worker_labels import WorkerLabels
from services.text.tokenizer import Tokenizer
from tests.unit.router._kv_fakes import SilentKVSource

pytestmark = pytest.mark.anyio

PREFILL, DECODE = "127.0.0.1:2", "127.0.0.1:1"
KEY = "sk-admin-test"


async def _probe(role: Role, address: str) -> WorkerIdentity:
    return WorkerIdentity(engine_id=f"{role}-0", role=role.value, compat_hash="h", max_model_len=64, epoch=7)


async def _pair_prober(prefill: str, decode: str, timeout_s: float) -> ProbeOutcome:
    return ProbeOutcome(True, "", seconds=0.01)


@asynccontextmanager
async def _router(model_dir: Path, tokenizer: Tokenizer,
                  **config: object) -> AsyncIterator[tuple[httpx.AsyncClient, RouterRuntime]]:
    fields = {"model": str(model_dir), "prefill": (PREFILL,), "decode": (DECODE,), "health_interval_s": 3600,
              "planner_interval_s": 3600, **config}
    app = create_app(RouterConfig(**fields), tokenizer_loader=lambda _: tokenizer, probe=_probe,
                     pair_prober=_pair_prober, kv_source=SilentKVSource())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://r") as http:
        yield http, app.state.runtime


@pytest.mark.parametrize("path", ["/admin/workers", "/admin/planner"])
async def test_refused_without_the_api_key(model_dir: Path, tokenizer: Tokenizer, path: str):
    async with _router(model_dir, tokenizer, api_key=KEY) as (http, _):
        missing = await http.get(path)
        wrong = await http.get(path, headers={"Authorization": "Bearer nope"})
        right = await http.get(path, headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 401 and wrong.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert right.status_code == 200, right.text


@pytest.mark.parametrize("path", ["/admin/workers", "/admin/planner"])
async def test_closed_when_the_router_has_no_api_key(model_dir: Path, tokenizer: Tokenizer, path: str):
    async with _router(model_dir, tokenizer) as (http, _):
        response = await http.get(path)
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "admin_disabled" and "--api-key" in error["message"]


async def test_open_without_a_key_only_when_asked(model_dir: Path, tokenizer: Tokenizer):
    async with _router(model_dir, tokenizer, admin_without_api_key=True) as (http, _):
        assert (await http.get("/admin/workers")).status_code == 200


async def test_lists_every_worker_with_role_state_epoch_and_load(model_dir: Path, tokenizer: Tokenizer):
    async with _router(model_dir, tokenizer, api_key=KEY) as (http, runtime):
        served = FinishedRequest(runtime.planner.clock(), 100, 11, DECODE, 0.5, num_decode_gaps=10)
        runtime.dispatcher.traffic.record(served)
        runtime.planner.evaluate()
        body = (await http.get("/admin/workers", headers={"Authorization": f"Bearer {KEY}"})).json()
    assert body["role_planner"] is False
    workers = {w["address"]: w for w in body["workers"]}
    assert set(workers) == {PREFILL, DECODE}
    decode = workers[DECODE]
    assert (decode["role"], decode["engine_id"], decode["epoch"]) == ("decode", "decode-0", 7)
    assert decode["worker"] == WorkerLabels(KEY)(DECODE)  # its id on /metrics
    assert decode["state"] == "healthy"
    assert decode["healthy"] is True and decode["draining"] is False
    assert decode["router"] == {"outstanding_requests": 0, "outstanding_prompt_tokens": 0, "queued_prefill_tokens": 0}
    assert decode["load"] is None  # no KV event batch carried one yet
    assert decode["kv_index"]["state"] == "unknown"
    assert decode["decode"]["itl_ms"] == pytest.approx(50.0)
    assert workers[PREFILL]["role"] == "prefill" and workers[PREFILL]["decode"] is None


async def test_planner_shows_the_last_decision_with_its_inputs(model_dir: Path, tokenizer: Tokenizer):
    async with _router(model_dir, tokenizer, api_key=KEY, planner_slo_ttft_ms=1500.0) as (http, runtime):
        served = FinishedRequest(runtime.planner.clock(), 100, 11, DECODE, 0.5, num_decode_gaps=10)
        runtime.dispatcher.traffic.record(served)
        runtime.planner.evaluate()
        body = (await http.get("/admin/planner", headers={"Authorization": f"Bearer {KEY}"})).json()
        metrics = (await http.get("/metrics")).text
    assert body["mode"] == "advisory" and body["switch_in_progress"] is False
    assert body["config"]["slo_ttft_ms"] == 1500.0
    decision = body["decision"]
    assert decision["current"] == {"prefill": 1, "decode": 1}
    assert decision["reason"] == "balanced"  # one worker per role cannot be split otherwise
    assert decision["inputs"]["mean_prompt_tokens"] == 100.0
    assert 'pdserve_planner_desired_workers{role="prefill"} 1.0' in metrics
    assert 'pdserve_planner_decisions_total{reason="balanced"}' in metrics


async def test_served_requests_feed_the_planner(tokenizer: Tokenizer):
    """A request through the real flow (scripted workers) is in the planner's inputs and the worker's measured
    decode rate."""
    from tests.unit.router.test_router_flow import ANSWER, ScriptedDecode, ScriptedPrefill, _serving

    ids = tokenizer.encode(ANSWER)
    decode = ScriptedDecode(chunks=[ids[:3], ids[3:8], ids[8:]])
    async with _serving(tokenizer, ScriptedPrefill(first_token_id=ids[0]), decode, admin_without_api_key=True) as s:
        response = await s.http.post("/v1/completions", json={"prompt": "capital of France?", "max_tokens": 40})
        assert response.status_code == 200, response.text
        num_prompt = response.json()["usage"]["prompt_tokens"]
        s.runtime.planner.evaluate()
        planner = (await s.http.get("/admin/planner")).json()
        workers = (await s.http.get("/admin/workers")).json()["workers"]
    inputs = planner["decision"]["inputs"]
    assert inputs["mean_prompt_tokens"] == num_prompt and inputs["mean_output_tokens"] == len(ids)
    # The scripted prefill reports 16 cached tokens (of fewer: what is computed is never below 0).
    assert inputs["mean_computed_prompt_tokens"] == max(num_prompt - 16, 0)
    [measured] = [w["decode"] for w in workers if w["role"] == "decode"]
    # Measured from the second token (the first one the decode worker streams after its pull).
    assert measured["tokens_per_s"] > 0 and measured["itl_ms"] > 0 and measured["concurrency"] >= 0
