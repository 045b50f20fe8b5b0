"""The router's prefix index: longest cached prefix per worker and tier, epochs, gaps, LRU bound, predictions."""

from __future__ import annotations

import pytest

from services.contract.prefix_keys import cache_salt_for, hash_request_blocks
from services.proto_gen.pdserve.v1 import worker_pb2
from services.router.prefix_index import (
    DEVICE,
    HOST,
    UNKNOWN_ROOM,
    BatchResult,
    CacheRoom,
    CacheState,
    PrefixIndex,
    PromptKeys,
    full_attention_groups,
)

SALT = cache_salt_for("h1")
Kind = worker_pb2.KVCacheEvent
STORED, REMOVED, CLEARED = Kind.STORED, Kind.REMOVED, Kind.CLEARED
PROMPT = list(range(100, 141))  # 41 tokens: 10 full blocks of 4


def keys(tokens: list[int], block_size: int = 4) -> list[bytes]:
    return hash_request_blocks(tokens, block_size, SALT)


def event(kind: int, block_keys: list[bytes], group: int = 0, tier: int = DEVICE,
          block_size: int = 4) -> worker_pb2.KVCacheEvent:
    return worker_pb2.KVCacheEvent(kind=kind, group_id=group, tier=tier, block_size=block_size, block_keys=block_keys)


def snapshot(*stored: worker_pb2.KVCacheEvent, seq: int = 0, epoch: int = 1, engine: str = "e1",
             pool_blocks: int = 0) -> worker_pb2.KVSnapshotResponse:
    return worker_pb2.KVSnapshotResponse(engine_id=engine, epoch=epoch, seq=seq, stored=stored,
                                         load=worker_pb2.WorkerLoad(prefill_tokens_per_s=1000.0,
                                                                    kv_blocks_total=pool_blocks))


def batch(first_seq: int, *events: worker_pb2.KVCacheEvent, epoch: int = 1,
          engine: str = "e1") -> worker_pb2.KVEventBatch:
    return worker_pb2.KVEventBatch(engine_id=engine, epoch=epoch, first_seq=first_seq, events=events)


def hit(index: PrefixIndex, address: str = "w1", prompt: list[int] = PROMPT, epoch: int = 1,
        groups: frozenset[int] | None = None, now_s: float = 0.0):
    return index.lookup(address, epoch, SALT, PromptKeys(prompt), groups, now_s)


def test_longest_cached_prefix_is_the_leading_run_of_keys() -> None:
    index = PrefixIndex()
    k = keys(PROMPT)
    index.load_snapshot("w1", snapshot(event(STORED, k[:3] + k[5:7])), now_s=0.0)  # a hole at block 3
    found = hit(index)
    assert (found.device_tokens, found.host_tokens, found.state) == (12, 0, CacheState.SYNCED)
    assert found.confirmed_tokens == 12
    assert hit(index, prompt=[7] + PROMPT[1:]).device_tokens == 0  # another first token: another chain
    assert hit(index, address="w2").tokens == 0


def test_one_token_is_always_left_to_compute() -> None:
    index = PrefixIndex()
    prompt = PROMPT[:8]
    index.load_snapshot("w1", snapshot(event(STORED, keys(prompt))), now_s=0.0)
    assert hit(index, prompt=prompt).device_tokens == 4  # both blocks cached: the hit stops one block short


def test_host_tier_counts_beyond_the_device_hit_with_its_own_span_size() -> None:
    index = PrefixIndex()
    index.load_snapshot("w1", snapshot(event(STORED, keys(PROMPT)[:2]),
                                       event(STORED, keys(PROMPT, 16)[:2], tier=HOST, block_size=16)), now_s=0.0)
    found = hit(index)
    assert (found.device_tokens, found.host_tokens, found.tokens) == (8, 24, 32)


def test_several_groups_the_shortest_full_attention_run_bounds_the_hit() -> None:
    index = PrefixIndex()
    k = keys(PROMPT)
    index.load_snapshot("w1", snapshot(event(STORED, k[:6], group=0), event(STORED, k[:2], group=1),
                                       event(STORED, k[4:6], group=2)), now_s=0.0)
    assert hit(index).device_tokens == 0  # every group counted: group 2 lacks block 0
    fields = {"kv_groups": '[["full", null, [0, 2]], ["full", null, [1]], ["sliding_window", 8, [3]]]'}
    assert full_attention_groups(fields) == frozenset({0, 1})
    assert hit(index, groups=full_attention_groups(fields)).device_tokens == 8
    assert full_attention_groups({}) is None


