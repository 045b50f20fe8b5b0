"""Continuous-batching scheduler over the KV-cache manager (no torch, no model).

The "model" here is a pure function of the token prefix, so a request that is preempted and
recomputed must end with exactly the tokens it would have produced undisturbed.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.contract.sampling_params import SamplingParams
from services.engine.kv_cache.manager import KVCacheManager
from services.engine.request import Request, RequestStatus
from services.engine.sched.scheduler import Scheduler, SchedulerConfig
from services.engine.sched.scheduler_output import PLACEHOLDER_TOKEN, SchedulerOutput
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec

BS = 4


def make_sched(num_blocks: int = 64, groups: list[KVCacheGroupSpec] | None = None,
               pool_sizes: list[int] | None = None, prefix_caching: bool = True, **config) -> Scheduler:
    groups = groups or [KVCacheGroupSpec(0, AttentionKind.FULL, (0,), BS)]
    kv = KVCacheManager(groups, pool_sizes or [num_blocks] * len(groups), enable_prefix_caching=prefix_caching)
    config.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**config), kv)


def req(rid: str, prompt: list[int] | range, max_tokens: int = 4, hold: bool = False) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), hold_kv_on_finish=hold)


def next_token(tokens: list[int]) -> int:
    """A deterministic stand-in for the model: the next token depends only on the prefix."""
    return (sum(tokens) * 31 + len(tokens) * 7) % 97


def sample(out: SchedulerOutput) -> dict[str, tuple[int, float | None]]:
    return {c.request.request_id: (next_token(c.request.all_token_ids), -0.5)
            for c in out.chunks if c.samples}


def advance_and_resolve(sched: Scheduler, out: SchedulerOutput,
                        sampled: dict[str, tuple[int, float | None]]) -> list[Request]:
    """The engine's sequence for a step: ``advance`` once it is launched, ``resolve`` once its samples are in."""
    sched.advance(out)
    return sched.resolve(out, sampled)


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, fake the model, update, finish requests that hit max_tokens."""
    out = sched.schedule()
    update(sched, out)
    return out


def update(sched: Scheduler, out: SchedulerOutput) -> None:
    """Take in a step's (faked) samples and finish the requests that hit a length limit, as the engine does."""
    for r in advance_and_resolve(sched, out, sample(out)):
        if r.num_output_tokens >= r.sampling_params.max_tokens or r.num_tokens >= sched.config.max_model_len:
            sched.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> int:
    for steps in range(max_steps):
        if not sched.has_unfinished_requests():
            return steps
        step(sched)
    raise AssertionError("requests did not finish")


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def chunks_of(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in out.chunks]


def check_table(sched: Scheduler, r: Request, g: int) -> list[int]:
    """A live table: placeholders only as a leading run, and only where no coming query looks.

    Returns the table's real blocks.
    """
    manager, placeholder = sched.kv.managers[g], sched.kv.placeholder_block_id(g)
    table = r.block_ids[g]
    skipped = next((i for i, b in enumerate(table) if b != placeholder), len(table))
    real = table[skipped:]
    assert placeholder not in real, f"{r.request_id}: a placeholder after a block"
    assert len(set(real)) == len(real), f"{r.request_id} repeats a block"
    assert len(table) * manager.block_size >= r.num_computed_tokens
    # The next query sees keys from num_computed - W + 1 on (external KV: the pulled window).
    window_end = r.num_prompt_tokens if r.status is RequestStatus.WAITING_FOR_KV else r.num_computed_tokens + 1
    assert skipped <= manager.spec.first_needed_block(window_end)
    if manager.spec.sliding_window is None:
        assert skipped == 0
    # A sliding group holds a window plus one step's tokens, whatever the request's length.
    assert len(real) <= manager.max_blocks_held(r.num_tokens, sched.config.max_step_tokens)
    return real


