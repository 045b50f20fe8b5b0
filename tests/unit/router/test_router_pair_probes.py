"""The pair probe on the router's side: the pure state table, discovery driving it, pairing obeying it.

Probes are scripted (NOT a transfer: the decode worker's side is ``tests/unit/decode/test_decode_probe.py``
and ``tests/integration/test_pair_probe.py``, the whole stack ``tests/e2e/test_pair_probe.py``). What is
tested: pending -> probed / failed, a failed pair not used and re-probed only after the back-off, an epoch
change making a pair pending again, results for epochs gone dropped, timeouts and crashing probers, the
older decode worker without the RPC, and what the serving status and metrics say meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import pytest

from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.router.discovery import Discovery, EndpointSource
from services.router.metrics import RouterMetrics
from services.router.pair_probes import PairProbeTable, PairState, ProbeOutcome
from services.router.pairing import PairingPolicy, Role, ServingStatus, WorkerIdentity
from services.router.routes import ROUTE_HEADER
from services.router.tokenizing import load_tokenizer
from services.router.workers import WorkerPool
from tests.unit.router._router_model import write_tiny_model_dir
from tests.unit.router.test_router_discovery import FakeClock, ScriptedProbe
from tests.unit.router.test_router_flow import ANSWER, ScriptedDecode, ScriptedPrefill, _serving

RETRY_S = 15.0


def _identity(role: Role, epoch: int = 1) -> WorkerIdentity:
    return WorkerIdentity(engine_id=f"{role}-e", role=role.value, compat_hash="h", max_model_len=512, epoch=epoch)


# ---- the table, pure -------------------------------------------------------------------------------


def test_a_pair_is_pending_then_probed_or_failed_and_retried_after_the_back_off() -> None:
    table = PairProbeTable(retry_after_s=RETRY_S)
    table.sync([("p:1", "d:1", 7, 9), ("p:1", "d:2", 7, 3)])
    assert table.counts() == {"pending": 2, "probed": 0, "failed": 0}
    assert not table.usable("p:1", "d:1", (7, 9))
    ok, bad = table.get("p:1", "d:1"), table.get("p:1", "d:2")
    assert table.due(0.0) == [ok, bad]
    table.start(ok)
    table.start(bad)
    assert table.due(0.0) == []  # in flight: not started twice
    assert table.record(ok, ProbeOutcome(True, prefill_epoch=7, seconds=0.2), now=1.0)
    assert table.record(bad, ProbeOutcome(False, "KV digest mismatch"), now=1.0)
    assert table.usable("p:1", "d:1", (7, 9)) and not table.usable("p:1", "d:2", (7, 3))
    assert (bad.state, bad.reason, bad.retry_at) == (PairState.FAILED, "KV digest mismatch", 1.0 + RETRY_S)
    assert table.counts() == {"pending": 0, "probed": 1, "failed": 1} and table.results == {"ok": 1, "failed": 1}
    assert table.due(1.0 + RETRY_S - 0.1) == []  # still backing off; a probed pair is never due again
    assert table.due(1.0 + RETRY_S) == [bad]
    table.start(bad)
    assert table.record(bad, ProbeOutcome(True), now=20.0)
    assert table.usable("p:1", "d:2", (7, 3)) and bad.reason == ""


def test_an_epoch_change_makes_a_pair_pending_and_drops_the_result_of_the_old_epoch() -> None:
    table = PairProbeTable(retry_after_s=RETRY_S)
    table.sync([("p:1", "d:1", 7, 9)])
    old = table.get("p:1", "d:1")
    table.start(old)
    table.sync([("p:1", "d:1", 8, 9)])  # the prefill worker restarted while its old epoch was probed
    assert not table.record(old, ProbeOutcome(True), now=1.0)  # about the old epoch: dropped
    new = table.get("p:1", "d:1")
    assert new is not old and new.state is PairState.PENDING and table.due(1.0) == [new]
    table.start(new)
    table.record(new, ProbeOutcome(True), now=1.0)
    assert table.usable("p:1", "d:1", (8, 9)) and not table.usable("p:1", "d:1", (7, 9))
    table.sync([("p:1", "d:1", 8, 10)])  # the decode worker restarted: pending again
    assert table.get("p:1", "d:1").state is PairState.PENDING and not table.usable("p:1", "d:1", (8, 10))
    table.sync([])  # no longer a compatible pair of available workers: forgotten
    assert table.pairs() == [] and table.results == {"ok": 1, "failed": 0}


def test_a_result_for_another_prefill_epoch_leaves_the_pair_pending() -> None:
    """The decode worker probed a newer life of the prefill worker than the router knows: probed again once
    the router sees the new epoch (until then, not used)."""
    table = PairProbeTable()
    table.sync([("p:1", "d:1", 7, 9)])
    entry = table.get("p:1", "d:1")
    table.start(entry)
    assert not table.record(entry, ProbeOutcome(True, prefill_epoch=8), now=0.0)
    assert entry.state is PairState.PENDING and table.due(0.0) == [entry] and table.results["ok"] == 0


# ---- discovery drives it, pairing obeys it -----------------------------------------------------------


class ScriptedPairProber:
    """Per (prefill, decode): ok, a failure reason, or held until ``release`` is set; records calls."""

    def __init__(self) -> None:
        self.failing: dict[tuple[str, str], str] = {}
        self.hold: set[tuple[str, str]] = set()
        self.release = asyncio.Event()
        self.calls: list[tuple[str, str]] = []
        self.epochs: dict[str, int] = {}  # prefill address -> the epoch the "decode worker" reports probing

    async def __call__(self, prefill: str, decode: str, timeout_s: float) -> ProbeOutcome:
        self.calls.append((prefill, decode))
        if (prefill, decode) in self.hold:
            await self.release.wait()
        reason = self.failing.get((prefill, decode))
        if reason == "crash":
            raise RuntimeError("prober crashed")
        return ProbeOutcome(reason is None, reason or "", "prefill-e", self.epochs.get(prefill, 0), 0.05)


def _setup(prober, decodes=("d:1", "d:2"), strict: bool = False, timeout_s: float = 30.0):
    policy = PairingPolicy(enforce_disagg=strict, probes=PairProbeTable(retry_after_s=RETRY_S))
    probe, clock = ScriptedProbe(), FakeClock()
    probe.up = {"p:1": _identity(Role.PREFILL), **{d: _identity(Role.DECODE) for d in decodes}}
    sources = [EndpointSource(Role.PREFILL, static=("p:1",)), EndpointSource(Role.DECODE, static=decodes)]
    discovery = Discovery(policy, sources, probe, clock=clock, pair_prober=prober, pair_probe_timeout_s=timeout_s)
    return policy, probe, clock, discovery


def _decode_of(policy: PairingPolicy, num_prompt_tokens: int = 100) -> tuple[str | None, str]:
    assignment = policy.acquire(num_prompt_tokens)
    policy.finish(assignment)
    return assignment.prefill, assignment.decode


def test_only_probed_pairs_take_requests_and_a_failed_one_is_retried_after_the_back_off() -> None:
    async def scenario() -> None:
        prober = ScriptedPairProber()
        prober.failing[("p:1", "d:2")] = "KV pull failed (handshake refused)"
        policy, probe, clock, discovery = _setup(prober)
        await discovery.refresh()
        assert await discovery.wait_for_probes(5)
        assert sorted(prober.calls) == [("p:1", "d:1"), ("p:1", "d:2")]
        assert policy.serving_status() is ServingStatus.OK
        # Every long prompt goes to the probed pair, never to the failed one.
        assert {_decode_of(policy) for _ in range(6)} == {("p:1", "d:1")}
        d2 = policy.get(Role.DECODE, "d:2")
        assert policy.worker_state(d2) == "unpaired"
        assert policy.unpaired_reason(d2) == "prefill p:1: KV probe failed: KV pull failed (handshake refused)"
        assert policy.unpaired_reason(policy.get(Role.PREFILL, "p:1")) is None  # it pairs with d:1

        clock.now = RETRY_S - 1  # health rounds go on; the failed pair waits for its back-off
        await discovery.refresh()
        await discovery.wait_for_probes(5)
        assert len(prober.calls) == 2
        prober.failing.clear()
        clock.now = 1 + RETRY_S
        await discovery.refresh()
        await discovery.wait_for_probes(5)
        assert prober.calls[2:] == [("p:1", "d:2")]  # only the failed pair; the probed one stays probed
        assert policy.worker_state(d2) == "healthy"
        both = [policy.acquire(100), policy.acquire(100)]  # the second goes where nothing is outstanding
        assert {a.decode for a in both} == {"d:1", "d:2"} and {a.prefill for a in both} == {"p:1"}

    asyncio.run(scenario())


def test_an_epoch_change_takes_the_pair_out_until_probed_again() -> None:
    async def scenario() -> None:
        prober = ScriptedPairProber()
        policy, probe, clock, discovery = _setup(prober, decodes=("d:1",))
        await discovery.refresh()
        await discovery.wait_for_probes(5)
        assert policy.has_healthy_pair()

        probe.up["p:1"] = _identity(Role.PREFILL, epoch=2)  # restarted: a new epoch
        prober.hold.add(("p:1", "d:1"))
        await discovery.refresh()
        await asyncio.sleep(0.01)  # the probe task starts, then waits to be released
        assert prober.calls == [("p:1", "d:1")] * 2
        entry = policy.probes.get("p:1", "d:1")
        assert entry.state is PairState.PENDING and entry.epochs == (2, 1)
        # Pending: no pair; requests go straight to the decode worker (a strict router would refuse them).
        assert not policy.has_healthy_pair() and policy.serving_status() is ServingStatus.DEGRADED
        assert _decode_of(policy) == (None, "d:1")
        assert "still pending" in policy.no_pair_reason()
        assert policy.worker_state(policy.get(Role.DECODE, "d:1")) == "healthy"  # pending is not a refusal
        await discovery.refresh()  # a probe under way is not started again
        assert len(prober.calls) == 2
        prober.release.set()
        await discovery.wait_for_probes(5)
        assert policy.has_healthy_pair() and _decode_of(policy) == ("p:1", "d:1")

    asyncio.run(scenario())


def test_a_strict_router_is_unavailable_while_every_pair_failed() -> None:
    async def scenario() -> None:
        prober = ScriptedPairProber()
        prober.failing[("p:1", "d:1")] = "digest mismatch"
        policy, _, _, discovery = _setup(prober, decodes=("d:1",), strict=True)
        await discovery.refresh()
        await discovery.wait_for_probes(5)
        assert policy.serving_status() is ServingStatus.UNAVAILABLE
        assert "failed its KV probe" in policy.no_pair_reason()
        assert policy.acquire(100).prefill is None  # the flow turns this into a 503 under --enforce-disagg

    asyncio.run(scenario())


def test_a_crashing_or_silent_prober_fails_the_pair() -> None:
    async def scenario() -> None:
        prober = ScriptedPairProber()
        prober.failing[("p:1", "d:1")] = "crash"
        prober.hold.add(("p:1", "d:2"))  # never answers
        policy, _, _, discovery = _setup(prober, timeout_s=0.05)
        await discovery.refresh()
        assert await discovery.wait_for_probes(5)
        reasons = {e.decode: e.reason for e in policy.probes.pairs()}
        assert reasons == {"d:1": "RuntimeError: prober crashed", "d:2": "no answer within 0.05 s"}
        assert policy.probes.counts() == {"pending": 0, "probed": 0, "failed": 2}

    asyncio.run(scenario())


def test_probe_metrics_follow_the_table() -> None:
    async def scenario() -> str:
        prober = ScriptedPairProber()
        prober.failing[("p:1", "d:2")] = "nope"
        policy, _, _, discovery = _setup(prober)
        await discovery.refresh()
        await discovery.wait_for_probes(5)
        return RouterMetrics(policy).render().decode()

    text = asyncio.run(scenario())
    for line in ('pdserve_router_pairs{state="probed"} 1.0', 'pdserve_router_pairs{state="failed"} 1.0',
                 'pdserve_router_pairs{state="pending"} 0.0', 'pdserve_router_pair_probes_total{result="ok"} 1.0',
                 'pdserve_router_pair_probes_total{result="failed"} 1.0'):
        assert line in text, line
    # Without probes (a policy of its own, as in a decode-only router) every series is there, at 0.
    bare = RouterMetrics(PairingPolicy()).render().decode()
    assert 'pdserve_router_pairs{state="probed"} 0.0' in bare
    assert 'pdserve_router_pair_probes_total{result="failed"} 0.0' in bare


# ---- the Probe RPC through the pool ----------------------------------------------------------------------


class OlderDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker from before the Probe RPC: the default servicer answers UNIMPLEMENTED."""


