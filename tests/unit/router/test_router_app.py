"""The router's HTTP routes that need no worker: models, health, metrics, and every 4xx.

Worker health comes from an injected probe (no worker process runs here). That bad requests never
reach a worker is checked on the pool itself: it opens a channel on the first RPC to an address,
so an empty pool means no worker was contacted. The one request that does go out targets a port
nothing listens on, to show the check would notice.
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.kv.spec.compat import CompatInfo, KVIdentity
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.router.app import create_app
from services.router.cli_args import add_router_parser, router_config_from_args, run_router
from services.router.config import RouterConfig
from services.router.pair_probes import ProbeOutcome
from services.router.pairing import Role, WorkerIdentity
from services.router.runtime import RouterRuntime
from services.router.tokenizing import load_tokenizer, model_name
from services.router.worker_labels import WorkerLabels
from services.text.tokenizer import Tokenizer
from tests.unit.router._kv_fakes import SilentKVSource
from tests.unit.router._router_model import write_tiny_model_dir

REPO_ROOT = Path(__file__).resolve().parents[3]
# Nothing listens on port 1: an RPC there fails at once with UNAVAILABLE.
NOWHERE = "127.0.0.1:1"

pytestmark = pytest.mark.anyio


class Probe:
    """Health answers per address; an address not listed is down."""

    def __init__(self, up: dict[str, WorkerIdentity] | None = None) -> None:
        self.up = up or {}

    async def __call__(self, role: Role, address: str) -> WorkerIdentity:
        if address not in self.up:
            raise ConnectionRefusedError(address)
        return self.up[address]


class PairProber:
    """Every pair's KV probe succeeds, unless its (prefill, decode) addresses are in ``failing`` (with that
    reason); records what was probed."""

    def __init__(self, failing: dict[tuple[str, str], str] | None = None) -> None:
        self.failing = failing or {}
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, prefill: str, decode: str, timeout_s: float) -> ProbeOutcome:
        self.calls.append((prefill, decode))
        reason = self.failing.get((prefill, decode))
        return ProbeOutcome(reason is None, reason or "", seconds=0.01)


def _identity(role: Role, max_model_len: int = 64) -> WorkerIdentity:
    return WorkerIdentity(engine_id=f"{role}-0", role=role.value, compat_hash="h", max_model_len=max_model_len)


@dataclass
class Router:
    """A running app (lifespan entered) and an HTTP client talking to it in-process."""

    http: httpx.AsyncClient
    runtime: RouterRuntime

    async def get(self, path: str, **kwargs) -> httpx.Response:
        return await self.http.get(path, **kwargs)

    async def post(self, path: str, **kwargs) -> httpx.Response:
        return await self.http.post(path, **kwargs)

    def pool_untouched(self) -> bool:
        """No channel was ever opened: no worker was contacted."""
        return self.runtime.pool.addresses == []


@asynccontextmanager
async def _router(model_dir: Path, tokenizer: Tokenizer | None, probe: Probe | None = None,
                  pair_prober: PairProber | None = None, **config) -> AsyncIterator[Router]:
    fields = {"model": str(model_dir), "prefill": (NOWHERE,), "decode": (NOWHERE,), **config}
    app = create_app(RouterConfig(**fields), tokenizer_loader=lambda _: tokenizer, probe=probe or Probe(),
                     pair_prober=pair_prober or PairProber(), kv_source=SilentKVSource())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            yield Router(http, app.state.runtime)


@pytest.fixture()
async def healthy(model_dir: Path, tokenizer: Tokenizer) -> AsyncIterator[Router]:
    """A router whose (unreachable) workers the probe reports healthy: valid requests would go out.

    The health interval is long, so only the first probe round (at start-up) runs during a test.
    """
    probe = Probe({"127.0.0.1:2": _identity(Role.PREFILL), NOWHERE: _identity(Role.DECODE)})
    async with _router(model_dir, tokenizer, probe, prefill=("127.0.0.1:2",), decode=(NOWHERE,),
                       health_interval_s=3600) as router:
        yield router


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- models --------------------------------------------------------------------------------------


async def test_models_lists_the_name_derived_from_the_model_path(model_dir: Path, tokenizer: Tokenizer) -> None:
    async with _router(model_dir, tokenizer) as router:
        body = (await router.get("/v1/models")).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == model_dir.name and card["object"] == "model" and card["owned_by"] == "pdserve"


async def test_models_lists_the_served_model_name(model_dir: Path, tokenizer: Tokenizer) -> None:
    async with _router(model_dir, tokenizer, served_model_name="my-llm", max_model_len=128) as router:
        (card,) = (await router.get("/v1/models")).json()["data"]
    assert card["id"] == "my-llm" and card["max_model_len"] == 128


def test_model_names_follow_resolve_model() -> None:
    assert model_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    assert model_name("/x/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"
    assert model_name("dummy:tiny") == "dummy-tiny"
    assert model_name("/x/a.gguf", "served") == "served"


async def test_unknown_model_is_404(healthy: Router) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions",
                                                                 {"messages": [{"role": "user", "content": "hi"}]})):
        error = _error(await healthy.post(path, json={"model": "gpt-4o", **body}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4o" in error["message"]
    assert healthy.pool_untouched()


# ---- bad input never reaches a worker ------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "hi", "n": 65}, "n"),
    ({"prompt": "hi", "stop": 7}, "stop"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": ["hi", "x" * 64]}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": "x" * 64}, "prompt"),
    ({"prompt": "hi", "max_tokens": 63}, "max_tokens"),
])
async def test_bad_completion_bodies_are_400(healthy: Router, body: dict, param: str) -> None:
    error = _error(await healthy.post("/v1/completions", json={"model": healthy.runtime.model_name, **body}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert healthy.pool_untouched()


async def test_malformed_json_is_400(healthy: Router) -> None:
    for raw in (b"{not json", b"", b"[]", b'"prompt"'):
        response = await healthy.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        _error(response, 400)
    assert healthy.pool_untouched()


async def test_context_length_message(healthy: Router) -> None:
    response = await healthy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 80}]})
    error = _error(response, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "maximum context length is 64 tokens" in error["message"]
    assert healthy.pool_untouched()


async def test_bad_chat_bodies_are_400(healthy: Router) -> None:
    cases = [({"messages": []}, "messages"),
             ({"messages": [{"role": "user"}], "top_logprobs": 3}, "top_logprobs"),
             ({"messages": [{"content": "hi"}]}, "messages[0].role")]
    for body, param in cases:
        assert _error(await healthy.post("/v1/chat/completions", json=body), 400)["param"] == param
    assert healthy.pool_untouched()


async def test_chat_without_a_template_is_400(tmp_path: Path) -> None:
    plain = load_tokenizer(str(write_tiny_model_dir(tmp_path, chat_template=None)))
    async with _router(tmp_path, plain) as router:
        error = _error(await router.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]}),
                       400)
        assert error["param"] == "messages" and "chat template" in error["message"]
        assert router.pool_untouched()


async def test_without_a_tokenizer_only_token_ids_are_accepted(model_dir: Path) -> None:
    async with _router(model_dir, None) as router:
        assert _error(await router.post("/v1/completions", json={"prompt": "text"}), 400)["param"] == "prompt"
        assert _error(await router.post("/v1/completions", json={"prompt": [1], "stop": "x"}), 400)["param"] == "stop"
        assert router.pool_untouched()


# ---- no workers ----------------------------------------------------------------------------------


async def test_no_workers_health_503_and_requests_retry_after(model_dir: Path, tokenizer: Tokenizer) -> None:
    async with _router(model_dir, tokenizer) as router:
        response = await router.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "unavailable"
        response = await router.post("/v1/completions", json={"prompt": "hi"})
        error = _error(response, 503)
        assert error["code"] == "no_healthy_workers" and response.headers["Retry-After"] == "1"
        assert router.pool_untouched()


async def test_health_follows_compatible_pairs(model_dir: Path, tokenizer: Tokenizer) -> None:
    probe = Probe({"p:1": _identity(Role.PREFILL), "d:1": _identity(Role.DECODE)})
    async with _router(model_dir, tokenizer, probe, prefill=("p:1",), decode=("d:1",)) as router:
        body = (await router.get("/health")).json()
        workers = body.pop("workers")
        assert body == {"status": "ok", "healthy_workers": {"prefill": 1, "decode": 1}, "decode_only": False,
                        "pairs": [{"prefill": "p:1", "decode": "d:1", "state": "probed"}]}
        label = WorkerLabels()
        assert workers == [
            {"address": "p:1", "worker": label("p:1"), "role": "prefill", "state": "healthy", "healthy": True,
             "draining": False, "engine_id": "prefill-0", "tp_size": 1, "block_size": None, "last_error": None},
            {"address": "d:1", "worker": label("d:1"), "role": "decode", "state": "healthy", "healthy": True,
             "draining": False, "engine_id": "decode-0", "tp_size": 1, "block_size": None, "last_error": None},
        ]
        probe.up["d:1"] = WorkerIdentity(engine_id="d", role="decode", compat_hash="other")
        await router.runtime.discovery.check_health()
        response = await router.get("/health")
        # both up, but not compatible: the decode worker still serves, prefilling locally
        assert response.status_code == 200 and response.json()["status"] == "degraded"
        assert "can pair" in response.json()["reason"]
        workers = {w["address"]: w for w in response.json()["workers"]}
        assert {a: w["state"] for a, w in workers.items()} == {"p:1": "unpaired", "d:1": "unpaired"}
        assert {a: w["unpaired_reason"] for a, w in workers.items()} == {
            "p:1": "decode d:1: compat hash: prefill h vs decode other",
            "d:1": "prefill p:1: compat hash: prefill h vs decode other"}


async def test_health_and_metrics_name_a_pair_that_failed_its_probe(model_dir: Path, tokenizer: Tokenizer) -> None:
    """A compatible pair whose KV probe failed is not used: /health lists it with the probe's reason (and the
    decode worker as unpaired), metrics count it; with no probed pair left the router is degraded."""
    reason = "KV pull from prefill-0 failed (the KV pulled does not match the ticket's digest in KV group(s) [0])"
    probe = Probe({"p:1": _identity(Role.PREFILL), "d:1": _identity(Role.DECODE), "d:2": _identity(Role.DECODE)})
    prober = PairProber({("p:1", "d:2"): reason})
    async with _router(model_dir, tokenizer, probe, prober, prefill=("p:1",), decode=("d:1", "d:2"),
                       health_interval_s=3600) as router:
        body = (await router.get("/health")).json()
        assert body["status"] == "ok" and sorted(prober.calls) == [("p:1", "d:1"), ("p:1", "d:2")]
        assert body["pairs"] == [{"prefill": "p:1", "decode": "d:1", "state": "probed"},
                                 {"prefill": "p:1", "decode": "d:2", "state": "failed", "reason": reason}]
        workers = {w["address"]: w for w in body["workers"]}
        assert (workers["d:2"]["state"], workers["d:2"]["unpaired_reason"]) == \
            ("unpaired", f"prefill p:1: KV probe failed: {reason}")
        assert workers["d:1"]["state"] == "healthy" and workers["p:1"]["state"] == "healthy"
        metrics = (await router.get("/metrics")).text
        for line in ('pdserve_router_pairs{state="probed"} 1.0', 'pdserve_router_pairs{state="failed"} 1.0',
                     'pdserve_router_pair_probes_total{result="failed"} 1.0'):
            assert line in metrics, line

        probe.up.pop("d:1")
        await router.runtime.discovery.check_health()
        response = await router.get("/health")
        assert response.status_code == 200 and response.json()["status"] == "degraded"
        assert response.json()["reason"] == ("every compatible pair of healthy workers failed its KV probe (see pairs "
                                             "and each worker's unpaired_reason): decode workers prefill every prompt "
                                             "themselves")
        assert 'pdserve_router_status{status="degraded"} 1.0' in (await router.get("/metrics")).text


async def test_health_states_follow_what_can_be_served(model_dir: Path, tokenizer: Tokenizer) -> None:
    """ok with a pair; degraded (200) with decode workers only; unavailable (503) with no decode worker;
    the same status on /metrics as pdserve_router_status."""
    probe = Probe({"p:1": _identity(Role.PREFILL), "d:1": _identity(Role.DECODE)})
    async with _router(model_dir, tokenizer, probe, prefill=("p:1",), decode=("d:1",)) as router:
        async def status() -> tuple[int, str, dict[str, str], str]:
            response = await router.get("/health")
            body = response.json()
            metrics = (await router.get("/metrics")).text
            on_metrics = [line for line in metrics.splitlines()
                          if line.startswith("pdserve_router_status{") and line.endswith(" 1.0")]
            return (response.status_code, body["status"], {w["address"]: w["state"] for w in body["workers"]},
                    on_metrics[0])

        assert await status() == (200, "ok", {"p:1": "healthy", "d:1": "healthy"},
                                  'pdserve_router_status{status="ok"} 1.0')
        probe.up.pop("p:1")
        await router.runtime.discovery.check_health()
        code, state, workers, metric = await status()
        assert (code, state, metric) == (200, "degraded", 'pdserve_router_status{status="degraded"} 1.0')
        assert workers == {"p:1": "unhealthy", "d:1": "healthy"}
        assert (await router.get("/health")).json()["reason"].startswith("no healthy prefill worker:")
        probe.up.pop("d:1")
        await router.runtime.discovery.check_health()
        assert await status() == (503, "unavailable", {"p:1": "unhealthy", "d:1": "unhealthy"},
                                  'pdserve_router_status{status="unavailable"} 1.0')


async def test_health_says_why_a_worker_cannot_pair(model_dir: Path, tokenizer: Tokenizer) -> None:
    """Decode at TP 2 cannot shard a 3-KV-head model; the TP-3 one can: only it pairs, and /health says why."""
    info = _three_head_model()

    def identity(role: Role, tp: int) -> WorkerIdentity:
        return WorkerIdentity(engine_id=f"{role}-tp{tp}", role=role.value, compat_hash=info.hash,
                              compat_fields=info.fields, tp_size=tp, block_size=16, max_model_len=64)

    probe = Probe({"p:1": identity(Role.PREFILL, 1), "d:2": identity(Role.DECODE, 2),
                   "d:3": identity(Role.DECODE, 3)})
    async with _router(model_dir, tokenizer, probe, prefill=("p:1",), decode=("d:2", "d:3", "d:9"),
                       health_interval_s=3600) as router:
        response = await router.get("/health")
        assert response.status_code == 200
        workers = {w["address"]: w for w in response.json()["workers"]}
        assert workers["d:2"] == {
            "address": "d:2", "worker": WorkerLabels()("d:2"), "role": "decode", "state": "unpaired", "healthy": True,
            "draining": False,
            "engine_id": "decode-tp2",
            "tp_size": 2, "block_size": 16, "last_error": None,
            "unpaired_reason": "prefill p:1: decode tp 2 cannot shard 3 KV heads (neither divides the other)",
        }
        assert "unpaired_reason" not in workers["d:3"] and "unpaired_reason" not in workers["p:1"]
        assert workers["d:9"]["healthy"] is False and workers["d:9"]["engine_id"] is None
        assert "ConnectionRefusedError" in workers["d:9"]["last_error"]
        # without the TP-3 decode worker nothing pairs: degraded, and the prefill worker says why
        probe.up.pop("d:3")
        await router.runtime.discovery.check_health()
        response = await router.get("/health")
        assert response.status_code == 200 and response.json()["status"] == "degraded"
        workers = {w["address"]: w for w in response.json()["workers"]}
        assert workers["p:1"]["unpaired_reason"] == \
            "decode d:2: decode tp 2 cannot shard 3 KV heads (neither divides the other)"


def _three_head_model() -> CompatInfo:
    group = KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1), 16)
    layout = KVLayoutSpec(kind=LayoutKind.CROSS_LAYER, order=BlockOrder.NHD, num_blocks=8, num_kv_heads=3,
                          head_dim=16, dtype="bfloat16", groups=(group,))
    return CompatInfo.of_identity(KVIdentity.of(architecture="x", num_layers=2, num_kv_heads=3, head_dim=16,
                                                layout=layout))


async def test_health_of_a_decode_only_router(model_dir: Path, tokenizer: Tokenizer) -> None:
    probe = Probe({"d:1": _identity(Role.DECODE)})
    async with _router(model_dir, tokenizer, probe, prefill=(), decode=("d:1",)) as router:
        body = (await router.get("/health")).json()
    assert body["status"] == "ok" and body["decode_only"]


# What no client error may carry: a host:port, or gRPC's status names and connection text.
_INTERNALS = re.compile(r"\d+\.\d+\.\d+\.\d+|:\d{2,5}\b|StatusCode|UNAVAILABLE|INTERNAL|failed to connect|ipv4")


def assert_no_internals(text: str) -> None:
    found = _INTERNALS.findall(text)
    assert not found, f"{found} in {text}"


@pytest.mark.parametrize("failovers", [0, 2], ids=["no-failover", "failover"])
async def test_unreachable_workers_fail_cleanly_and_are_taken_out(model_dir: Path, tokenizer: Tokenizer,
                                                                  caplog: pytest.LogCaptureFixture,
                                                                  failovers: int) -> None:
    """The one request that does go out: prefill fails, decode fails, 503, both marked down (with failover on,
    no other decode worker takes the request). The client reads the kind of failure, not
    the workers' addresses or gRPC's text; the router's log line has them, under the request's id."""
    probe = Probe({"127.0.0.1:2": _identity(Role.PREFILL), NOWHERE: _identity(Role.DECODE)})
    async with _router(model_dir, tokenizer, probe, prefill=("127.0.0.1:2",), decode=(NOWHERE,),
                       health_interval_s=3600, max_decode_failovers=failovers, decode_failover_wait_s=0.2) as healthy:
        with caplog.at_level(logging.WARNING, logger="services.router.errors"):
            response = await healthy.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                          headers={"X-Request-Id": "lost-1"})
        error = _error(response, 503)
        # A failover that found no other decode worker fails as the decode worker did (or as no_healthy_workers).
        assert error["code"] in (("worker_unavailable", "no_healthy_workers") if failovers else ("worker_unavailable",))
        assert "Retry-After" in response.headers and error["message"]
        assert_no_internals(response.text)
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request lost-1 answered 503")]
        assert "decode worker 127.0.0.1:1" in line and "UNAVAILABLE" in line, line
        policy = healthy.runtime.policy
        assert not policy.has_healthy_decode() and not policy.has_healthy_pair()
        assert sorted(healthy.runtime.pool.addresses) == ["127.0.0.1:1", "127.0.0.1:2"]
        assert all(w.outstanding_requests == 0 for w in policy.workers())
        response = await healthy.post("/v1/completions", json={"prompt": "hi"})
        assert _error(response, 503)["code"] == "no_healthy_workers"
        assert_no_internals(response.text)


async def test_health_without_the_api_key_is_the_status_alone(model_dir: Path, tokenizer: Tokenizer) -> None:
    """With --api-key, /health stays open for probes, but only a caller with the key reads the workers, their
    addresses, states and reasons, and the pairs; the status and its HTTP code are everyone's."""
    probe = Probe({"10.1.2.3:9001": _identity(Role.PREFILL), "10.1.2.4:9002": _identity(Role.DECODE)})
    async with _router(model_dir, tokenizer, probe, prefill=("10.1.2.3:9001",), decode=("10.1.2.4:9002",),
                       api_key="k3y", health_interval_s=3600) as router:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k3y"}):
            response = await router.get("/health", headers=headers)
            assert (response.status_code, response.json()) == (200, {"status": "ok"}), headers
        keyed = await router.get("/health", headers={"Authorization": "bearer k3y"})
        body = keyed.json()
        assert keyed.status_code == 200 and body["status"] == "ok"
        assert {w["address"] for w in body["workers"]} == {"10.1.2.3:9001", "10.1.2.4:9002"}
        assert body["pairs"] == [{"prefill": "10.1.2.3:9001", "decode": "10.1.2.4:9002", "state": "probed"}]

        probe.up.clear()
        await router.runtime.discovery.check_health()
        response = await router.get("/health")
        assert (response.status_code, response.json()) == (503, {"status": "unavailable"})
        keyed = await router.get("/health", headers={"Authorization": "Bearer k3y"})
        assert keyed.status_code == 503 and "ConnectionRefusedError" in keyed.json()["workers"][0]["last_error"]