def check_invariants(sched: Scheduler, requests: list[Request]) -> None:
    """Refcounts match the tables and holds that reference each block; tables cover the KV."""
    kv = sched.kv
    for g, manager in enumerate(kv.managers):
        pool, expected = manager.pool, Counter()
        for r in requests:
            held = kv.held_block_ids(r.request_id)
            if held is not None and sched.get_request(r.request_id) is r:
                assert held[g] == kv.real_blocks(g, r.block_ids[g])  # the table stays whole
                assert kv.placeholder_block_id(g) not in held[g]
                expected.update(held[g])
            elif not r.finished and r.block_ids:
                expected.update(check_table(sched, r, g))
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == [
            expected[b] for b in range(pool.num_blocks)]
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_free_blocks == sum(1 for b in range(pool.num_blocks) if pool.ref_count(b) == 0)
    for r in requests:
        if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            assert r.block_ids == [] and r.num_computed_tokens == 0
    assert sched.num_running + sched.num_waiting_for_kv <= sched.config.max_num_seqs


def assert_all_blocks_free(sched: Scheduler) -> None:
    for manager in sched.kv.managers:
        pool = manager.pool
        assert pool.num_free_blocks == pool.num_blocks
        assert sorted(pool.allocate(pool.num_blocks)) == list(range(pool.num_blocks))


# ---- configuration and admission -------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_model_len=8, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(max_model_len=0)
    with pytest.raises(ValueError, match="threshold"):
        SchedulerConfig(max_model_len=8, long_prefill_token_threshold=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=4096, enable_chunked_prefill=False, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="chunked"):
        SchedulerConfig(max_model_len=8, enable_chunked_prefill=False, long_prefill_token_threshold=4)
    with pytest.raises(ValueError, match="max_model_len"):
        make_sched(num_blocks=4, max_model_len=64)  # the pool holds 16 tokens


def test_add_request_rejects_bad_input_without_state_change():
    sched = make_sched(num_blocks=8, max_model_len=32)
    sched.add_request(req("a", range(4)))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(req("a", range(4)))
    with pytest.raises(ValueError, match="KV pool"):
        sched.add_request(req("b", range(33)))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(req("b", range(32)))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(req("b", []))
    started = req("b", range(4))
    started.num_computed_tokens = 2
    with pytest.raises(ValueError, match="not new"):
        sched.add_request(started)
    assert sched.num_waiting == 1 and sched.get_request("b") is None


# ---- batching --------------------------------------------------------------------------------