def test_events_apply_in_order_and_a_gap_makes_the_worker_unknown() -> None:
    index = PrefixIndex()
    k = keys(PROMPT)
    index.load_snapshot("w1", snapshot(event(STORED, k[:2]), seq=4), now_s=0.0)
    old = event(STORED, [b"x" * 16])
    assert index.apply_batch("w1", batch(3, old, old, event(STORED, k[2:4])), 1.0) \
        is BatchResult.APPLIED  # seq 3, 4 already in the snapshot: only seq 5 applies
    assert hit(index).device_tokens == 16 and index.num_keys()["confirmed"] == 4
    assert index.apply_batch("w1", batch(6, event(REMOVED, k[1:2])), 2.0) is BatchResult.APPLIED
    assert hit(index).device_tokens == 4
    assert index.apply_batch("w1", batch(7), 3.0) is BatchResult.APPLIED  # a heartbeat
    assert index.last_batch_s("w1") == 3.0
    assert index.apply_batch("w1", batch(9, event(STORED, k[1:2])), 4.0) is BatchResult.GAP  # 8 is missing
    assert index.state("w1") is CacheState.UNKNOWN and hit(index).tokens == 0
    assert index.apply_batch("w1", batch(10), 5.0) is BatchResult.NOT_SYNCED
    index.load_snapshot("w1", snapshot(event(STORED, k[:5]), seq=9), now_s=6.0)
    assert hit(index).device_tokens == 20


def test_cleared_drops_a_group_and_tier() -> None:
    index = PrefixIndex()
    index.load_snapshot("w1", snapshot(event(STORED, keys(PROMPT)[:3])), now_s=0.0)
    index.apply_batch("w1", batch(1, event(CLEARED, [])), 1.0)
    assert hit(index).tokens == 0 and index.num_keys()["confirmed"] == 0


def test_an_epoch_change_drops_every_entry() -> None:
    index = PrefixIndex()
    index.load_snapshot("w1", snapshot(event(STORED, keys(PROMPT)[:3])), now_s=0.0)
    index.predict("w1", 1, SALT, 4, PromptKeys(PROMPT), now_s=0.0)
    assert hit(index, epoch=2).tokens == 0  # Info says epoch 2 already: the old entries count for nothing
    assert index.apply_batch("w1", batch(1, epoch=2), 1.0) is BatchResult.EPOCH_CHANGED
    assert index.num_keys() == {"confirmed": 0, "predicted": 0} and index.state("w1") is CacheState.UNKNOWN
    index.load_snapshot("w1", snapshot(event(STORED, keys(PROMPT)[:1]), epoch=2), now_s=2.0)
    assert hit(index, epoch=2).device_tokens == 4


def test_a_removed_worker_is_forgotten() -> None:
    index = PrefixIndex()
    index.load_snapshot("w1", snapshot(event(STORED, keys(PROMPT)[:3])), now_s=0.0)
    index.predict("w1", 1, SALT, 4, PromptKeys(PROMPT[:20] + [1] * 8), now_s=0.0)
    index.drop("w1")
    assert index.addresses() == [] and index.num_keys() == {"confirmed": 0, "predicted": 0}
    assert hit(index).tokens == 0


def test_a_broken_stream_forgets_reported_keys_until_resynced() -> None:
    index = PrefixIndex()
    index.load_snapshot("w1", snapshot(event(STORED, keys(PROMPT)[:3])), now_s=0.0)
    index.mark_unknown("w1")
    found = hit(index)
    assert found.tokens == 0 and found.state is CacheState.UNKNOWN
    index.mark_unsupported("w2")
    assert hit(index, address="w2").state is CacheState.UNSUPPORTED
    assert index.worker_states() == {"synced": 0, "unknown": 1, "unsupported": 1}


def test_predicted_entries_count_until_their_ttl() -> None:
    index = PrefixIndex(predicted_ttl_s=5.0)
    index.predict("w1", 1, SALT, 4, PromptKeys(PROMPT), now_s=10.0)
    follow_up = PROMPT + [7, 8, 9]  # the next turn starts with this one
    found = hit(index, prompt=follow_up, now_s=12.0)
    assert found.device_tokens == 40 and found.confirmed_tokens == 0
    assert index.num_keys()["predicted"] == 10
    assert hit(index, prompt=follow_up, now_s=15.0).device_tokens == 0  # expired
    assert index.expire(15.0) == 10 and index.num_keys()["predicted"] == 0


