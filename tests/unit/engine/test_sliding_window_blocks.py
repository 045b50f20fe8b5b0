"""Sliding-window KV groups give back out-of-window blocks (placeholders in the tables), and the
prefix cache stays correct with a full-attention and a sliding-window group side by side.

Manager level (no torch), scheduler level (a fake model), and engine level: a tiny hybrid model
with dummy weights whose greedy tokens and logits must not change when freeing is turned off.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from services.contract.prefix_keys import hash_request_blocks
from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.kv_cache.group_managers import FullAttentionManager, SlidingWindowManager
from services.engine.kv_cache.manager import KVCacheManager
from services.engine.llm_engine import LLMEngine
from services.engine.loading.source import ModelSource
from services.engine.model_config.hf import LayerSpec, preset
from services.engine.request import Request, RequestStatus
from services.engine.sched.scheduler import Scheduler
from services.kv.plan.planner import apply_plan, plan_transfer
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import LayoutKind
from services.kv.spec.topology import RankRead, map_blocks, window_start_token
from tests.unit.engine.test_scheduler import (
    advance_and_resolve,
    check_invariants,
    make_sched,
    reference_output,
    run_to_completion,
    step,
)

BS, W = 4, 8


def sliding(group_id: int = 0, block_size: int = BS, window: int = W) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(group_id, AttentionKind.SLIDING_WINDOW, (group_id,), block_size, sliding_window=window)


def full(group_id: int = 0, block_size: int = BS) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(group_id, AttentionKind.FULL, (group_id,), block_size)


def hybrid(full_blocks: int = 32, sliding_blocks: int = 16, sliding_block_size: int = BS, **kwargs) -> KVCacheManager:
    """Group 0 full attention, group 1 sliding window."""
    return KVCacheManager([full(0), sliding(1, sliding_block_size)], [full_blocks, sliding_blocks], **kwargs)


def req(rid: str, tokens: list[int] | range) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def compute(kv: KVCacheManager, r: Request, num_tokens: int) -> list[list[int]] | None:
    """Allocate and 'run' the next ``num_tokens`` tokens, then publish them, as the scheduler does."""
    new = kv.allocate_slots(r, num_tokens)
    if new is not None:
        r.num_computed_tokens += num_tokens
        kv.cache_full_blocks(r, r.num_computed_tokens)
    return new


def decode(kv: KVCacheManager, r: Request, num_steps: int) -> None:
    for _ in range(num_steps):
        r.output_token_ids.append(len(r.output_token_ids) % 50)
        assert compute(kv, r, 1) is not None


def split(kv: KVCacheManager, g: int, table: list[int]) -> tuple[int, list[int]]:
    """(leading placeholders, real blocks) of a table, checking placeholders only lead."""
    placeholder = kv.placeholder_block_id(g)
    k = next((i for i, b in enumerate(table) if b != placeholder), len(table))
    assert placeholder not in table[k:]
    return k, table[k:]


def kv_state(kv: KVCacheManager, *requests: Request) -> tuple:
    pools = tuple((list(m.pool._ref_counts), list(m.pool._hashes), list(m.pool._evictable), m.pool.num_free_blocks)
                  for m in kv.managers)
    return (pools, copy.deepcopy(kv._cursors), copy.deepcopy(kv._held),
            [([list(t) for t in r.block_ids], r.num_computed_tokens) for r in requests])


def publish(kv: KVCacheManager, g: int, tokens: list[int], indices: list[int]) -> list[int]:
    """Put cached-free blocks holding blocks ``indices`` of ``tokens`` in group g's pool."""
    pool, bs = kv.pool(g), kv.managers[g].block_size
    hashes = hash_request_blocks(tokens, bs, kv.cache_salt)
    blocks = []
    for i in indices:
        (block,) = pool.allocate(1)
        pool.cache_block(block, hashes[i])
        blocks.append(block)
    pool.free(blocks)
    return blocks


# ---- freeing ------------------------------------------------------------------------------------


