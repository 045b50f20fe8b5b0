"""Block hashes: each request's chain computed once and shared (no torch); the encoding itself is
tests/unit/contract/test_prefix_keys.py's."""

from __future__ import annotations

import gc

import pytest

from services.contract.prefix_keys import hash_request_blocks
from services.contract.sampling_params import SamplingParams
from services.engine.kv_cache import block_hash
from services.engine.kv_cache.block_hash import BlockHashChains
from services.engine.kv_cache.manager import KVCacheManager
from services.engine.request import Request
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec

# ---- per-request chains ------------------------------------------------------------------------


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def _full(block_size: int) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(0, AttentionKind.FULL, (0,), block_size)


def test_request_chain_matches_hash_request_blocks_per_block_size():
    chains = BlockHashChains(b"salt")
    r = _req("r", range(40))
    hashes = chains.of(r)
    assert hashes.at(8, 3) == hash_request_blocks(r.all_token_ids, 8, b"salt")[3]
    assert [hashes.at(4, i) for i in range(10)] == hash_request_blocks(r.all_token_ids, 4, b"salt")
    assert chains.of(r).at(8, 4) == hash_request_blocks(r.all_token_ids, 8, b"salt")[4]
    with pytest.raises(ValueError, match="not full"):
        hashes.at(16, 2)  # tokens 32..47: only 40 tokens


def test_each_block_is_hashed_once_across_lookups_publishes_and_shared_managers(monkeypatch):
    span_1 = hash_request_blocks(list(range(17)), 8)[1]
    calls = []
    real = block_hash.hash_block_tokens
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda *a: calls.append(a[1]) or real(*a))
    device = KVCacheManager([_full(4)], [16])
    spans = KVCacheManager([_full(8)], [4], block_hashes=device.block_hashes)  # as the host tier builds it
    r = _req("r", range(17))
    for _ in range(3):  # a waiting request looked up step after step: a miss at block 0 each time
        assert device.get_computed_blocks(r) == ([[]], 0)
        assert spans.get_computed_blocks(r) == ([[]], 0)
    assert calls == [[0, 1, 2, 3], list(range(8))]
    device.allocate_slots(r, 17)
    device.cache_full_blocks(r, 17)  # blocks 1..3 extend the chain the lookup started
    assert len(calls) == 5
    assert device.get_computed_blocks(r) == ([[0, 1, 2, 3]], 16)
    assert spans.block_hashes.of(r).at(8, 1) == span_1
    assert len(calls) == 6  # span 1 only: span 0 came from the first lookup
    assert device.get_computed_blocks(_req("b", range(17)))[1] == 16

def test_shared_chains_must_have_the_managers_salt():
    with pytest.raises(ValueError, match="salt"):
        KVCacheManager([_full(4)], [4], cache_salt=b"a", block_hashes=BlockHashChains(b"b"))


def test_a_chain_lives_as_long_as_its_request():
    chains = BlockHashChains()
    r, same_id = _req("r", range(8)), _req("r", [9] * 8)
    assert chains.of(r).at(4, 1) != chains.of(same_id).at(4, 1)  # one id, two requests: two chains
    del r, same_id
    gc.collect()
    assert len(chains._chains) == 0
