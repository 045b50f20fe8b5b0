"""The pairing policy: compatible pairs only, least outstanding work, direct-to-decode, exact counts."""

from __future__ import annotations

import random

from services.kv.spec.compat import CompatInfo, KVIdentity
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.proto_gen.pdserve.v1 import worker_pb2
from services.router.pairing import PairingPolicy, Role, WorkerIdentity, compatible, refusal
from services.router.workers import identity_from_info


def _identity(role: Role, hash_: str = "h1", **fields) -> WorkerIdentity:
    return WorkerIdentity(engine_id=f"{role}-{hash_}", role=role.value, compat_hash=hash_, **fields)


def _policy(prefill: dict[str, str], decode: dict[str, str], threshold: int = 0) -> PairingPolicy:
    """Workers given as {address: compat_hash}, all healthy."""
    policy = PairingPolicy(direct_decode_threshold=threshold)
    for role, workers in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
        policy.set_addresses(role, workers)
        for address, hash_ in workers.items():
            policy.mark_healthy(role, address, _identity(role, hash_, tp_size=2 if role == Role.DECODE else 1))
    return policy


def _outstanding(policy: PairingPolicy) -> dict[str, int]:
    return {w.address: w.outstanding_requests for w in policy.workers()}


def test_compatibility_needs_equal_hashes_and_dividing_block_sizes() -> None:
    p = _identity(Role.PREFILL, block_size=16)
    assert compatible(p, _identity(Role.DECODE, block_size=32))
    assert compatible(p, _identity(Role.DECODE, block_size=8))
    assert not compatible(p, _identity(Role.DECODE, block_size=24))
    assert not compatible(p, _identity(Role.DECODE, "h2", block_size=16))
    assert not compatible(_identity(Role.PREFILL, ""), _identity(Role.DECODE, ""))
    assert compatible(_identity(Role.PREFILL), _identity(Role.DECODE))  # block size not reported


def test_new_workers_are_not_used_until_healthy() -> None:
    policy = PairingPolicy()
    policy.set_addresses(Role.DECODE, ["d1"])
    assert policy.acquire(10) is None and not policy.has_healthy_decode()
    policy.mark_healthy(Role.DECODE, "d1", _identity(Role.DECODE))
    assignment = policy.acquire(10)
    assert assignment is not None and assignment.decode == "d1" and assignment.prefill is None


def test_picks_a_compatible_pair_and_the_decode_tp_size() -> None:
    policy = _policy({"p1": "h1", "p2": "h2"}, {"d1": "h2"})
    assignment = policy.acquire(100)
    assert (assignment.prefill, assignment.decode, assignment.reader_tp_size) == ("p2", "d1", 2)
    assert policy.has_healthy_pair()


def test_prefers_a_decode_worker_that_has_a_partner() -> None:
    policy = _policy({"p1": "h1"}, {"d_lonely": "h9", "d_paired": "h1"})
    for _ in range(3):
        assert policy.acquire(50).decode == "d_paired"


def test_no_compatible_pair_goes_direct_and_health_reflects_it() -> None:
    policy = _policy({"p1": "h1"}, {"d1": "h2"})
    assert not policy.has_healthy_pair() and policy.has_healthy_decode()
    assignment = policy.acquire(100)
    assert assignment.prefill is None and assignment.decode == "d1"


def test_short_prompts_go_straight_to_decode() -> None:
    policy = _policy({"p1": "h1"}, {"d1": "h1"}, threshold=32)
    assert policy.acquire(31).prefill is None
    assert policy.acquire(32).prefill == "p1"


def test_least_outstanding_work_on_each_side() -> None:
    policy = _policy({"p1": "h1", "p2": "h1"}, {"d1": "h1", "d2": "h1", "d3": "h1"})
    first = [policy.acquire(10) for _ in range(3)]
    assert sorted(a.decode for a in first) == ["d1", "d2", "d3"]  # rotate while loads are equal
    policy.finish(first[1])
    assert policy.acquire(10).decode == first[1].decode  # the only one with nothing outstanding


def test_prefill_load_is_counted_in_prompt_tokens() -> None:
    policy = _policy({"p1": "h1", "p2": "h1"}, {"d1": "h1"})
    big = policy.acquire(5000)
    small = [policy.acquire(10) for _ in range(3)]
    assert all(a.prefill != big.prefill for a in small)


def test_finishing_prefill_early_frees_only_the_prefill_side() -> None:
    policy = _policy({"p1": "h1"}, {"d1": "h1"})
    assignment = policy.acquire(10)
    policy.finish_prefill(assignment)
    policy.finish_prefill(assignment)  # idempotent
    assert _outstanding(policy) == {"p1": 0, "d1": 1}
    policy.finish(assignment)
    policy.finish(assignment)
    assert _outstanding(policy) == {"p1": 0, "d1": 0}
    assert assignment.finished