async def test_metrics_label_workers_by_an_id_not_their_address(model_dir: Path, tokenizer: Tokenizer) -> None:
    """/metrics is open (scrapers have no key), so its per-worker series carry the worker's opaque id, the one
    /health (with the key) lists beside the address; the id follows the key, so replicas sharing it agree."""
    addresses = ("10.1.2.3:9001", "10.1.2.4:9002")
    probe = Probe({addresses[0]: _identity(Role.PREFILL), addresses[1]: _identity(Role.DECODE)})
    ids: dict[str, dict[str, str]] = {}
    for key in ("k3y", "other"):
        async with _router(model_dir, tokenizer, probe, prefill=addresses[:1], decode=addresses[1:], api_key=key,
                           health_interval_s=3600) as router:
            metrics = (await router.get("/metrics")).text
            health = (await router.get("/health", headers={"Authorization": f"Bearer {key}"})).json()
        assert not any(a in metrics or a.split(":")[0] in metrics for a in addresses), metrics
        ids[key] = {w["address"]: w["worker"] for w in health["workers"]}
        assert re.fullmatch(r"[0-9a-f]{12}", ids[key][addresses[0]])
        for role, address in zip(("prefill", "decode"), addresses, strict=True):
            line = f'pdserve_router_worker_outstanding_requests{{role="{role}",worker="{ids[key][address]}"}} 0.0'
            assert line in metrics, metrics
    assert ids["k3y"] == {a: WorkerLabels("k3y")(a) for a in addresses} and ids["k3y"] != ids["other"]


