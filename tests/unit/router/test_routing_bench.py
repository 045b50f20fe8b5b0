"""The routing benchmark's workload generators and ideal, and the simulator's bookkeeping (no daemons)."""

from __future__ import annotations

import pytest

from bench import routing_sim as sim
from bench import routing_workloads as wl
from services.router.scoring import ScoringConfig


def test_shared_prefix_requests_share_their_groups_prefix_and_nothing_else() -> None:
    requests = wl.shared_prefix(40, 5.0, num_groups=3, prefix_len=20, question_len=6, output_len=2, seed=1)
    assert len(requests) == 40 and all(len(r.prompt) == 26 and r.shared_len == 20 for r in requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests) and requests[0].arrival_s == 0
    by_group = {}
    for r in requests:
        assert by_group.setdefault(r.group, r.prompt[:20]) == r.prompt[:20]
    assert len({p for p in by_group.values()}) == 3
    assert len({r.prompt[20:] for r in requests}) == 40  # every question its own
    assert wl.shared_prefix(40, 5.0, 3, 20, 6, 2, seed=1) == requests  # seeded


def test_zipf_skew_makes_the_first_group_the_hot_one() -> None:
    assert wl.zipf_weights(4, 0.0) == [0.25] * 4
    weights = wl.zipf_weights(4, 1.0)
    assert sum(weights) == pytest.approx(1.0) and weights == sorted(weights, reverse=True)
    assert weights[0] / weights[1] == pytest.approx(2.0)
    requests = wl.shared_prefix(400, float("inf"), 4, 8, 2, 1, skew=1.0, seed=0)
    counts = [sum(r.group == g for r in requests) for g in range(4)]
    assert counts[0] > counts[1] > counts[3] and all(r.arrival_s == 0 for r in requests)


def test_ideal_counts_each_groups_prefix_once_in_whole_blocks_and_never_the_last_token() -> None:
    assert wl.cacheable_tokens(20, 26, 8) == 16  # whole blocks of the shared part
    assert wl.cacheable_tokens(24, 24, 8) == 16  # the last token is always computed
    prefix = tuple(range(100, 120))
    requests = [wl.Request(0.0, prefix + (1, 2), 1, 0, 20), wl.Request(2.0, prefix + (3, 4), 1, 0, 20),
                wl.Request(1.0, tuple(range(200, 222)), 1, 1, 20), wl.Request(3.0, (5,) * 22, 1)]
    # per request in the given order: group 0's first computes, its second reuses 16; group 1's only one
    # computes; a request of no group shares nothing
    assert wl.ideal_cached_tokens(requests, 8) == [0, 16, 0, 0]


def test_multi_turn_prompts_carry_the_whole_history() -> None:
    (c,) = wl.multi_turn(1, 3, 1.0, system_len=10, message_len=4, output_len=2, think_s=0.5, seed=3)
    assert [len(m) for m in c.messages] == [14, 4, 4] and len(c.think_s) == 2 and all(t > 0 for t in c.think_s)
    second = wl.next_prompt(c.messages[0], (7, 8), c.messages[1])
    third = wl.next_prompt(second, (9, 9), c.messages[2])
    assert third[:len(second)] == second and len(third) == wl.max_prompt_len(c) == 14 + 2 + 4 + 2 + 4
    assert c.think_after(5) == 0.0


def test_length_mix_draws_from_the_mix() -> None:
    requests = wl.length_mix(30, 2.0, [(8, 1), (16, 2)], seed=0)
    assert {(len(r.prompt), r.output_len) for r in requests} == {(8, 1), (16, 2)}
    assert all(r.group is None for r in requests)


def test_pool_holds_its_share_of_prefixes_and_two_requests_tails() -> None:
    # 2 prefixes of 40 tokens (5 whole blocks each) + 2 x (2 blocks of 12 tokens' tail + 1)
    assert wl.pool_blocks(2, 40, 12, 8) == 2 * 5 + 2 * 3


def _small() -> sim.SimParams:
    return sim.SimParams(prefix_len=64, question_len=16, groups_per_worker=2, requests_per_worker=12,
                         conversations_per_worker=2, turns=3, system_len=32, message_len=16, output_len=8,
                         think_s=0.1, load=0.5)


def test_simulated_worker_caches_in_whole_blocks_evicts_lru_and_reports_events() -> None:
    costs = sim.Costs(prefill_tokens_per_s=1000.0, step_floor_s=0.01, max_batched_tokens=64)
    worker = sim.SimPrefill("w", capacity_blocks=3, block_size=8, costs=costs)
    first = sim.Job(0, sim.PromptKeys(tuple(range(100, 125))), 0.0, 0)  # 25 tokens: 3 whole blocks
    worker.enqueue(first, 0.0)
    duration_s, chunks = worker.step()
    assert chunks == [(first, 25)] and duration_s == pytest.approx(0.025)
    assert worker.finish_step(chunks, duration_s, duration_s) == [first] and first.cached_tokens == 0
    assert worker.load().prefill_tokens_per_s == pytest.approx(1000.0)  # as the engine measures it
    batch = worker.take_batch(duration_s)
    assert batch.first_seq == 1 and [len(e.block_keys) for e in batch.events] == [3]
    again = sim.Job(1, sim.PromptKeys(tuple(range(100, 124)) + (7, 7, 7, 7, 7, 7, 7, 7, 7)), 0.1, 16)
    worker.enqueue(again, 0.1)
    _, chunks = worker.step()
    assert chunks == [(again, 33 - 24)] and again.cached_tokens == 24  # three blocks hit, 9 tokens computed
    worker.finish_step(chunks, 0.2, 0.01)
    batch = worker.take_batch(0.2)  # one new block stored: 4 > 3, the least recently used one removed
    kinds = [(e.kind, len(e.block_keys)) for e in batch.events]
    assert batch.first_seq == 2 and kinds == [(0, 1), (1, 1)] and len(worker.cache) == 3
    # Freed tail first, as the engine frees a request's blocks: the prompt's last block goes before its first.
    assert batch.events[1].block_keys[0] == again.keys.keys(8, worker.salt)[3]
    assert list(worker.cache) == again.keys.keys(8, worker.salt)[2::-1]
    assert (worker.prompt_tokens, worker.computed_tokens) == (25 + 33, 25 + 9)


@pytest.mark.parametrize("policy", sim.POLICIES)
@pytest.mark.parametrize("workload", sim.WORKLOADS)
def test_every_policy_and_workload_runs_and_accounts_for_every_request(policy: str, workload: str) -> None:
    row = sim.run_one(4, workload, policy, _small(), sim.Costs(), ScoringConfig())
    expected = 4 * 12 if workload != "multi-turn" else 4 * 2 * 3
    assert row["requests"] == expected and 0 <= row["cached_tokens"] <= row["prompt_tokens"]
    assert row["cached_tokens"] <= row["ideal_tokens"]
    assert row["ttft_p50_ms"] >= sim.H100_STEP_FLOOR_S * 1e3 * 0.999 and row["ttft_p90_ms"] >= row["ttft_p50_ms"]
    assert sum(row["decisions"].values()) == expected


def test_kv_aware_finds_histories_through_the_events_it_was_fed() -> None:
    # wiring, not a quality bar: the index learns where each history is only from the simulated KV events
    rows = {p: sim.run_one(4, "multi-turn", p, _small(), sim.Costs(), ScoringConfig()) for p in sim.POLICIES}
    assert rows["kv-aware"]["of_ideal"] > 0.5 > rows["random"]["of_ideal"]
    assert rows["kv-aware"]["decisions"].get("prefix_hit", 0) > 0