def test_stored_events_confirm_predicted_entries() -> None:
    index = PrefixIndex(predicted_ttl_s=5.0)
    index.load_snapshot("w1", snapshot(), now_s=0.0)
    k = keys(PROMPT)
    index.predict("w1", 1, SALT, 4, PromptKeys(PROMPT), now_s=0.0)
    index.apply_batch("w1", batch(1, event(STORED, k[:6])), 1.0)
    assert index.num_keys() == {"confirmed": 6, "predicted": 4}
    found = hit(index, now_s=2.0)
    assert (found.device_tokens, found.confirmed_tokens) == (40, 24)
    found = hit(index, now_s=9.0)  # the unconfirmed rest expired; what events reported stays
    assert (found.device_tokens, found.confirmed_tokens) == (24, 24)


def test_predicting_keys_already_reported_only_touches_them() -> None:
    index = PrefixIndex(capacity_keys=4)
    index.load_snapshot("w1", snapshot(event(STORED, keys(PROMPT)[:2])), now_s=0.0)
    index.load_snapshot("w2", snapshot(event(STORED, keys(PROMPT)[:2])), now_s=0.0)
    index.predict("w1", 1, SALT, 4, PromptKeys(PROMPT[:9]), now_s=0.0)  # blocks 0, 1 are w1's already
    assert index.num_keys() == {"confirmed": 4, "predicted": 0}
    index.load_snapshot("w3", snapshot(event(STORED, keys(PROMPT)[:2])), now_s=0.0)  # evicts the 2 oldest: w2's
    assert hit(index, address="w1", prompt=PROMPT[:9]).device_tokens == 8
    assert hit(index, address="w2", prompt=PROMPT[:9]).device_tokens == 0


def test_memory_is_bounded_by_an_lru_over_every_key() -> None:
    index = PrefixIndex(capacity_keys=6)
    k = keys(PROMPT)
    index.load_snapshot("w1", snapshot(event(STORED, k[:4])), now_s=0.0)
    index.apply_batch("w1", batch(1, event(STORED, k[4:8])), 1.0)
    assert index.num_keys()["confirmed"] == 6 and index.num_evicted == 2
    assert hit(index).device_tokens == 0  # the oldest keys (the prefix's start) went first: no leading run
    index.predict("w2", 1, SALT, 4, PromptKeys(PROMPT), now_s=0.0)
    assert sum(index.num_keys().values()) == 6


def test_cache_room_is_free_pool_blocks_else_the_age_of_what_would_be_evicted() -> None:
    index = PrefixIndex(predicted_ttl_s=5.0)
    k = keys(PROMPT)
    index.load_snapshot("w1", snapshot(event(STORED, k[:4]), pool_blocks=12), now_s=0.0)
    assert index.cache_room("w1", 1, 6, now_s=1.0) == CacheRoom(2, 0.0)  # 4 held + 6 new of 12
    index.predict("w1", 1, SALT, 4, PromptKeys(PROMPT), now_s=2.0)  # predicted blocks take room too
    assert index.cache_room("w1", 1, 6, now_s=3.0) == CacheRoom(-4, 1.0)  # oldest key last used at 2.0
    # A worker whose keys were last used long ago evicts less valuable blocks: it ranks higher.
    index.load_snapshot("w2", snapshot(event(STORED, k[:10]), pool_blocks=12, engine="e2"), now_s=0.0)
    assert index.cache_room("w2", 1, 6, now_s=3.0).rank > index.cache_room("w1", 1, 6, now_s=3.0).rank
    assert CacheRoom(1, 0.0).rank > CacheRoom(-1, 1e9).rank  # room beats any eviction
    # Removed keys free their room; predictions that expire unconfirmed do too.
    index.apply_batch("w2", batch(1, event(REMOVED, k[4:10]), engine="e2"), 4.0)
    assert index.cache_room("w2", 1, 6, now_s=4.0) == CacheRoom(2, 0.0)
    index.expire(10.0)
    assert index.cache_room("w1", 1, 6, now_s=10.0).free_blocks == 2
    # Unknown: no pool size, not synced, another epoch.
    assert index.cache_room("w1", 2, 6, now_s=10.0) == UNKNOWN_ROOM
    index.load_snapshot("w3", snapshot(), now_s=0.0)
    assert index.cache_room("w3", 1, 1, now_s=1.0) == UNKNOWN_ROOM
    index.mark_unknown("w1")
    assert index.cache_room("w1", 1, 1, now_s=11.0) == UNKNOWN_ROOM


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity_keys"):
        PrefixIndex(capacity_keys=0)
    with pytest.raises(ValueError, match="predicted_ttl_s"):
        PrefixIndex(predicted_ttl_s=0)