def test_decode_frees_blocks_that_leave_the_window():
    kv = KVCacheManager([sliding()], [16])
    r = req("a", range(10))
    assert compute(kv, r, 10) == [[0, 1, 2]]  # the first query (position 0) sees everything
    placeholder = kv.placeholder_block_id(0)
    assert placeholder == 16 == kv.pool(0).num_blocks
    for _ in range(50):
        decode(kv, r, 1)
        table = r.block_ids[0]
        k, real = split(kv, 0, table)
        # Freed when the step's query (position num_computed - 1) was scheduled: it saw keys from
        # num_computed - W on; blocks wholly before them are placeholders.
        assert k == sliding().first_needed_block(r.num_computed_tokens)
        assert len(table) == -(-r.num_computed_tokens // BS)
        assert len(real) <= -(-W // BS) + 1
        assert kv.pool(0).num_used_blocks == len(real) and kv.stats()[0].num_used == len(real)
    assert len(r.block_ids[0]) == 15 and k >= 12


def test_chunked_prefill_frees_between_chunks_and_fits_a_small_pool():
    # 40 tokens need 10 blocks of 4; chunks of 8 with a window of 8 never hold more than 5.
    kv = KVCacheManager([sliding()], [5])
    assert kv.can_ever_fit(40, max_step_tokens=8) and not kv.can_ever_fit(40)
    assert kv.managers[0].max_blocks_held(40, 8) == 5
    r = req("a", range(40))
    for start in range(0, 40, 8):
        assert compute(kv, r, 8) is not None, start
        k, real = split(kv, 0, r.block_ids[0])
        assert k == sliding().first_needed_block(start + 1)
        assert len(real) <= 5
    assert r.block_ids[0][:6] == [5] * 6 and len(r.block_ids[0]) == 10


def test_a_failed_allocation_frees_nothing_and_freed_blocks_count_as_free():
    kv = hybrid(full_blocks=5, sliding_blocks=4)
    r = req("a", range(16))
    compute(kv, r, 16)
    decode(kv, r, 3)  # 19 computed: the next query (19) sees 12..19, sliding blocks 0..2 are out
    # Growing to 21 tokens needs a 6th full block: nothing may change, not even the due frees.
    r.output_token_ids += [7, 7]
    before = kv_state(kv, r)
    assert not kv.can_allocate(r, 2)
    assert kv.allocate_slots(r, 2) is None
    assert kv_state(kv, r) == before

    kv = hybrid(full_blocks=8, sliding_blocks=3)
    r = req("a", range(12))
    compute(kv, r, 12)  # sliding blocks 0..2: the pool is full
    r.output_token_ids.append(1)
    assert kv.pool(1).num_free_blocks == 0
    # The query at 12 sees 5..12: block 0 goes back, and the new block 3 takes its place.
    assert kv.can_allocate(r, 1)
    assert kv.allocate_slots(r, 1) == [[3], [0]]
    assert r.block_ids[1] == [kv.placeholder_block_id(1), 1, 2, 0]


def test_out_of_window_blocks_stay_cached_for_prefix_hits():
    kv = hybrid()
    r = req("a", range(24))
    compute(kv, r, 24)
    decode(kv, r, 6)  # 30 computed: sliding blocks 0..4 freed, still cached
    assert split(kv, 1, r.block_ids[1])[0] == 5
    pool = kv.pool(1)
    assert pool.num_evictable_blocks == 5 and pool.num_cached_blocks == 7
    b = req("b", list(r.all_token_ids[:28]) + [99])
    computed, num_hit = kv.get_computed_blocks(b)
    # Hit of 28: the query at 28 sees 21..28, so sliding blocks 5 and 6 are needed, 0..4 are not.
    assert num_hit == 28
    assert computed[0] == r.block_ids[0][:7]
    assert computed[1] == [16] * 5 + r.block_ids[1][5:7]
    new = kv.allocate_slots(b, 1, computed)
    assert new is not None and [len(x) for x in new] == [1, 1]
    assert b.block_ids[1][:7] == computed[1] and len(b.block_ids[1]) == 8
    assert [pool.ref_count(x) for x in r.block_ids[1][5:7]] == [2, 2]  # shared, referenced once more
    assert all(pool.ref_count(x) == 0 for x in range(pool.num_blocks) if x not in
               kv.real_blocks(1, r.block_ids[1]) + kv.real_blocks(1, b.block_ids[1]))


# ---- placeholders: free, preempt, abort, hold ------------------------------------------------------


def test_placeholders_are_never_freed_held_or_counted():
    kv = hybrid()
    r = req("a", range(20))
    compute(kv, r, 20)
    decode(kv, r, 5)
    k, real = split(kv, 1, r.block_ids[1])
    assert k == 4 and len(real) == 3
    tables = [list(t) for t in r.block_ids]
    kv.hold(r)
    assert r.block_ids == tables  # still from token 0, placeholders included: the ticket lists it
    assert kv.held_block_ids("a") == [tables[0], real]
    assert [s.num_held for s in kv.stats()] == [7, 3]
    assert kv.pool(1).num_used_blocks == 3
    with pytest.raises(ValueError, match="held"):
        kv.free(r)
    assert kv.release("a") and not kv.release("a")
    assert [s.num_free for s in kv.stats()] == [32, 16] and [s.num_held for s in kv.stats()] == [0, 0]


def test_free_twice_and_reallocate_after_preemption():
    kv = hybrid(sliding_blocks=4)
    r = req("a", range(20))
    for _ in range(5):
        assert compute(kv, r, 4) is not None  # 20 tokens at once would need 5 sliding blocks
    decode(kv, r, 9)  # 29 computed
    assert split(kv, 1, r.block_ids[1])[0] == 5
    kv.free(r)  # a preemption
    kv.free(r)  # nothing left: no error, nothing freed twice
    assert r.block_ids == [] and [s.num_free for s in kv.stats()] == [32, 4]
    r.num_computed_tokens = 0
    for start in range(0, r.num_tokens, 4):  # recomputed in chunks, through the placeholders again
        assert compute(kv, r, min(4, r.num_tokens - start)) is not None
    assert split(kv, 1, r.block_ids[1])[0] == sliding().first_needed_block(28 + 1)  # last chunk: 28
    kv.free(r)
    assert [s.num_free for s in kv.stats()] == [32, 4]


def test_scheduler_hold_release_and_abort_with_placeholders():
    groups = [full(0), sliding(1, 2, 6)]
    sched = make_sched(groups=groups, pool_sizes=[24, 12], max_model_len=48, max_num_batched_tokens=6)
    a = Request("a", list(range(30)), SamplingParams(max_tokens=15))
    h = Request("h", list(range(50, 70)), SamplingParams(max_tokens=1), hold_kv_on_finish=True)
    sched.add_request(a)
    sched.add_request(h)
    while not h.finished:
        step(sched)
        check_invariants(sched, [a, h])
    placeholder = sched.kv.placeholder_block_id(1)
    # Held: the table still runs from token 0 (placeholders first), only real blocks are pinned.
    # h ran in chunks of 5 beside a's decodes; the last, from 15, saw keys 10.. (blocks 5..9).
    assert h.block_ids[1][:5] == [placeholder] * 5 and len(h.block_ids[1]) == 10
    assert sched.kv.held_block_ids("h") == [h.block_ids[0], h.block_ids[1][5:]]
    assert [s.num_held for s in sched.kv.stats()] == [5, 5]
    step(sched)
    check_invariants(sched, [a, h])
    assert a.status is RequestStatus.RUNNING and a.block_ids[1][0] == placeholder
    assert sched.abort_request("a") and a.block_ids == []
    assert sched.release_held("h") and h.block_ids == []
    check_invariants(sched, [a, h])
    for m in sched.kv.managers:
        assert m.pool.num_free_blocks == m.pool.num_blocks


def test_scheduler_preempts_a_request_with_placeholders_and_recomputes_it():
    # The full pool (10 blocks of 4) cannot hold both requests at 32 tokens: the newer one goes.
    groups = [full(0), sliding(1, 2, 6)]
    sched = make_sched(groups=groups, pool_sizes=[10, 12], max_model_len=40, max_num_batched_tokens=8)
    a = Request("a", list(range(8)), SamplingParams(max_tokens=24))
    b = Request("b", list(range(50, 58)), SamplingParams(max_tokens=24))
    sched.add_request(a)
    sched.add_request(b)
    placeholders_at_preemption = []
    for _ in range(300):
        if not sched.has_unfinished_requests():
            break
        had = sched.kv.placeholder_block_id(1) in (b.block_ids[1] if b.block_ids else [])
        out = step(sched)
        if out.preempted_request_ids:
            placeholders_at_preemption.append(had)
        check_invariants(sched, [a, b])
    assert b.num_preemptions and any(placeholders_at_preemption)
    assert a.output_token_ids == reference_output(list(range(8)), 24)
    assert b.output_token_ids == reference_output(list(range(50, 58)), 24)
    for m in sched.kv.managers:
        assert m.pool.num_free_blocks == m.pool.num_blocks


def test_long_requests_run_in_a_sliding_pool_smaller_than_one_request():
    # Sliding group: 7 blocks of 2 tokens = 14 tokens for requests of up to 60 tokens, two at once.
    groups = [full(0), sliding(1, 2, 4)]
    sched = make_sched(groups=groups, pool_sizes=[40, 7], max_model_len=64, max_num_batched_tokens=4)
    requests = [Request(f"r{i}", list(range(i, i + 30)), SamplingParams(max_tokens=30)) for i in range(2)]
    for r in requests:
        sched.add_request(r)
    peak = 0
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = step(sched)
        assert not out.preempted_request_ids  # the freed blocks are counted before preempting
        check_invariants(sched, requests)
        peak = max(peak, sched.kv.pool(1).num_used_blocks)
    assert all(r.output_token_ids == reference_output(r.prompt_token_ids, 30) for r in requests)
    assert peak <= 7


# ---- prefix hits with a full and a sliding group ----------------------------------------------------


def test_hit_needs_the_window_blocks_only():
    kv = hybrid()
    tokens = list(range(100, 141))  # 41 tokens: hits up to 40
    publish(kv, 0, tokens, list(range(10)))
    b = req("b", tokens)
    # Sliding blocks 8, 9 cover the window of the query at 40 (keys 33..40).
    publish(kv, 1, tokens, [8, 9])
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 40 and computed[1][:8] == [16] * 8 and None not in computed[1]
    assert computed[1][8:] == [kv.pool(1).lookup(h) for h in hash_request_blocks(tokens, BS)[8:10]]
    assert kv.allocate_slots(b, 1, computed) is not None
    assert [kv.pool(1).ref_count(x) for x in computed[1][8:]] == [1, 1]
    assert b.block_ids[1][:10] == computed[1] and len(b.block_ids[1]) == 11


def test_hit_is_the_longest_length_valid_in_every_group():
    tokens = list(range(200, 241))
    kv = hybrid()
    publish(kv, 0, tokens, list(range(10)))
    publish(kv, 1, tokens, [5, 6, 7, 8])  # 9 missing: 40 (needs 8, 9) fails, 36 (needs 7, 8) holds
    computed, num_hit = kv.get_computed_blocks(req("b", tokens))
    assert num_hit == 36 and computed[1][:7] == [16] * 7 and len(computed[1]) == 9

    kv = hybrid()
    publish(kv, 0, tokens, list(range(6)))  # the full group stops the hit at 24
    publish(kv, 1, tokens, list(range(4, 10)))
    computed, num_hit = kv.get_computed_blocks(req("b", tokens))
    assert num_hit == 24 and len(computed[0]) == 6 and computed[1][:4] == [16] * 4

    kv = hybrid()
    publish(kv, 0, tokens, list(range(10)))
    publish(kv, 1, tokens, [0, 1, 3, 5, 7, 9])  # no two consecutive past 1: only 8 (needs 0..1)
    assert kv.get_computed_blocks(req("b", tokens))[1] == 8

    kv = hybrid()
    publish(kv, 0, tokens, list(range(10)))
    publish(kv, 1, tokens, [2, 4, 6, 8])
    assert kv.get_computed_blocks(req("b", tokens)) == ([[], []], 0)


def test_hit_with_different_block_sizes():
    # Full blocks of 4, sliding blocks of 8 (window 8): hits are multiples of 8.
    tokens = list(range(300, 341))
    kv = hybrid(sliding_block_size=8)
    publish(kv, 0, tokens, list(range(10)))
    publish(kv, 1, tokens, [3, 4])
    computed, num_hit = kv.get_computed_blocks(req("b", tokens))
    # 40: the query at 40 sees 33..40, sliding block 4 (32..39) only; block 3 is not needed.
    assert num_hit == 40 and len(computed[0]) == 10 and computed[1][:4] == [16] * 4 and 16 not in computed[1][4:]
    kv = hybrid(sliding_block_size=8)
    publish(kv, 0, tokens, list(range(9)))  # full stops at 36 -> cut to 32: sliding needs block 3
    publish(kv, 1, tokens, [4])
    assert kv.get_computed_blocks(req("b", tokens))[1] == 0


def test_allocate_checks_placeholder_hits():
    kv = hybrid()
    tokens = list(range(41))
    publish(kv, 0, tokens, list(range(10)))
    blocks = publish(kv, 1, tokens, [7, 8, 9])
    r = req("r", tokens)
    full_hit = [kv.pool(0).lookup(h) for h in hash_request_blocks(tokens, BS)[:10]]
    with pytest.raises(ValueError, match="window needs"):  # block 8 is in the window of query 40
        kv.allocate_slots(r, 1, [full_hit, [16] * 9 + [blocks[2]]])
    with pytest.raises(ValueError, match="window needs"):  # a placeholder after a block
        kv.allocate_slots(r, 1, [full_hit, [16] * 7 + [blocks[0], 16, blocks[2]]])
    with pytest.raises(ValueError, match="window needs"):  # full attention has no placeholders
        kv.allocate_slots(r, 1, [[32] + full_hit[1:], [16] * 8 + blocks[1:]])
    assert r.block_ids == []
    assert kv.allocate_slots(r, 1, [full_hit, [16] * 7 + blocks]) is not None  # a longer window: fine


def test_cache_full_blocks_skips_placeholders_and_keeps_the_chain():
    kv = hybrid()
    a = req("a", range(33))
    for _ in range(0, 32, 8):
        compute(kv, a, 8)
    compute(kv, a, 1)
    assert split(kv, 1, a.block_ids[1])[0] == 6
    kv.reset_prefix_cache()  # republish everything: placeholder slots are hashed, not published
    kv.cache_full_blocks(a, a.num_computed_tokens)
    hashes = hash_request_blocks(a.all_token_ids, BS)
    assert [kv.pool(1).lookup(h) for h in hashes] == [None] * 6 + a.block_ids[1][6:8]
    assert [kv.pool(0).lookup(h) for h in hashes] == a.block_ids[0][:8]


# ---- external KV (decode worker) ----------------------------------------------------------------


def test_external_reserve_holds_only_the_pulled_window():
    groups = [full(0), sliding(1)]
    sched = make_sched(groups=groups, pool_sizes=[32, 16], max_model_len=48)
    r = Request("r", list(range(30)), SamplingParams(max_tokens=4))
    tables = sched.pulls.allocate(r)
    placeholder = sched.kv.placeholder_block_id(1)
    # N = 30: the transfer moves the sliding group from window_start_token = 20 (block 5) on.
    first = window_start_token(groups[1], groups[1], 30) // BS
    assert first == 5 == groups[1].first_needed_block(30)
    assert tables[1] == [placeholder] * 5 + [0, 1, 2] and tables[0] == list(range(8))
    assert sched.kv.pool(1).num_used_blocks == 3
    check_invariants(sched, [r])
    sched.pulls.complete("r", 3)
    # Block 5 (tokens 20..23) starts before N - W = 22: maybe partly pulled from a freed slot of a
    # coarser-blocked owner, so never published; blocks 6 on are.
    assert sched.kv.pool(1).block_hash(tables[1][5]) is None
    assert sched.kv.pool(1).block_hash(tables[1][6]) is not None
    out = sched.schedule()
    advance_and_resolve(sched, out, {"r": (5, None)})  # query at 30 sees 23..30: block 5 stays
    assert r.block_ids[1][5] == 0
    sched.schedule()  # the query at 31 sees 24..31: block 5 goes
    assert r.block_ids[1][:6] == [placeholder] * 6
    check_invariants(sched, [r])


def test_external_reserve_with_a_local_hit():
    groups = [full(0), sliding(1)]
    sched = make_sched(groups=groups, pool_sizes=[32, 16], max_model_len=48)
    local = Request("local", list(range(25)), SamplingParams(max_tokens=1))
    sched.add_request(local)
    step(sched)  # computes and publishes 0..24 (full blocks 0..5 in both groups)
    r = Request("r", list(range(24)) + [90] * 6, SamplingParams(max_tokens=4))
    tables = sched.pulls.allocate(r)
    placeholder = sched.kv.placeholder_block_id(1)
    # Local hit of 24 (query 24 needs sliding blocks 4..5); the pull's window starts at block 5.
    assert r.num_cached_tokens == 24
    assert tables[1][:5] == [placeholder] * 5 and len(tables[1]) == 8
    # The hit's block 4 is before the pulled window: left as a placeholder, not referenced.
    assert tables[1][5] == sched.kv.pool(1).lookup(hash_request_blocks(r.prompt_token_ids, BS)[5])
    check_invariants(sched, [local, r])
    sched.pulls.fail("r")
    assert r.block_ids == [] and r.status is RequestStatus.WAITING
    run_to_completion(sched)
    assert r.output_token_ids == reference_output(r.prompt_token_ids, 4)
    for m in sched.kv.managers:
        assert m.pool.num_free_blocks == m.pool.num_blocks


# ---- freeing disabled ---------------------------------------------------------------------------


def test_free_out_of_window_false_keeps_every_block():
    kv = hybrid(free_out_of_window=False)
    assert type(kv.managers[1]) is FullAttentionManager
    assert isinstance(hybrid().managers[1], SlidingWindowManager)
    r = req("a", range(20))
    compute(kv, r, 20)
    decode(kv, r, 20)
    assert kv.placeholder_block_id(1) not in r.block_ids[1] and len(r.block_ids[1]) == 10
    computed, num_hit = kv.get_computed_blocks(req("b", list(r.all_token_ids) + [1]))
    assert num_hit == 40 and computed[1] == r.block_ids[1]
    assert not kv.can_ever_fit(80, max_step_tokens=4)


# ---- engine ---------------------------------------------------------------------------------------


ENGINE_WINDOW, ENGINE_BLOCK, ENGINE_CHUNK = 32, 16, 16


def _hybrid_source() -> ModelSource:
    """The tiny preset with four layers, sliding (window 32) and full attention alternating."""
    base = preset("tiny")
    s = LayerSpec(AttentionKind.SLIDING_WINDOW, base.num_kv_heads, base.head_dim, base.rope, ENGINE_WINDOW)
    f = LayerSpec(AttentionKind.FULL, base.num_kv_heads, base.head_dim, base.rope)
    config = dataclasses.replace(base, num_layers=4, layers=(s, f, s, f))
    return ModelSource(name="tiny-hybrid", kind="dummy", config=config, weights=None, load_tokenizer=lambda: None)


def _engine(free_out_of_window: bool = True, block_size: int = ENGINE_BLOCK, chunk: int = ENGINE_CHUNK,
            layout: LayoutKind = LayoutKind.CROSS_LAYER) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu", dtype="float32", block_size=block_size,
                                    num_kv_blocks=96, max_num_batched_tokens=chunk, kv_layout=layout),
                       source=_hybrid_source())
    # Weights large enough that greedy tokens vary and attention is far from uniform.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if not name.endswith(("norm.weight", "bias")):
                p.normal_(0.0, 0.15, generator=gen)
    if not free_out_of_window:
        groups = engine.kv_layout.groups
        engine.kv_manager = KVCacheManager(groups, [engine.num_kv_blocks] * len(groups), free_out_of_window=False)
        engine.scheduler = Scheduler(engine.scheduler.config, engine.kv_manager)
    return engine


