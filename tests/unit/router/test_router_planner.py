"""The P:D planner: the load model (rates at the SLO targets), rate matching, hysteresis, dwell, at least one
worker per role, which worker switches, the traffic window it reads, and the router's loop in advisory and
acting mode."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import pytest

from services.router.cli_args import add_router_parser, router_config_from_args
from services.router.metrics import RouterMetrics
from services.router.pairing import PairingPolicy, Role, WorkerIdentity
from services.router.planner import (
    MIN_UTILIZATION,
    DecisionReason,
    Planner,
    PlannerConfig,
    RoleCounts,
    StepModel,
    WorkerView,
    decode_capacity,
    decoding_sequences,
    desired,
    fit_step_model,
    prefill_utilization,
    split,
)
from services.router.planner_loop import PlannerLoop, SwitchUnavailable, worker_views
from services.router.prefix_index import Load
from services.router.runtime import planner_config
from services.router.traffic import FinishedRequest, TrafficStats, TrafficWindow

# Rates chosen so that the arithmetic is readable: prefill 10000 prompt tokens/s, decode 100 output tokens/s.
CONFIG = PlannerConfig(slo_ttft_s=2.0, slo_itl_s=0.05, hysteresis_evaluations=1, margin_workers=0.25,
                       min_dwell_s=0.0, default_prefill_tokens_per_s=10_000.0, default_decode_tokens_per_s=100.0)


def _workers(num_prefill: int, num_decode: int, **loads: Load) -> list[WorkerView]:
    return [WorkerView(f"p{i}", Role.PREFILL, True, loads.get(f"p{i}")) for i in range(num_prefill)] + \
           [WorkerView(f"d{i}", Role.DECODE, True, loads.get(f"d{i}")) for i in range(num_decode)]


def _traffic(rate_rps: float, prompt: int, output: int, window_s: float = 10.0) -> TrafficStats:
    n = round(rate_rps * window_s)
    return TrafficStats(window_s, n, n * prompt, n * output)


PREFILL_HEAVY = _traffic(10, prompt=4000, output=2)  # need: ~4.x prefill workers, 0.2 decode workers
DECODE_HEAVY = _traffic(10, prompt=10, output=200)  # need: 0.01 prefill workers, 20 decode workers


# ---- the load model ---------------------------------------------------------------------------------------


def test_prefill_utilization_meets_the_ttft_target_of_an_md1_queue():
    assert prefill_utilization(0.0, 2.0) == pytest.approx(1.0)
    service, ttft = 1.0, 2.0
    rho = prefill_utilization(service, ttft)
    assert rho == pytest.approx(2 / 3)
    assert service + rho * service / (2 * (1 - rho)) == pytest.approx(ttft)  # M/D/1 response time
    assert prefill_utilization(2.5, 2.0) == MIN_UTILIZATION  # one prompt alone misses the target
    assert prefill_utilization(1.9, 2.0) == MIN_UTILIZATION == 0.5  # the M/D/1 bound (0.095) is under the floor


def test_a_prompt_near_the_ttft_target_plans_at_half_utilization():
    # On the 2-core CPU machine a prefill worker computed 115 prompt tokens/s (three of them sharing the cores):
    # a 448-token prompt takes 3.9 s against a 4-s target. The M/D/1 bound plans that at 5 % utilization, 20
    # times the work in workers (it asked for 32 prefill workers of 4); the floor plans it at 50 %.
    config = dataclasses.replace(CONFIG, slo_ttft_s=4.0)
    loads = {"p0": Load(prefill_tokens_per_s=115.0), "p1": Load(prefill_tokens_per_s=115.0)}
    estimate = Planner(config).estimate(_workers(2, 2, **loads), _traffic(0.4, prompt=448, output=2, window_s=15))
    work = 0.4 * 448 / 115.0  # prefill workers busy computing, on average
    assert estimate.prefill_need == pytest.approx(work / MIN_UTILIZATION)
    assert estimate.slo_unattainable == ()  # 3.9 s < 4 s: reachable, at the price of a queue

def test_rate_matching_needs():
    estimate = Planner(CONFIG).estimate(_workers(2, 2), _traffic(10, prompt=2000, output=50))
    rho = prefill_utilization(2000 / 10_000, 2.0)
    assert estimate.prefill_capacity_tps == pytest.approx(10_000 * rho)
    assert estimate.prefill_need == pytest.approx(10 * 2000 / (10_000 * rho))
    assert estimate.decode_need == pytest.approx(10 * 50 / 100)
    assert estimate.decode_basis == "default"


def test_measured_prefill_rate_replaces_the_default():
    loads = {"p0": Load(prefill_tokens_per_s=2000.0), "p1": Load(prefill_tokens_per_s=4000.0)}
    estimate = Planner(CONFIG).estimate(_workers(2, 1, **loads), _traffic(1, prompt=100, output=10))
    assert estimate.prefill_tokens_per_s == 3000.0


def test_step_model_fit_and_decode_capacity_at_the_itl_target():
    samples = [(b, 0.01 + 0.002 * b) for b in (2, 4, 8, 16)]
    model = fit_step_model(samples)
    assert model.base_s == pytest.approx(0.01) and model.per_seq_s == pytest.approx(0.002)
    capacity = decode_capacity(model, 0.05, None, 1.0)
    assert capacity.basis == "fit" and not capacity.unattainable
    assert capacity.sequences == pytest.approx(20)  # 20 sequences fit in a 50 ms step
    assert capacity.tokens_per_s == pytest.approx(20 / 0.05)
    capacity = decode_capacity(model, 0.05, 5.0, 1.0)  # the KV pool holds only 5 sequences
    assert capacity.basis == "kv_bound" and capacity.tokens_per_s == pytest.approx(5 / model.step_s(5))
    unattainable = decode_capacity(StepModel(0.06, 0.001), 0.05, None, 1.0)  # the target is below one step
    assert unattainable.unattainable and unattainable.sequences == 1.0
    default = decode_capacity(None, 0.05, None, 100.0)  # 100 tok/s at 50 ms a token: 5 sequences at once
    assert (default.basis, default.tokens_per_s, default.sequences) == ("default", 100.0, pytest.approx(5.0))
    assert fit_step_model([(4, 0.02), (4.5, 0.03)]) is None  # too little spread
    assert fit_step_model([(2, 0.03), (8, 0.02)]) is None  # steps do not grow


def test_desired_counts_round_up_and_keep_one():
    assert [desired(x) for x in (0.0, 0.3, 1.0, 1.0000001, 2.4)] == [1, 1, 1, 1, 3]
    assert split(4, 3.0, 1.0) == 3.0


def test_acting_desired_counts_stay_within_the_pool():
    # PREFILL_HEAVY needs 4.5 prefill workers: an HPA may add them, a fixed pool of 4 has only its split.
    planner = Planner(CONFIG)
    advisory = planner.evaluate(_workers(2, 2), PREFILL_HEAVY, 0.0)
    assert advisory.desired == RoleCounts(5, 1)
    acting = Planner(CONFIG).evaluate(_workers(2, 2), PREFILL_HEAVY, 0.0, fixed_pool=True)
    assert acting.desired == acting.target == RoleCounts(3, 1)
    small = Planner(CONFIG).evaluate(_workers(2, 2), _traffic(1, prompt=100, output=10), 0.0, fixed_pool=True)
    assert small.desired == RoleCounts(1, 1)  # needs that fit are not padded up to the pool


# ---- what is decoding now ----------------------------------------------------------------------------------


def _decoding(address: str, num_requests: int, engine: int | None = None) -> WorkerView:
    load = Load(num_running=engine) if engine is not None else None
    return WorkerView(address, Role.DECODE, True, load, num_requests, decoding_requests=num_requests)


def test_decoding_sequences_are_decode_demand_before_they_end():
    # A decode-heavy load after a prefill-heavy one: what ended in the window is the prefill-heavy tail (long
    # prompts, two output tokens), while twelve streams share the one decode worker. They end only later (and a
    # saturated worker delivers no more than its throughput), so by the window alone decode needs 0.002 workers.
    workers = [*_workers(3, 0), _decoding("d0", 12, engine=12)]
    tail = _traffic(1, prompt=4000, output=2)
    estimate = Planner(CONFIG).estimate(workers, tail)
    assert estimate.decoding_sequences == 12 and estimate.decode_sequences == pytest.approx(5.0)  # 100 tok/s, 50 ms
    assert estimate.decode_need == pytest.approx(12 / 5.0)
    decision = Planner(CONFIG).evaluate(workers, tail, 0.0, fixed_pool=True)
    assert decision.desired.decode == 3
    assert decision.reason is DecisionReason.SWITCH and decision.target == RoleCounts(1, 3)
    assert (decision.switch.from_role, decision.switch.to_role) == (Role.PREFILL, Role.DECODE)
    assert "decoding=12/5" in decision.summary() and decision.to_json()["inputs"]["decoding_sequences"] == 12


def test_decoding_below_the_target_adds_nothing_to_the_rate():
    # In a steady state within the ITL target the sequences decoding are fewer than the rate term implies
    # (Little's law): 10 req/s of 200 tokens at 100 tok/s a worker is 20 workers, 5 sequences each.
    workers = [*_workers(1, 0), _decoding("d0", 40, engine=40)]
    assert Planner(CONFIG).estimate(workers, DECODE_HEAVY).decode_need == pytest.approx(10 * 200 / 100)


def test_the_engine_count_bounds_the_routers_decoding_requests():
    # The router counts a request from its Generate on, KV pull included; the engine counts it once it runs or
    # waits to (every router's). The smaller is what this router has decoding there.
    assert decoding_sequences([_decoding("d0", 12, engine=4), _decoding("d1", 3, engine=9)]) == 4 + 3
    assert decoding_sequences([_decoding("d0", 6)]) == 6  # no load reported yet: the router's count
    assert decoding_sequences(_workers(2, 0)) == 0


def test_nothing_ended_but_decoding_is_traffic():
    decision = Planner(CONFIG).evaluate([*_workers(3, 0), _decoding("d0", 12, engine=12)], TrafficStats(10.0), 0.0)
    assert decision.reason is DecisionReason.SWITCH and decision.target == RoleCounts(1, 3)
    assert Planner(CONFIG).evaluate(_workers(3, 1), TrafficStats(10.0), 0.0).reason is DecisionReason.NO_TRAFFIC


# ---- decisions --------------------------------------------------------------------------------------------


def test_prefill_heavy_traffic_moves_the_least_loaded_decode_worker():
    loads = {"d0": Load(num_running=5), "d1": Load(num_running=1)}
    decision = Planner(CONFIG).evaluate(_workers(2, 2, **loads), PREFILL_HEAVY, now_s=100.0)
    assert decision.reason is DecisionReason.SWITCH
    assert decision.current == RoleCounts(2, 2) and decision.target == RoleCounts(3, 1)
    assert (decision.switch.address, decision.switch.from_role, decision.switch.to_role) == \
        ("d1", Role.DECODE, Role.PREFILL)
    assert decision.desired.decode == 1 and decision.desired.prefill >= 4


def test_decode_heavy_traffic_moves_a_prefill_worker():
    decision = Planner(CONFIG).evaluate(_workers(3, 1), DECODE_HEAVY, now_s=0.0)
    assert decision.reason is DecisionReason.SWITCH and decision.target == RoleCounts(1, 3)
    assert decision.switch.from_role == Role.PREFILL and decision.switch.to_role == Role.DECODE


def test_at_least_one_worker_per_role():
    planner = Planner(CONFIG)
    assert planner.evaluate(_workers(1, 1), PREFILL_HEAVY, 0.0).reason is DecisionReason.BALANCED
    assert planner.evaluate(_workers(2, 1), PREFILL_HEAVY, 0.0).reason is DecisionReason.BALANCED
    assert planner.evaluate(_workers(0, 2), PREFILL_HEAVY, 0.0).reason is DecisionReason.TOO_FEW_WORKERS
    assert planner.evaluate(_workers(1, 0), PREFILL_HEAVY, 0.0).reason is DecisionReason.TOO_FEW_WORKERS


def test_no_traffic_changes_nothing():
    decision = Planner(CONFIG).evaluate(_workers(2, 2), TrafficStats(10.0), 0.0)
    assert decision.reason is DecisionReason.NO_TRAFFIC and decision.target == decision.current


def test_a_split_near_the_rounding_boundary_is_balanced():
    # Needs of about 1.03 prefill and 1.9 decode workers: of 4, the ideal prefill count is 1.4, which rounds
    # to 1 but is past the rounding boundary of the current 2 by less than the margin.
    planner = Planner(CONFIG)
    traffic = _traffic(10, prompt=1000, output=19)
    estimate = planner.estimate(_workers(2, 2), traffic)
    exact = split(4, estimate.prefill_need, estimate.decode_need)
    assert 1.25 < exact < 1.5
    assert planner.evaluate(_workers(2, 2), traffic, 0.0).reason is DecisionReason.BALANCED


def test_hysteresis_needs_the_same_change_in_a_row():
    planner = Planner(dataclasses.replace(CONFIG, hysteresis_evaluations=3))
    workers = _workers(2, 2)
    reasons = [planner.evaluate(workers, PREFILL_HEAVY, t).reason for t in (0, 10)]
    assert reasons == [DecisionReason.PENDING, DecisionReason.PENDING]
    # The other direction restarts the count; so does a balanced evaluation.
    assert planner.evaluate(workers, DECODE_HEAVY, 20).reason is DecisionReason.PENDING
    assert planner.evaluate(workers, PREFILL_HEAVY, 30).streak == 1
    assert planner.evaluate(workers, TrafficStats(10.0), 40).reason is DecisionReason.NO_TRAFFIC
    reasons = [planner.evaluate(workers, PREFILL_HEAVY, t).reason for t in (50, 60, 70)]
    assert reasons == [DecisionReason.PENDING, DecisionReason.PENDING, DecisionReason.SWITCH]


def test_minimum_dwell_between_switches():
    planner = Planner(dataclasses.replace(CONFIG, min_dwell_s=300.0))
    workers = _workers(2, 2)
    assert planner.evaluate(workers, PREFILL_HEAVY, 1000.0).reason is DecisionReason.SWITCH
    planner.record_switch(1000.0)
    assert planner.evaluate(workers, PREFILL_HEAVY, 1100.0).reason is DecisionReason.DWELL
    assert planner.evaluate(workers, PREFILL_HEAVY, 1299.0).reason is DecisionReason.DWELL
    assert planner.evaluate(workers, PREFILL_HEAVY, 1300.0).reason is DecisionReason.SWITCH


def test_one_switch_at_a_time():
    decision = Planner(CONFIG).evaluate(_workers(2, 2), PREFILL_HEAVY, 0.0, switch_in_progress=True)
    assert decision.reason is DecisionReason.SWITCH_IN_PROGRESS and decision.switch is None


def test_unavailable_workers_are_not_counted_or_moved():
    workers = _workers(2, 3)
    workers[2] = WorkerView("d0", Role.DECODE, False)  # draining or unhealthy
    decision = Planner(CONFIG).evaluate(workers, PREFILL_HEAVY, 0.0)
    assert decision.current == RoleCounts(2, 2)
    assert decision.switch.address != "d0"


def test_decision_json_and_summary_carry_the_inputs():
    decision = Planner(CONFIG).evaluate(_workers(2, 2), PREFILL_HEAVY, 0.0)
    body = decision.to_json()
    assert body["reason"] == "switch" and body["switch"]["to"] == "prefill"
    assert body["inputs"]["rate_rps"] == 10.0 and body["inputs"]["mean_prompt_tokens"] == 4000.0
    assert "rate=10.000/s" in decision.summary() and "switch d0 decode->prefill" in decision.summary()


# ---- the traffic window -----------------------------------------------------------------------------------


def test_traffic_window_rates_and_decode_samples():
    window = TrafficWindow(window_s=10.0)
    window.start(0.0)
    for i in range(10):  # ten requests on d0, each 11 tokens: from the second, 9 gaps over 0.45 s
        window.record(FinishedRequest(10.0 + i * 0.1, 100, 11, "d0", 0.45))
    window.record(FinishedRequest(10.5, 50, 1, "d1", 0.0))  # one token: no gap to measure
    # Two tokens: the only gap is the KV pull and the decode queue, not a decode step: not a sample.
    window.record(FinishedRequest(10.5, 50, 2, "d2", 0.0, num_decode_gaps=0))
    stats = window.stats(11.0)
    assert stats.num_requests == 12 and stats.rate_rps == pytest.approx(1.2)
    assert stats.mean_prompt_tokens == pytest.approx(1100 / 12)
    sample = stats.decode["d0"]
    assert sample.tokens_per_s == pytest.approx(11.0) and sample.itl_s == pytest.approx(0.05)
    assert sample.concurrency == pytest.approx(0.45)
    assert "d1" not in stats.decode and "d2" not in stats.decode
    assert window.stats(25.0).num_requests == 0  # all older than the window


def test_cached_prefixes_are_not_prefill_work():
    window = TrafficWindow(window_s=10.0)
    window.start(0.0)
    window.record(FinishedRequest(5.0, 1000, 10, num_cached_tokens=800))
    window.record(FinishedRequest(5.0, 100, 10, num_cached_tokens=200))  # more than the prompt: counts as all
    stats = window.stats(10.0)
    assert stats.mean_prompt_tokens == 550 and stats.mean_computed_prompt_tokens == 100
    estimate = Planner(CONFIG).estimate(_workers(1, 1), stats)
    assert estimate.mean_computed_prompt_tokens == 100
    assert estimate.prefill_need == pytest.approx(0.2 * 100 / estimate.prefill_capacity_tps)


def test_young_window_divides_by_its_age():
    window = TrafficWindow(window_s=60.0)
    window.start(0.0)
    window.record(FinishedRequest(4.0, 10, 10))
    assert window.stats(5.0).rate_rps == pytest.approx(1 / 5)


# ---- the router's loop ------------------------------------------------------------------------------------


def _policy(num_prefill: int, num_decode: int) -> PairingPolicy:
    policy = PairingPolicy()
    for role, n in ((Role.PREFILL, num_prefill), (Role.DECODE, num_decode)):
        addresses = [f"{role.value[0]}{i}:1" for i in range(n)]
        policy.set_addresses(role, addresses)
        for address in addresses:
            policy.mark_healthy(role, address, WorkerIdentity(f"e-{address}", role.value, "h"))
    return policy


def _loop(acting: bool, switcher=None) -> tuple[PlannerLoop, RouterMetrics]:
    policy = _policy(2, 2)
    metrics = RouterMetrics(policy)
    traffic = TrafficWindow(10.0)
    traffic.start(0.0)
    for _ in range(100):
        traffic.record(FinishedRequest(5.0, 4000, 2, "d0:1", 0.01))
    extra = {"switcher": switcher} if switcher is not None else {}
    loop = PlannerLoop(Planner(CONFIG), policy, traffic, metrics, acting=acting, clock=lambda: 10.0, **extra)
    return loop, metrics


def test_worker_views_count_a_decode_workers_requests_from_their_generate_on():
    policy = _policy(1, 1)
    assignment = policy.acquire(100)
    views = {(v.role, v.address): v for v in worker_views(policy, None)}
    assert views[(Role.DECODE, "d0:1")].outstanding_requests == 1
    assert views[(Role.DECODE, "d0:1")].decoding_requests == 0  # still prefilling
    policy.generate_sent(assignment)
    views = {(v.role, v.address): v for v in worker_views(policy, None)}
    assert views[(Role.DECODE, "d0:1")].decoding_requests == 1
    assert views[(Role.PREFILL, "p0:1")].decoding_requests == 0


def _sample(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels)


@pytest.mark.anyio
async def test_advisory_mode_exports_but_never_switches():
    calls = []

    async def switcher(address: str, role: Role) -> None:
        calls.append((address, role))

    loop, metrics = _loop(acting=False, switcher=switcher)
    decision = loop.step()
    await asyncio.sleep(0)
    assert decision.reason is DecisionReason.SWITCH and not calls and not loop.switching
    assert _sample(metrics, "pdserve_planner_desired_workers", role="decode") == 1
    assert _sample(metrics, "pdserve_planner_desired_workers", role="prefill") == decision.desired.prefill >= 4
    assert _sample(metrics, "pdserve_planner_target_workers", role="prefill") == 3
    acting, _ = _loop(acting=True, switcher=switcher)
    assert acting.evaluate().desired == RoleCounts(3, 1)  # a fixed pool: no more than its 4 workers
    assert _sample(metrics, "pdserve_planner_decisions_total", reason="switch") == 1


@pytest.mark.anyio
async def test_acting_mode_calls_the_switcher_once_at_a_time():
    calls, release = [], asyncio.Event()

    async def switcher(address: str, role: Role) -> None:
        calls.append((address, role))
        await release.wait()

    loop, metrics = _loop(acting=True, switcher=switcher)
    loop.step()
    await asyncio.sleep(0)
    assert calls == [("d0:1", Role.PREFILL)]  # equally idle: the first address
    assert loop.switching
    assert loop.step().reason is DecisionReason.SWITCH_IN_PROGRESS
    release.set()
    await asyncio.sleep(0.01)
    assert not loop.switching
    assert _sample(metrics, "pdserve_planner_switches_total", role="prefill", result="ok") == 1


@pytest.mark.anyio
async def test_acting_without_a_switcher_is_counted_as_unavailable():
    loop, metrics = _loop(acting=True)
    loop.step()
    await asyncio.sleep(0.01)
    assert _sample(metrics, "pdserve_planner_switches_total", role="prefill", result="unavailable") == 1
    assert issubclass(SwitchUnavailable, RuntimeError)


def test_router_flags_make_the_planner_config():
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    args = parser.parse_args(["router", "--decode", "d:1", "--role-planner", "--planner-slo-ttft-ms", "800",
                              "--planner-slo-itl-ms", "25", "--planner-hysteresis-evaluations", "5",
                              "--planner-min-dwell-s", "60", "--admin-without-api-key"])
    config = router_config_from_args(args)
    assert config.role_planner and config.admin_without_api_key
    planner = planner_config(config)
    assert (planner.slo_ttft_s, planner.slo_itl_s) == (0.8, 0.025)
    assert (planner.hysteresis_evaluations, planner.min_dwell_s) == (5, 60.0)
    defaults = router_config_from_args(parser.parse_args(["router", "--decode", "d:1"]))
    assert not defaults.role_planner and not defaults.admin_without_api_key  # advisory; admin closed without a key
    with pytest.raises(ValueError, match="planner_slo_itl_ms"):
        router_config_from_args(parser.parse_args(["router", "--decode", "d:1", "--planner-slo-itl-ms", "0"]))


@pytest.mark.anyio
async def test_a_switch_started_elsewhere_holds_the_planner():
    loop, _ = _loop(acting=True)
    loop.busy = lambda: True  # e.g. an operator's POST /admin/workers/{id}/role
    assert loop.step().reason is DecisionReason.SWITCH_IN_PROGRESS