def test_unhealthy_and_draining_workers_are_skipped() -> None:
    policy = _policy({"p1": "h1"}, {"d1": "h1", "d2": "h1"})
    policy.mark_unhealthy(Role.DECODE, "d1", "gone")
    policy.mark_healthy(Role.DECODE, "d2", _identity(Role.DECODE, draining=True))
    assert policy.acquire(10) is None
    policy.mark_healthy(Role.DECODE, "d1", _identity(Role.DECODE))
    assert policy.acquire(10).decode == "d1"
    policy.mark_unhealthy(Role.PREFILL, "p1", "gone")
    assert policy.acquire(10).prefill is None and not policy.has_healthy_pair()


def test_a_worker_that_left_and_came_back_is_not_uncounted_by_old_requests() -> None:
    policy = _policy({}, {"d1": "h1"})
    old = policy.acquire(10)
    policy.set_addresses(Role.DECODE, [])
    policy.set_addresses(Role.DECODE, ["d1"])
    policy.mark_healthy(Role.DECODE, "d1", _identity(Role.DECODE))
    new = policy.acquire(10)
    policy.finish(old)
    assert _outstanding(policy) == {"d1": 1}
    policy.finish(new)
    assert _outstanding(policy) == {"d1": 0}


def test_set_addresses_reports_changes() -> None:
    policy = PairingPolicy()
    assert policy.set_addresses(Role.PREFILL, ["a:1", "b:1", "a:1"]) == (["a:1", "b:1"], [])
    assert policy.set_addresses(Role.PREFILL, ["b:1", "c:1"]) == (["c:1"], ["a:1"])
    assert [w.address for w in policy.workers(Role.PREFILL)] == ["b:1", "c:1"]


def test_max_model_len_is_the_smallest_reported() -> None:
    policy = PairingPolicy()
    policy.set_addresses(Role.PREFILL, ["p"])
    policy.set_addresses(Role.DECODE, ["d"])
    assert policy.max_model_len() is None
    policy.mark_healthy(Role.PREFILL, "p", _identity(Role.PREFILL, max_model_len=4096))
    policy.mark_healthy(Role.DECODE, "d", _identity(Role.DECODE, max_model_len=2048))
    assert policy.max_model_len() == 2048


def test_random_acquire_finish_sequences_leave_no_count_behind() -> None:
    rng = random.Random(0)
    policy = _policy({"p1": "h1", "p2": "h1"}, {"d1": "h1", "d2": "h1", "d3": "h2"}, threshold=20)
    held, prefilling = [], []
    for _ in range(500):
        roll = rng.random()
        if prefilling and roll < 0.2:
            policy.finish_prefill(prefilling.pop(rng.randrange(len(prefilling))))
        elif held and roll < 0.45:
            assignment = held.pop(rng.randrange(len(held)))
            policy.finish(assignment)
            if assignment in prefilling:
                prefilling.remove(assignment)
        else:
            assignment = policy.acquire(rng.randrange(1, 100))
            held.append(assignment)
            if assignment.prefill is not None:
                prefilling.append(assignment)
        decode_loads = [w.outstanding_requests for w in policy.workers(Role.DECODE)]
        prefill_loads = [w.outstanding_requests for w in policy.workers(Role.PREFILL)]
        assert sum(decode_loads) == len(held) and min(decode_loads) >= 0
        assert sum(prefill_loads) == len(prefilling) and min(prefill_loads) >= 0
        assert sum(w.outstanding_tokens for w in policy.workers(Role.PREFILL)) == sum(
            a.num_prompt_tokens for a in prefilling)
    for assignment in held:
        policy.finish(assignment)
    assert all(w.outstanding_requests == 0 and w.outstanding_tokens == 0 for w in policy.workers())


# ---- TP and per-group heads: only supported pairs ------------------------------------------------


def _model(group_heads: tuple[int, ...]) -> CompatInfo:
    """A model with one group per entry of ``group_heads`` (its total KV heads); group 0 sets the model's."""
    groups = tuple(KVCacheGroupSpec(g, AttentionKind.FULL, (g,), 16, None, heads, 16)
                   for g, heads in enumerate(group_heads))
    layout = KVLayoutSpec(kind=LayoutKind.CROSS_LAYER, order=BlockOrder.NHD, num_blocks=8,
                          num_kv_heads=group_heads[0], head_dim=16, dtype="bfloat16", groups=groups)
    return CompatInfo.of_identity(KVIdentity.of(architecture="x", num_layers=len(groups), num_kv_heads=group_heads[0],
                                                head_dim=16, layout=layout))


def _tp_identity(role: Role, info: CompatInfo, tp: int, block_size: int = 16) -> WorkerIdentity:
    return WorkerIdentity(engine_id=f"{role}-tp{tp}", role=role.value, compat_hash=info.hash,
                          compat_fields=info.fields, tp_size=tp, block_size=block_size)


def _tp_policy(info: CompatInfo, prefill: dict[str, int], decode: dict[str, int]) -> PairingPolicy:
    """Workers given as {address: tp size}, all healthy, all serving ``info``'s model."""
    policy = PairingPolicy()
    for role, workers in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
        policy.set_addresses(role, workers)
        for address, tp in workers.items():
            policy.mark_healthy(role, address, _tp_identity(role, info, tp))
    return policy