class ProbingDecode(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, answer: worker_pb2.ProbeResponse | None) -> None:
        self.answer = answer
        self.asked: list[str] = []

    async def Probe(self, request, context):  # noqa: N802
        self.asked.append(request.prefill_address)
        if self.answer is None:
            await asyncio.Event().wait()  # never answers
        return self.answer


async def _pool_probe(servicer, timeout_s: float = 5.0) -> ProbeOutcome:
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = WorkerPool()
    try:
        return await pool.probe("p:9", f"127.0.0.1:{port}", timeout_s)
    finally:
        await pool.close_all()
        await server.stop(0)


def test_the_pool_asks_the_decode_worker_and_an_older_one_counts_as_probed(caplog) -> None:
    answer = worker_pb2.ProbeResponse(ok=False, reason="digest mismatch", prefill_engine_id="prefill@p:9",
                                      prefill_epoch=5, seconds=0.5)
    servicer = ProbingDecode(answer)
    assert asyncio.run(_pool_probe(servicer)) == ProbeOutcome(False, "digest mismatch", "prefill@p:9", 5, 0.5)
    assert servicer.asked == ["p:9"]
    assert asyncio.run(_pool_probe(OlderDecode())) == ProbeOutcome(True, unprobed=True)
    silent = asyncio.run(_pool_probe(ProbingDecode(None), timeout_s=0.2))
    assert not silent.ok and "no answer within 0.2 s" in silent.reason


