"""KV events from the block layer: what the prefix caches store and remove, numbered, bounded, off by
default (no torch). The engine and the worker's publisher have their own tests
(tests/unit/engine/test_engine_kv_events.py, tests/unit/worker/test_kv_event_publisher.py)."""

from __future__ import annotations

import pytest

from services.contract.prefix_keys import hash_request_blocks
from services.contract.sampling_params import SamplingParams
from services.engine.kv_cache.events import KVEvent, KVEventKind, KVEventLog, KVTier
from services.engine.kv_cache.manager import KVCacheManager
from services.engine.request import Request
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec

BS = 4
SALT = b"compat"


def _groups(*block_sizes: int) -> list[KVCacheGroupSpec]:
    return [KVCacheGroupSpec(g, AttentionKind.FULL, (g,), bs) for g, bs in enumerate(block_sizes)]


def _kv(num_blocks: int = 8, block_sizes: tuple[int, ...] = (BS,), enabled: bool = True,
        tier: KVTier = KVTier.DEVICE) -> KVCacheManager:
    log = KVEventLog()
    log.enabled = enabled
    return KVCacheManager(_groups(*block_sizes), [num_blocks] * len(block_sizes), cache_salt=SALT, events=log,
                          tier=tier)


def _run(kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """Compute a prompt (after its prefix hit), publish its full blocks, finish it (they stay cached-free)."""
    r = Request(rid, list(tokens), SamplingParams())
    computed, num_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, len(tokens) - num_hit, computed) is not None
    r.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(r, len(tokens))
    kv.free(r)
    return r


def _sealed(kv: KVCacheManager) -> list[KVEvent]:
    kv.events.seal()
    return kv.events.take()


def test_published_blocks_are_one_stored_event_per_group_keyed_as_the_router_computes():
    kv = _kv(block_sizes=(4, 8))
    tokens = list(range(100, 118))
    _run(kv, "a", tokens)
    events = _sealed(kv)
    assert [(e.seq, e.kind, e.group_id, e.tier, e.block_size) for e in events] == [
        (1, KVEventKind.STORED, 0, KVTier.DEVICE, 4), (2, KVEventKind.STORED, 1, KVTier.DEVICE, 8)]
    assert list(events[0].block_keys) == hash_request_blocks(tokens, 4, SALT)  # 4 full blocks, in prefix order
    assert list(events[1].block_keys) == hash_request_blocks(tokens, 8, SALT)
    _run(kv, "again", tokens)  # a prefix hit publishes nothing new
    assert _sealed(kv) == []


def test_evicted_blocks_are_removed_and_numbering_continues():
    kv = _kv(num_blocks=4)
    first = list(range(16))
    _run(kv, "a", first)
    _sealed(kv)
    second = list(range(50, 58))  # two blocks: evicts the two least recently freed (a's tail, freed first)
    _run(kv, "b", second)
    removed, stored = _sealed(kv)
    assert (removed.seq, removed.kind) == (2, KVEventKind.REMOVED)
    assert set(removed.block_keys) == set(hash_request_blocks(first, BS, SALT)[2:])
    assert (stored.seq, stored.kind, list(stored.block_keys)) == (3, KVEventKind.STORED,
                                                                   hash_request_blocks(second, BS, SALT))
    assert kv.events.last_seq == 3


def test_a_reset_is_one_cleared_event_per_group_and_the_snapshot_is_empty():
    kv = _kv(block_sizes=(4, 4))
    _run(kv, "a", list(range(8)))
    _sealed(kv)
    kv.reset_prefix_cache()
    events = _sealed(kv)
    assert [(e.kind, e.group_id, e.block_keys) for e in events] == [(KVEventKind.CLEARED, 0, ()),
                                                                     (KVEventKind.CLEARED, 1, ())]
    assert [c.block_keys for c in kv.contents()] == [(), ()]


def test_contents_lists_every_cached_key_per_group_and_tier():
    kv = _kv(num_blocks=8, tier=KVTier.HOST)
    _run(kv, "a", list(range(8)))
    _run(kv, "b", list(range(30, 42)))
    (contents,) = kv.contents()
    assert (contents.group_id, contents.tier, contents.block_size) == (0, KVTier.HOST, BS)
    assert set(contents.block_keys) == set(hash_request_blocks(list(range(8)), BS, SALT)
                                           + hash_request_blocks(list(range(30, 42)), BS, SALT))


def test_host_span_pools_report_as_the_host_tier_with_the_span_size():
    # The host tier builds its span manager like this (offload/host_tier.py): spans as blocks, the device's log.
    device = _kv(block_sizes=(4,))
    spans = KVCacheManager(_groups(8), [4], cache_salt=SALT, block_hashes=device.block_hashes, events=device.events,
                           tier=KVTier.HOST)
    tokens = list(range(17))
    _run(spans, "a", tokens)
    (event,) = _sealed(device)
    assert (event.tier, event.block_size, list(event.block_keys)) == (KVTier.HOST, 8, hash_request_blocks(tokens, 8,
                                                                                                          SALT))


def test_nothing_is_recorded_while_disabled():
    kv = _kv(num_blocks=2, enabled=False)
    _run(kv, "a", list(range(8)))
    _run(kv, "b", list(range(20, 28)))  # evicts a's blocks
    kv.reset_prefix_cache()
    assert _sealed(kv) == [] and kv.events.last_seq == 0
    kv.events.enabled = True
    _run(kv, "c", list(range(40, 44)))
    assert [e.seq for e in _sealed(kv)] == [1]  # numbers count recorded events only


def test_a_full_outbound_queue_drops_sealed_events_whole_and_leaves_a_gap():
    log = KVEventLog(max_outbound_keys=3)
    log.enabled = True
    kv = KVCacheManager(_groups(BS), [16], events=log)
    _run(kv, "a", list(range(8)))  # seq 1: 2 keys
    log.seal()
    _run(kv, "b", list(range(20, 28)))  # seq 2: 2 more keys would make 4 > 3: dropped
    log.seal()
    _run(kv, "c", list(range(40, 44)))  # seq 3: 1 key, fits
    log.seal()
    assert [e.seq for e in log.take()] == [1, 3] and log.num_dropped == 1
    _run(kv, "d", list(range(60, 68)))  # taking emptied the queue: fits again
    log.seal()
    assert [e.seq for e in log.take()] == [4]


def test_cache_salt_changes_only_while_the_cache_is_empty():
    kv = _kv()
    kv.set_cache_salt(b"other")
    r = _run(kv, "a", list(range(4)))
    assert kv.contents()[0].block_keys == tuple(hash_request_blocks(r.prompt_token_ids, BS, b"other"))
    with pytest.raises(ValueError, match="empty"):
        kv.set_cache_salt(b"third")


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="max_outbound_keys"):
        KVEventLog(max_outbound_keys=0)
    with pytest.raises(ValueError, match="no event log"):
        KVCacheManager(_groups(BS), [4]).contents()