def test_refusal_names_the_reason_and_compatible_follows_it() -> None:
    info = _model((3,))
    p1, d2 = _tp_identity(Role.PREFILL, info, 1), _tp_identity(Role.DECODE, info, 2)
    assert refusal(p1, d2) == "decode tp 2 cannot shard 3 KV heads (neither divides the other)"
    assert not compatible(p1, d2)
    assert refusal(p1, _tp_identity(Role.DECODE, info, 3)) is None
    other = _model((4,))
    assert refusal(p1, _tp_identity(Role.DECODE, other, 1)) == "compat field num_kv_heads: prefill 3 vs decode 4"
    assert refusal(_tp_identity(Role.PREFILL, info, 1, 32), _tp_identity(Role.DECODE, info, 1, 48)) == \
        "block sizes 32 (prefill) and 48 (decode) do not divide each other"


def test_pairs_only_supported_tp_pairs() -> None:
    policy = _tp_policy(_model((3,)), {"p_tp1": 1, "p_tp2": 2}, {"d_tp2": 2, "d_tp3": 3})
    for _ in range(6):
        assignment = policy.acquire(50)
        assert (assignment.prefill, assignment.decode, assignment.reader_tp_size) == ("p_tp1", "d_tp3", 3)
    assert policy.has_healthy_pair()
    (d_tp2,) = [w for w in policy.workers(Role.DECODE) if w.address == "d_tp2"]
    assert policy.unpaired_reason(d_tp2) == (
        "prefill p_tp1: decode tp 2 cannot shard 3 KV heads (neither divides the other); "
        "prefill p_tp2: prefill tp 2 cannot shard 3 KV heads (neither divides the other); "
        "decode tp 2 cannot shard 3 KV heads (neither divides the other)")
    assert policy.partners(d_tp2) == []


def test_groups_with_their_own_heads_pair_under_tp() -> None:
    # group 0: 2 heads, group 1: 4 heads (Gemma-4 style): tp 1, 2 and 4 all shard both
    policy = _tp_policy(_model((2, 4)), {"p": 2}, {"d1": 1, "d4": 4})
    assert {policy.acquire(10).decode for _ in range(4)} == {"d1", "d4"}
    assert all(policy.unpaired_reason(w) is None for w in policy.workers())
    assert [w.address for w in policy.partners(policy.get(Role.PREFILL, "p"))] == ["d1", "d4"]


def test_a_group_tp_cannot_shard_goes_direct() -> None:
    # group 1 has 3 heads: prefill tp 2 cannot shard it, so nothing pairs and requests go direct
    policy = _tp_policy(_model((2, 3)), {"p": 2}, {"d": 1})
    assert not policy.has_healthy_pair()
    assert policy.acquire(100).prefill is None
    assert policy.unpaired_reason(policy.get(Role.PREFILL, "p")) == \
        "decode d: KV group 1: prefill tp 2 cannot shard 3 KV heads (neither divides the other)"


def test_unpaired_reason_needs_candidates_and_availability() -> None:
    policy = _tp_policy(_model((3,)), {"p": 1}, {"d": 2})
    prefill, decode = policy.get(Role.PREFILL, "p"), policy.get(Role.DECODE, "d")
    assert policy.unpaired_reason(prefill) == \
        "decode d: decode tp 2 cannot shard 3 KV heads (neither divides the other)"
    policy.mark_unhealthy(Role.DECODE, "d", "gone")
    assert policy.unpaired_reason(prefill) is None  # no candidate to judge by: health says so already
    assert policy.unpaired_reason(decode) is None  # not available: its last_error says why


def test_identity_carries_the_compat_fields() -> None:
    info = _model((2, 4))
    identity = identity_from_info(worker_pb2.WorkerInfo(engine_id="e", role="decode", compat_hash=info.hash,
                                                        compat_fields=info.fields, tp_size=4, block_size=32))
    assert identity.compat_fields == info.fields and (identity.tp_size, identity.block_size) == (4, 32)
    assert identity.pair_side().compat_fields == info.fields
    hash(identity)  # still usable as a key (the fields are left out of the hash)


def test_requests_not_yet_sent_to_their_decode_worker_are_counted_until_sent_finished_or_moved() -> None:
    """What a role switch waits for: requests paired with a decode worker whose Generate has not left yet."""
    policy = _policy({"p1": "h1"}, {"d1": "h1", "d2": "h1"})
    unsent = lambda: {w.address: w.unsent_generates for w in policy.workers(Role.DECODE)}  # noqa: E731
    a, b = policy.acquire(100), policy.acquire(100)
    assert sorted(unsent().values()) == [1, 1]
    policy.generate_sent(a)
    policy.generate_sent(a)  # idempotent
    assert unsent()[a.decode] == 0 and unsent()[b.decode] == 1
    policy.finish(b)  # abandoned before its Generate: uncounted too
    assert unsent() == {"d1": 0, "d2": 0}
    old = a.decode
    assert policy.move_decode(a) not in (None, old)  # a migration's Generate goes to the new worker
    assert unsent()[a.decode] == 1 and unsent()[old] == 0
    policy.finish(a)
    assert unsent() == {"d1": 0, "d2": 0}