def test_an_older_decode_worker_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async def older(prefill: str, decode: str, timeout_s: float) -> ProbeOutcome:
            return ProbeOutcome(True, unprobed=True)

        policy, probe, clock, discovery = _setup(older, decodes=("d:1",))
        with caplog.at_level(logging.INFO, logger="services.router.discovery"):
            await discovery.refresh()
            await discovery.wait_for_probes(5)
            probe.up["p:1"] = _identity(Role.PREFILL, epoch=2)
            await discovery.refresh()
            await discovery.wait_for_probes(5)
        assert policy.has_healthy_pair() and policy.probes.get("p:1", "d:1").unprobed
        assert caplog.text.count("predates the Probe RPC") == 1

    asyncio.run(scenario())


# ---- the request flow over a failed pair (scripted gRPC workers) ----------------------------------------


@dataclass
class FailingProbeDecode(ScriptedDecode):
    """A decode worker whose pull from the prefill worker fails its probe."""

    async def Probe(self, request, context):  # noqa: N802
        return worker_pb2.ProbeResponse(ok=False, reason="KV pull failed (handshake refused)",
                                        prefill_engine_id="prefill-0", prefill_epoch=7)


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
def test_a_failed_pair_takes_no_request(tmp_path, strict: bool) -> None:
    """Lenient: the request goes straight to the decode worker (direct), the prefill worker is never asked.
    Strict: 503 naming the failed probe, before any worker RPC."""
    tokenizer = load_tokenizer(str(write_tiny_model_dir(tmp_path)))
    ids = tokenizer.encode(ANSWER)

    async def scenario() -> None:
        prefill, decode = ScriptedPrefill(first_token_id=ids[0]), FailingProbeDecode(chunks=[ids])
        async with _serving(tokenizer, prefill, decode, enforce_disagg=strict) as s:
            health = (await s.http.get("/health")).json()
            assert [p["state"] for p in health["pairs"]] == ["failed"]
            response = await s.http.post("/v1/completions", json={"prompt": "the capital of France"})
            if strict:
                assert response.status_code == 503 and decode.requests == []
                assert "failed its KV probe" in response.json()["error"]["message"]
            else:
                assert response.status_code == 200 and response.headers[ROUTE_HEADER] == "direct"
                (generate,) = decode.requests
                assert not generate.HasField("ticket")
            assert prefill.requests == []

    asyncio.run(scenario())