def _drive(engine: LLMEngine, prompt: list[int], max_tokens: int, join_after: int, shared: int
           ) -> tuple[dict, dict[str, list[tuple[int, int, int, int]]]]:
    """Run 'a' alone for ``join_after`` steps, then 'b': a's first ``shared`` tokens and two more.

    Returns the final outputs, and per request after every step: (real sliding blocks, full
    table length, computed tokens, prompt tokens).
    """
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_logits=True)
    requests = {"a": engine.add_request("a", prompt, params)}
    finals, trace, steps = {}, {"a": [], "b": []}, 0
    sliding_g = next(g.group_id for g in engine.kv_layout.groups if g.sliding_window is not None)
    while engine.has_unfinished_requests() or "b" not in requests:
        if steps == join_after:
            requests["b"] = engine.add_request("b", requests["a"].all_token_ids[:shared] + [11, 12], params)
        finals.update({out.request_id: out for out in engine.step() if out.finished})
        steps += 1
        for rid, r in requests.items():
            if r.block_ids:
                real = engine.kv_manager.real_blocks(sliding_g, r.block_ids[sliding_g])
                trace[rid].append((len(real), len(r.block_ids[1 - sliding_g]), r.num_computed_tokens,
                                   r.num_prompt_tokens))
    return finals, trace