def test_chunked_prefill_across_steps_then_decode():
    sched = make_sched(max_num_batched_tokens=8)
    a, b = req("a", range(10), max_tokens=2), req("b", range(100, 106), max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    assert chunks_of(step(sched)) == [("a", 0, 8, False)]
    assert chunks_of(step(sched)) == [("a", 8, 2, True), ("b", 0, 6, True)]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    out = step(sched)
    assert chunks_of(out) == [("a", 10, 1, True), ("b", 6, 1, True)] and out.num_batched_tokens == 2
    assert a.finished and b.finished
    assert a.output_token_ids == reference_output(list(range(10)), 2)
    assert a.output_logprobs == [-0.5, -0.5]
    assert step(sched).finished_request_ids == ("a", "b")  # reported at the next schedule
    assert_all_blocks_free(sched)


def test_long_prefill_threshold_caps_one_request():
    sched = make_sched(max_num_batched_tokens=16, long_prefill_token_threshold=5)
    sched.add_request(req("a", range(12)))
    sched.add_request(req("b", range(100, 103)))
    assert chunks_of(step(sched)) == [("a", 0, 5, False), ("b", 0, 3, True)]


def test_a_final_chunk_cap_leaves_a_short_last_chunk_on_a_part_boundary():
    # Budget 16: a 45-token prompt would run 16, 16, 13; capped at 8 tokens on multiples of 4 the third chunk
    # stops at 40 (the last multiple of 4 leaving <= 8), and the fourth samples.
    sched = make_sched(max_num_batched_tokens=16)
    a = req("a", range(45), max_tokens=2)
    a.final_chunk_cap = (8, 4)
    sched.add_request(a)
    got = [chunks_of(step(sched))[0] for _ in range(4)]
    assert got == [("a", 0, 16, False), ("a", 16, 16, False), ("a", 32, 8, False), ("a", 40, 5, True)]
    assert a.output_token_ids[:1] == reference_output(list(range(45)), 1)
    # A prompt that fits one step keeps its one chunk; a last chunk already short enough is left alone; so is
    # one the alignment cannot shorten (the only boundary leaving <= 3 tokens would be past the prompt).
    for prompt_len, cap, expected in ((12, (8, 4), [12]), (40, (8, 4), [16, 16, 8]), (34, (3, 16), [16, 16, 2]),
                                      (36, (3, 16), [16, 16, 4])):
        sched = make_sched(max_num_batched_tokens=16)
        r = req("r", range(prompt_len), max_tokens=1)
        r.final_chunk_cap = cap
        sched.add_request(r)
        sizes = []
        while not r.finished:
            sizes += [c.num_tokens for c in step(sched).chunks]
        assert sizes == expected, (prompt_len, cap)


def test_without_chunking_a_prompt_that_does_not_fit_waits_in_line():
    sched = make_sched(max_num_batched_tokens=64, enable_chunked_prefill=False)
    sched.add_request(req("a", range(40), max_tokens=2))
    sched.add_request(req("b", range(100, 130), max_tokens=2))
    sched.add_request(req("c", range(3), max_tokens=2))  # would fit, but must not jump the line
    assert chunks_of(step(sched)) == [("a", 0, 40, True)]  # b (30) > 24 left: b and c wait
    assert chunks_of(step(sched)) == [("a", 40, 1, True), ("b", 0, 30, True), ("c", 0, 3, True)]
    run_to_completion(sched)
    assert_all_blocks_free(sched)


def test_max_num_seqs_limits_running():
    sched = make_sched(max_num_seqs=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", range(i, i + 3), max_tokens=2))
    assert [c[0] for c in chunks_of(step(sched))] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert [c[0] for c in chunks_of(step(sched))] == ["r0", "r1"]  # both finish here
    assert [c[0] for c in chunks_of(step(sched))] == ["r2"]


def test_prefix_hit_skips_cached_tokens():
    sched = make_sched()
    sched.add_request(req("a", range(10)))
    step(sched)
    b = req("b", list(range(8)) + [50, 51, 52])
    sched.add_request(b)
    assert chunks_of(step(sched))[-1] == ("b", 8, 3, True)
    assert b.num_cached_tokens == 8 and b.block_ids[0][:2] == sched.get_request("a").block_ids[0][:2]


def test_waiting_request_without_blocks_blocks_the_line():
    sched = make_sched(num_blocks=8, max_model_len=32)
    sched.add_request(req("a", range(20), max_tokens=8))  # 5 blocks, then grows
    step(sched)
    sched.add_request(req("b", range(100, 116)))  # needs 4 blocks, only 3 free
    sched.add_request(req("c", range(200, 202)))  # would fit
    out = step(sched)
    assert chunks_of(out) == [("a", 20, 1, True)]
    assert sched.num_waiting == 2


# ---- preemption --------------------------------------------------------------------------------


def test_preemption_recomputes_and_keeps_outputs():
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens each growing to 16 tokens.
    sched = make_sched(num_blocks=6, max_model_len=24)
    a, b = req("a", range(8), max_tokens=8), req("b", range(50, 58), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        out = step(sched)
        preempted += out.preempted_request_ids
        check_invariants(sched, [a, b])
    assert preempted and set(preempted) == {"b"}  # the newest request is the victim
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.output_token_ids == reference_output(list(range(8)), 8)
    assert b.output_token_ids == reference_output(list(range(50, 58)), 8)
    assert_all_blocks_free(sched)


def test_preempted_request_goes_to_the_front_and_recomputes_everything():
    sched = make_sched(num_blocks=6, max_model_len=24, max_num_seqs=2, prefix_caching=False)
    a, b = req("a", range(8), max_tokens=8), req("b", range(50, 58), max_tokens=8)
    c = req("c", range(3))  # waits for a seat, then behind the preempted b
    for r in (a, b, c):
        sched.add_request(r)
    while not b.num_preemptions:
        assert c.status is RequestStatus.WAITING
        out = step(sched)
    assert out.preempted_request_ids == ("b",) and b.status is RequestStatus.PREEMPTED
    assert b.block_ids == [] and b.num_computed_tokens == 0
    outputs_before = list(b.output_token_ids)
    while b.status is not RequestStatus.RUNNING:
        assert c.status is RequestStatus.WAITING  # c stays behind b
        out = step(sched)
    assert [ch[0] for ch in chunks_of(out)] == ["b", "c"]  # a finished the step before
    assert chunks_of(out)[0] == ("b", 0, 8 + len(outputs_before), True)  # prompt + outputs
    assert b.output_token_ids[:len(outputs_before)] == outputs_before
    run_to_completion(sched)
    assert b.output_token_ids == reference_output(list(range(50, 58)), 8)


def test_a_preempting_step_admits_nobody():
    # A small budget lets a 2-token chunk of the victim fit the blocks it just freed: it must
    # still wait for the next step rather than thrash within this one.
    sched = make_sched(num_blocks=6, max_model_len=24, max_num_batched_tokens=3, prefix_caching=False)
    a, b = req("a", range(8), max_tokens=8), req("b", range(50, 58), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    while not b.num_preemptions:
        running_before = {r.request_id for r in (a, b) if r.status is RequestStatus.RUNNING}
        out = step(sched)
    assert out.preempted_request_ids == ("b",)
    assert {c.request.request_id for c in out.chunks} <= running_before - {"b"}
    run_to_completion(sched)
    assert b.output_token_ids == reference_output(list(range(50, 58)), 8)


def test_a_lone_request_can_preempt_itself_and_waits_for_held_blocks():
    sched = make_sched(num_blocks=4, max_model_len=16)
    held = req("h", range(12), max_tokens=1, hold=True)
    sched.add_request(held)
    step(sched)
    assert held.finished and sched.num_held == 1 and sched.kv.stats()[0].num_held == 3
    a = req("a", range(20, 24), max_tokens=4)
    sched.add_request(a)
    step(sched)  # a prefills into the last free block
    out = step(sched)  # its 5th token needs a second block: nobody else to preempt
    assert out.preempted_request_ids == ("a",) and a.status is RequestStatus.PREEMPTED
    assert chunks_of(step(sched)) == []  # still no room: a waits
    assert sched.release_held("h") and not sched.release_held("h")
    run_to_completion(sched)
    assert a.output_token_ids == reference_output(list(range(20, 24)), 4)


# ---- update, finish, abort ---------------------------------------------------------------------


def test_update_requires_a_sample_and_skips_aborted_requests():
    sched = make_sched()
    a, b, c = req("a", range(5)), req("b", range(7)), req("c", range(9))
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    assert sched.abort_request("c")  # before the step is launched: advance skips it
    sched.advance(out)
    with pytest.raises(ValueError, match="no sampled token"):
        sched.resolve(out, {"a": (1, None)})
    with pytest.raises(ValueError, match="bad token"):
        sched.resolve(out, {"a": (1, None), "b": (-3, None)})
    assert a.output_token_ids == b.output_token_ids == [PLACEHOLDER_TOKEN]  # a refused result changes nothing
    assert sched.abort_request("b")  # while the step runs: resolve skips it
    assert sched.resolve(out, {"a": (1, None)}) == [a] and a.output_token_ids == [1]
    assert c.num_computed_tokens == 0 and c.output_token_ids == [] and c.block_ids == [] and b.block_ids == []
    assert sched.schedule().finished_request_ids == ("c", "b")


def test_finish_request_validates():
    sched = make_sched()
    sched.add_request(req("a", range(5)))
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_request("a", RequestStatus.RUNNING)
    with pytest.raises(ValueError, match="unknown"):
        sched.finish_request("zz", RequestStatus.FINISHED_STOPPED)


def test_hold_on_finish_keeps_blocks_until_released():
    sched = make_sched(num_blocks=8, max_model_len=32)
    a = req("a", range(9), max_tokens=1, hold=True)
    sched.add_request(a)
    step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH and a.block_ids == [[0, 1, 2]]
    assert sched.get_request("a") is a and not sched.has_unfinished_requests()
    assert sched.kv.pool(0).num_used_blocks == 3
    assert not sched.abort_request("a")  # finished: abort does not touch held blocks
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(req("a", range(3)))
    assert sched.release_held("a") and a.block_ids == []
    aborted = req("b", range(9), max_tokens=4, hold=True)
    sched.add_request(aborted)
    step(sched)
    assert sched.abort_request("b")  # an abort never holds: nobody will pull
    assert sched.num_held == 0 and aborted.block_ids == []
    assert_all_blocks_free(sched)


def test_abort_in_every_state():
    # Preempted and held requests: see test_abort_preempted_request and test_hold_on_finish_*.
    sched = make_sched(num_blocks=10, max_model_len=40, max_num_batched_tokens=8, max_num_seqs=3)
    decoding, chunking = req("decoding", range(4), max_tokens=20), req("chunking", range(100, 120))
    waiting = req("waiting", range(200, 204))
    for r in (decoding, chunking, waiting):
        sched.add_request(r)
    step(sched)
    external = req("external", range(300, 304))
    assert sched.pulls.allocate(external) is not None  # takes the last seat
    step(sched)
    assert decoding.num_output_tokens == 2 and 0 < chunking.num_computed_tokens < 20
    assert waiting.status is RequestStatus.WAITING and external.status is RequestStatus.WAITING_FOR_KV
    everyone = [decoding, chunking, waiting, external]
    for r in (waiting, chunking, external, decoding):
        assert sched.abort_request(r.request_id), r.request_id
        assert r.status is RequestStatus.FINISHED_ABORTED and r.block_ids == []
        check_invariants(sched, everyone)
    assert not sched.abort_request("decoding") and not sched.abort_request("nope")
    assert not sched.has_unfinished_requests()
    assert set(sched.schedule().finished_request_ids) == {r.request_id for r in everyone}
    assert_all_blocks_free(sched)


def test_abort_preempted_request():
    sched = make_sched(num_blocks=6, max_model_len=24)
    a, b = req("a", range(8), max_tokens=8), req("b", range(50, 58), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    while b.status is not RequestStatus.PREEMPTED:
        step(sched)
    assert sched.abort_request("b") and sched.num_waiting == 0
    run_to_completion(sched)
    assert_all_blocks_free(sched)


# ---- external KV -------------------------------------------------------------------------------


def test_external_kv_allocate_complete_and_decode():
    sched = make_sched(num_blocks=16)
    local = req("local", range(8))
    sched.add_request(local)
    step(sched)  # caches block 0 (tokens 0..3) and block 1 (4..7)
    remote = req("remote", list(range(8)) + [60, 61, 62, 63, 64, 65])
    tables = sched.pulls.allocate(remote)
    assert remote.status is RequestStatus.WAITING_FOR_KV and remote.num_cached_tokens == 8
    assert tables[0][:2] == local.block_ids[0][:2] and len(tables[0]) == 4
    assert sched.num_waiting_for_kv == 1
    assert all(c.request is not remote for c in step(sched).chunks)  # not schedulable yet
    with pytest.raises(ValueError, match="bad token"):
        sched.pulls.complete("remote", -1)
    sched.pulls.complete("remote", 7, -0.25)
    assert remote.status is RequestStatus.RUNNING and remote.output_token_ids == [7]
    assert remote.output_logprobs == [-0.25] and remote.num_computed_tokens == 14
    out = sched.schedule()
    assert ("remote", 14, 1, True) in chunks_of(out)
    with pytest.raises(ValueError, match="not waiting for KV"):
        sched.pulls.complete("remote", 7)
    advance_and_resolve(sched, out, sample(out))
    _, num_hit = sched.kv.get_computed_blocks(req("probe", list(remote.all_token_ids) + [1]))
    assert num_hit == 12  # the pulled blocks are in the prefix cache too


def test_external_kv_failure_falls_back_to_local_prefill():
    sched = make_sched(num_blocks=16)
    remote = req("remote", range(10), max_tokens=3)
    sched.add_request(req("first", range(50, 53), max_tokens=1))
    assert sched.pulls.allocate(remote) == [[0, 1, 2]]
    sched.add_request(req("later", range(70, 73), max_tokens=1))
    sched.pulls.fail("remote")
    assert remote.status is RequestStatus.WAITING and remote.block_ids == []
    assert remote.num_computed_tokens == 0 and remote.num_cached_tokens == 0
    out = sched.schedule()
    assert [c[0] for c in chunks_of(out)] == ["first", "remote", "later"]  # arrival order
    assert ("remote", 0, 10, True) in chunks_of(out)
    update(sched, out)
    run_to_completion(sched)
    assert remote.output_token_ids == reference_output(list(range(10)), 3)
    assert_all_blocks_free(sched)


def test_external_kv_allocation_is_check_then_act():
    sched = make_sched(num_blocks=4, max_model_len=16, max_num_seqs=2)
    big = req("big", range(12))
    assert sched.pulls.allocate(big) is not None
    before = ([sched.kv.pool(0).ref_count(b) for b in range(4)], sched.kv.pool(0).num_free_blocks)
    too_big = req("too_big", range(100, 108))
    assert sched.pulls.allocate(too_big) is None
    assert too_big.status is RequestStatus.WAITING and too_big.block_ids == []
    assert sched.get_request("too_big") is None
    assert ([sched.kv.pool(0).ref_count(b) for b in range(4)], sched.kv.pool(0).num_free_blocks) == before
    assert sched.pulls.allocate(req("small", range(3))) is not None
    assert sched.pulls.allocate(req("no_seat", range(2))) is None  # max_num_seqs reached
    with pytest.raises(ValueError, match="not waiting for KV"):
        sched.pulls.fail("nope")


# ---- randomized drive ----------------------------------------------------------------------------


SHARED_PREFIX = [5, 9, 2, 7, 5, 1, 8, 8, 3, 6, 4, 4, 9, 0, 2, 7]


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / finish / abort / external / hold sequences; invariants after each."""

    POOL_SIZES = [11, 22]  # full group (blocks of 4), sliding group (blocks of 2, window 6)
    MAX_NUM_BATCHED_TOKENS = 12

    def __init__(self) -> None:
        super().__init__()
        groups = [KVCacheGroupSpec(0, AttentionKind.FULL, (0,), 4),
                  KVCacheGroupSpec(1, AttentionKind.SLIDING_WINDOW, (1,), 2, sliding_window=6)]
        self.sched = make_sched(groups=groups, pool_sizes=self.POOL_SIZES, max_model_len=40, max_num_seqs=4,
                                max_num_batched_tokens=self.MAX_NUM_BATCHED_TOKENS)
        self.requests: list[Request] = []
        self.expected: dict[str, list[int]] = {}

    def _new(self, prompt: list[int], max_tokens: int, hold: bool) -> Request:
        r = req(f"r{len(self.requests)}", prompt, max_tokens=min(max_tokens, 39 - len(prompt)), hold=hold)
        self.requests.append(r)
        self.expected[r.request_id] = reference_output(prompt, r.sampling_params.max_tokens)
        return r

    @rule(shared=st.integers(0, 16), tail=st.lists(st.integers(0, 3), min_size=1, max_size=14),
          max_tokens=st.integers(1, 12), hold=st.booleans())
    def add(self, shared: int, tail: list[int], max_tokens: int, hold: bool) -> None:
        self.sched.add_request(self._new(SHARED_PREFIX[:shared] + tail, max_tokens, hold))

    @rule(shared=st.integers(0, 16), tail=st.lists(st.integers(0, 3), min_size=1, max_size=4),
          max_tokens=st.integers(1, 6))
    def external(self, shared: int, tail: list[int], max_tokens: int) -> None:
        r = self._new(SHARED_PREFIX[:shared] + tail, max_tokens, False)
        if self.sched.pulls.allocate(r) is None:
            self.requests.remove(r)

    @rule(data=st.data(), ok=st.booleans())
    def finish_external(self, data: st.DataObject, ok: bool) -> None:
        pending = [r for r in self.requests if r.status is RequestStatus.WAITING_FOR_KV]
        if not pending:
            return
        r = data.draw(st.sampled_from(pending))
        if ok:
            self.sched.pulls.complete(r.request_id, next_token(r.prompt_token_ids))
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                self.sched.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        else:
            self.sched.pulls.fail(r.request_id)

    @rule(n=st.integers(1, 6))
    def steps(self, n: int) -> None:
        for _ in range(n):
            step(self.sched)
            check_invariants(self.sched, self.requests)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if self.requests:
            r = data.draw(st.sampled_from(self.requests))
            was_live = not r.finished
            assert self.sched.abort_request(r.request_id) == was_live

    @rule(data=st.data())
    def stop_early(self, data: st.DataObject) -> None:
        running = [r for r in self.requests if r.status is RequestStatus.RUNNING and r.output_token_ids]
        if running:
            r = data.draw(st.sampled_from(running))
            self.sched.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)

    @precondition(lambda self: self.sched.num_held > 0)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held = [r for r in self.requests if self.sched.kv.held_block_ids(r.request_id) is not None]
        assert self.sched.release_held(data.draw(st.sampled_from(held)).request_id)

    @invariant()
    def consistent(self) -> None:
        check_invariants(self.sched, self.requests)

    def teardown(self) -> None:
        for r in self.requests:
            if r.status is RequestStatus.WAITING_FOR_KV:
                self.sched.pulls.fail(r.request_id)
        for _ in range(2000):  # drive to completion; release holds as a finished pull would
            for r in self.requests:
                self.sched.release_held(r.request_id)
            if not self.sched.has_unfinished_requests():
                break
            step(self.sched)
            check_invariants(self.sched, self.requests)
        for r in self.requests:
            assert r.finished
            if r.status is RequestStatus.FINISHED_LENGTH:
                assert r.output_token_ids == self.expected[r.request_id]
            else:
                assert r.output_token_ids == self.expected[r.request_id][:r.num_output_tokens]
        assert self.sched.num_held == 0
        assert_all_blocks_free(self.sched)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


class TightWindowMachine(SchedulerMachine):
    """The sliding pool holds 16 tokens, less than one request of max_model_len (40): only freeing
    out-of-window blocks lets requests finish, and preemption must count the freed blocks."""

    POOL_SIZES = [11, 8]
    MAX_NUM_BATCHED_TOKENS = 4  # one step's tokens + the window: (6 - 2 + 4) // 2 + 2 = 6 blocks


TestTightWindowMachine = TightWindowMachine.TestCase
TestTightWindowMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


def test_random_workload_drains_cleanly():
    rng = random.Random(7)
    sched = make_sched(num_blocks=24, max_model_len=48, max_num_seqs=6, max_num_batched_tokens=16)
    requests = []
    prefixes = [[rng.randint(0, 50) for _ in range(16)] for _ in range(3)]
    for i in range(60):
        prompt = rng.choice(prefixes)[:rng.randint(0, 16)] + [rng.randint(0, 50) for _ in range(rng.randint(1, 14))]
        r = req(f"r{i}", prompt, max_tokens=rng.randint(1, 12))
        sched.add_request(r)
        requests.append(r)
        for _ in range(rng.randint(0, 3)):
            step(sched)
            check_invariants(sched, requests)
    run_to_completion(sched)
    check_invariants(sched, requests)
    for r in requests:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params.max_tokens)
    assert sum(r.num_preemptions for r in requests) > 0
    assert sum(r.num_cached_tokens for r in requests) > 0
    assert_all_blocks_free(sched)