async def test_overload_is_429(model_dir: Path, tokenizer: Tokenizer) -> None:
    probe = Probe({NOWHERE: _identity(Role.DECODE)})
    async with _router(model_dir, tokenizer, probe, prefill=(), max_inflight_requests=1) as router:
        router.runtime.dispatcher.num_in_flight = 1  # as if one request were being served
        response = await router.post("/v1/completions", json={"prompt": "hi", "stream": True})
        assert _error(response, 429)["type"] == "rate_limit_error" and response.headers["Retry-After"] == "1"
        assert router.pool_untouched()


# ---- other routes --------------------------------------------------------------------------------


async def test_unknown_route_and_method_in_openai_format(healthy: Router) -> None:
    assert _error(await healthy.get("/v1/nothing"), 404)["type"] == "invalid_request_error"
    _error(await healthy.get("/v1/completions"), 405)


async def test_metrics(healthy: Router) -> None:
    await healthy.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})
    await healthy.get("/v1/nothing")
    text = (await healthy.get("/metrics")).text
    assert 'pdserve_router_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert 'pdserve_router_requests_total{endpoint="other",status="404"} 1.0' in text
    assert 'pdserve_router_workers{role="decode",state="healthy"} 1.0' in text
    for name in ("pdserve_router_time_to_first_token_seconds", "pdserve_router_inter_token_latency_seconds",
                 "pdserve_router_e2e_request_latency_seconds", "pdserve_router_requests_in_flight",
                 "pdserve_router_added_latency_seconds"):
        assert f"# TYPE {name} " in text


def test_router_import_does_not_load_torch() -> None:
    code = "import sys, services.router.app, services.router.cli_args; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_cli_flags_build_the_config(model_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["router", "--model", str(model_dir), "--prefill", "a:1,b:2", "--prefill", "c:3",
                              "--decode-dns", "decode.svc:9000", "--direct-decode-threshold", "64",
                              "--max-model-len", "4096", "--dns-refresh-s", "5"])
    config = router_config_from_args(args)
    assert (args.host, args.port, args.func) == ("127.0.0.1", 8000, run_router)
    assert config.prefill == ("a:1", "b:2", "c:3") and config.decode_dns == ("decode.svc:9000",)
    assert config.direct_decode_threshold == 64 and config.max_model_len == 4096 and config.dns_refresh_s == 5
    assert not config.decode_only
    with pytest.raises(ValueError, match="decode"):
        router_config_from_args(parser.parse_args(["router", "--prefill", "a:1"]))