def test_engine_frees_out_of_window_blocks_and_matches_keeping_them():
    prompt = [(7 * i + 3) % 400 + 5 for i in range(40)]
    outputs, trace = _drive(_engine(), prompt, 320, join_after=100, shared=100)
    reference, _ = _drive(_engine(free_out_of_window=False), prompt, 320, join_after=100, shared=100)

    decode_bound = -(-ENGINE_WINDOW // ENGINE_BLOCK) + 1  # 3
    chunk_bound = (ENGINE_WINDOW - 2 + ENGINE_CHUNK) // ENGINE_BLOCK + 2  # 4: a prefill chunk on top
    for rid, steps in trace.items():
        assert max(s for s, *_ in steps) <= chunk_bound, rid
        assert all(s <= decode_bound for s, _, computed, prompt_len in steps if computed > prompt_len), rid
        # The full group grows with the sequence (one block per 16 tokens).
        assert [f for _, f, computed, _ in steps] == sorted(f for _, f, _, _ in steps)
        assert steps[-1][1] == -(-steps[-1][2] // ENGINE_BLOCK) > 20
    for rid in ("a", "b"):
        out, ref = outputs[rid], reference[rid]
        assert len(out.token_ids) == 320 and len(set(out.token_ids)) > 100
        assert out.token_ids == ref.token_ids, rid
        assert all(torch.equal(x[1], y[1]) for x, y in zip(out.logits, ref.logits, strict=True)), rid
    # b joined late sharing a's first 100 tokens. a's sliding blocks before its window were freed
    # but stayed cached: b's 96-token hit needs only sliding blocks 4 and 5 (the window of query
    # 96), the same hit as with every block kept.
    assert outputs["b"].num_cached_tokens == 96 == reference["b"].num_cached_tokens


@pytest.mark.parametrize(("prefill_block", "decode_block"), [(16, 16), (8, 16), (16, 8)])
def test_engine_disaggregated_with_placeholders_on_both_sides(prefill_block: int, decode_block: int):
    """A prefill engine frees between chunks and holds; a decode engine reserves the window only.

    The copy follows the transfer's rules (services/kv/spec/topology.py): full groups whole, sliding
    groups from ``window_start_token``; it never touches a placeholder on either side.
    """
    prompt = [(11 * i + 5) % 400 + 5 for i in range(150)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = _engine(chunk=2048).generate([prompt], greedy)[0].token_ids
    prefill, decode = _engine(block_size=prefill_block, chunk=24), _engine(block_size=decode_block,
                                                                           layout=LayoutKind.PER_LAYER)
    for engine in (prefill, decode):  # the placeholder is the scratch block the KV cache holds
        assert all(engine.kv_manager.placeholder_block_id(g.group_id) == engine.kv_cache.scratch_block
                   for g in engine.kv_layout.groups)
    held = prefill.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv_on_finish=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    dst = decode.add_request_with_external_kv("r", prompt, greedy)
    n = len(prompt)
    for remote_group, local_group in zip(prefill.kv_layout.groups, decode.kv_layout.groups, strict=True):
        g = local_group.group_id
        src_ids, dst_ids = held.block_ids[g], dst.block_ids[g]
        assert len(src_ids) == -(-n // prefill_block) and len(dst_ids) == -(-n // decode_block)
        start = window_start_token(remote_group, local_group, n)
        if local_group.sliding_window is not None:
            assert prefill.kv_manager.placeholder_block_id(g) in src_ids
            assert decode.kv_manager.placeholder_block_id(g) in dst_ids
            assert prefill.kv_manager.placeholder_block_id(g) not in src_ids[start // prefill_block:]
            assert decode.kv_manager.placeholder_block_id(g) not in dst_ids[start // decode_block:]
        pieces = map_blocks(src_ids, prefill_block, dst_ids, decode_block, n, start)
        plan = plan_transfer(prefill.kv_layout, decode.kv_layout, g, pieces, RankRead(0, (0, 2), (0, 2)))
        apply_plan(plan, prefill.kv_cache.buffers, decode.kv_cache.buffers)
    assert prefill.release_held_kv("r")
    tokens = list(decode.complete_external_kv("r", held.output_token_ids[0]).new_token_ids)
    while decode.has_unfinished_requests():
        tokens += [t for out in decode.step() for t in out.new_token_ids]
    assert tokens == reference
    for engine in (prefill, decode):
        assert all(s.num_used == 0 for s in engine.kv_manager.stats())
