"""FP8 KV over the wire: a real owner process with float8_e4m3fn KV, this process reading it over real NIXL.

Every byte pulled equals the owner's (compared as bytes: CPU torch has no float8 equality), with the digest on
and off, between layouts, block sizes and TP sizes; a staged ticket's span is read as bytes too; a pull moves
half the bytes of the same float16 pull; and a reader whose KV dtype or scales differ is refused at the
handshake, naming the group and the field, before anything is read.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from bench.kv_synthetic import group_shapes
from services.kv.reader.errors import KVIntegrityError
from services.kv.spec.compat import KVCompatibilityError
from services.kv.spec.kv_quant import group_scales, scales_digest
from tests.integration.test_kv_transfer import BASE, SENTINEL, Reader, _request, expected_views, owner_process, reader

FP8 = "float8_e4m3fn"
SCALES = {"1": [0.5, 2.0], "2": [0.0625, 3.0]}  # layer 0 has none: 1.0
FP8_BASE = {**BASE, "dtype": FP8, "kv_scales": SCALES}
NUM_TOKENS = 29  # a partial last block on every block size used


def check_bytes(owner_cfg: dict, r: Reader, ticket, local_ids: list[int], start: int = 0) -> None:  # noqa: ANN001
    """Every K and V byte of the pulled tokens is the owner's; every other byte still the sentinel's."""
    remote_ids = [list(g.block_ids) for g in ticket.groups]
    expected = expected_views(owner_cfg, r, remote_ids, [local_ids], ticket.num_tokens, [start])
    (g,) = group_shapes(r.cfg)
    last, tail = local_ids[(ticket.num_tokens - 1) // g["block_size"]], ticket.num_tokens % g["block_size"]
    for rank, cache in enumerate(r.caches):
        for layer in g["layers"]:
            for kv, (got, exp) in enumerate(zip(cache.views[layer], expected[rank][layer], strict=True)):
                got, exp = got.cpu().view(torch.uint8), exp.view(torch.uint8).clone()
                if tail:  # past the prompt in its last block: padding, either side's
                    exp[last, tail:] = got[last, tail:]
                assert bool((got == exp).all()), f"rank {rank} layer {layer} {'KV'[kv]} differs"


def untouched(r: Reader) -> bool:
    """Every element of the reader's KV still the sentinel, compared as bytes in its own dtype."""
    def sentinel(b: torch.Tensor) -> bool:
        pattern = torch.tensor([SENTINEL]).to(b.dtype).view(torch.uint8)
        return bool((b.view(torch.uint8).view(-1, b.element_size()) == pattern).all())
    return all(sentinel(b) for c in r.caches for b in c.buffers)


CASES = {  # name: (owner overrides, reader overrides, owner tp, reader tp)
    "cross_layer": ({"kind": "cross_layer"}, {"kind": "cross_layer"}, 1, 1),
    "per_layer-bs4-to-cross_layer-bs8": ({"order": "HND"}, {"kind": "cross_layer", "order": "HND",
                                                            "block_size": 8}, 1, 1),
    "tp-1-to-2": ({}, {}, 1, 2),
    "heads_outer-tp-2-to-1": ({"kind": "heads_outer", "order": "HND"}, {"kind": "heads_outer", "order": "HND"},
                              2, 1),
}


@pytest.mark.parametrize("digest", ["on", "off"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_pull_reproduces_the_owner_bytes(case: str, digest: str) -> None:
    owner_over, reader_over, owner_tp, reader_tp = CASES[case]
    off = {} if digest == "on" else {"kv_digest": "off"}
    owner_cfg = {**FP8_BASE, **owner_over, **off, "engine_id": f"owner-fp8-{case}-{digest}", "tp": owner_tp,
                 "reader_tp": reader_tp}
    reader_cfg = {**FP8_BASE, **reader_over, **off}
    owner_cfg["reader_block_size"] = min(owner_cfg["block_size"], reader_cfg["block_size"])
    owner_cfg["requests"] = [_request(rid, NUM_TOKENS, owner_cfg["block_size"], 3, shuffle=True)
                             for rid in ("a", "b")]
    local_ids = list(range(1, 1 + -(-NUM_TOKENS // reader_cfg["block_size"])))[::-1]
    with owner_process(owner_cfg) as owner, reader(reader_cfg, reader_tp) as r:
        assert all(c.buffers[0].dtype == torch.float8_e4m3fn for c in r.caches)
        result = asyncio.run(r.puller.pull(owner.tickets["a"], [local_ids]))
        check_bytes(owner_cfg, r, owner.tickets["a"], local_ids)
        assert result.num_bytes > 0 and bool(owner.tickets["a"].digests) == (digest == "on")
        owner.wait_released("a")
    # The digest on FP8 bytes catches what the wire (here: fault injection after the READ) changed.
    if digest == "on" and case == "cross_layer":
        with owner_process({**owner_cfg, "engine_id": "owner-fp8-corrupt"}) as owner, \
                reader(reader_cfg, reader_tp, corrupt=True) as r, pytest.raises(KVIntegrityError):
            asyncio.run(r.puller.pull(owner.tickets["b"], [local_ids]))


def test_fp8_pull_moves_half_the_bytes_of_float16() -> None:
    """The same tickets (tokens, blocks, layout) from a float16 owner and from an FP8 one: the same READs and
    descriptors, half the bytes."""
    results = {}
    for dtype in ("float16", FP8):
        cfg = {**FP8_BASE, "dtype": dtype, "kind": "cross_layer"}
        owner_cfg = {**cfg, "engine_id": f"owner-bytes-{dtype}", "tp": 1, "reader_tp": 1,
                     "requests": [_request("a", NUM_TOKENS, cfg["block_size"], 3, shuffle=True)]}
        with owner_process(owner_cfg) as owner, reader(cfg, 1) as r:
            results[dtype] = asyncio.run(r.puller.pull(owner.tickets["a"], [list(range(8, 0, -1))]))
    half, full = results[FP8], results["float16"]
    assert (half.num_reads, half.num_descriptors) == (full.num_reads, full.num_descriptors)
    assert half.num_bytes * 2 == full.num_bytes
    # 8 blocks of 4 tokens, 3 layers, K and V, 4 heads of 8 one-byte elements (the last block's padding too)
    assert half.num_bytes == 8 * 4 * 3 * 2 * 4 * 8


AREA = 1 << 20
FRAGMENTED = list(range(1, 17, 2))  # no two adjacent: worth staging


def test_a_staged_fp8_ticket_is_read_as_bytes_and_another_block_size_reads_the_blocks() -> None:
    cfg = {**FP8_BASE, "kind": "cross_layer"}
    owner_cfg = {**cfg, "engine_id": "owner-fp8-staged", "tp": 1, "reader_tp": 1, "staging_bytes": AREA,
                 "reader_block_size": cfg["block_size"],
                 "requests": [{"request_id": rid, "num_tokens": NUM_TOKENS, "block_ids": [FRAGMENTED]}
                              for rid in ("staged", "held", "other-block-size")]}
    local_ids = list(range(22, 6, -2))
    with owner_process(owner_cfg) as owner:
        assert all(t.staged_offsets for t in owner.tickets.values())
        with reader(cfg, 1, staging_bytes=AREA) as r:
            result = asyncio.run(r.puller.pull(owner.tickets["staged"], [local_ids]))
            check_bytes(owner_cfg, r, owner.tickets["staged"], local_ids)
            assert result.staged and result.num_descriptors == 1 and r.ranks[0].staging.free_bytes == AREA
            for b in r.caches[0].buffers:
                b.fill_(SENTINEL)
            held = asyncio.run(r.puller.pull(owner.tickets["held"], [local_ids], num_cached_tokens=12))
            check_bytes(owner_cfg, r, owner.tickets["held"], local_ids, start=12)
            assert held.staged and held.num_bytes == result.num_bytes * 5 // 8
        # A reader of block size 8: not the owner's layout, so it reads the (still pinned) blocks themselves.
        wide = {**cfg, "block_size": 8}
        with reader(wide, 1, staging_bytes=AREA) as r:
            ids = [11, 3, 7, 5]
            other = asyncio.run(r.puller.pull(owner.tickets["other-block-size"], [ids]))
            check_bytes(owner_cfg, r, owner.tickets["other-block-size"], ids)
            assert not other.staged and other.num_bytes == result.num_bytes


@pytest.fixture(scope="module")
def fp8_owner():
    cfg = {**FP8_BASE, "engine_id": "owner-fp8-compat", "tp": 1, "reader_tp": 1,
           "requests": [_request("c", 12, BASE["block_size"], 0, shuffle=False)]}
    with owner_process(cfg) as owner:
        yield owner


@pytest.mark.parametrize(("reader_over", "message"), [
    ({"dtype": "float16", "kv_scales": {}},
     r"KV group 0 \(full\): dtype local float16 vs remote float8_e4m3fn"),
    ({"kv_scales": {**SCALES, "2": [0.0625, 3.5]}},
     "KV group 0 \\(full\\): kv_scales local {} vs remote {}".format(
         scales_digest([[1.0, 1.0], [0.5, 2.0], [0.0625, 3.5]]), scales_digest([[1.0, 1.0], [0.5, 2.0],
                                                                                [0.0625, 3.0]]))),
    ({"kv_scales": {}}, r"KV group 0 \(full\): kv_scales local sha:[0-9a-f]{12} vs remote sha:"),
])
def test_a_reader_of_another_kv_dtype_or_scales_is_refused_naming_the_group(fp8_owner, reader_over: dict,  # noqa: ANN001
                                                                           message: str) -> None:
    with reader({**FP8_BASE, **reader_over}, 1) as r:
        with pytest.raises(KVCompatibilityError, match=message) as e:
            asyncio.run(r.puller.pull(fp8_owner.tickets["c"], [[0, 1, 2]]))
        assert "kv_groups" in e.value.differences
        assert untouched(r)  # nothing was read
    assert fp8_owner.proc.poll() is None


def test_the_owner_scales_travel_exactly_in_the_handshake(fp8_owner) -> None:  # noqa: ANN001
    with reader(FP8_BASE, 1) as r:
        asyncio.run(r.puller.pull(fp8_owner.tickets["c"], [[0, 1, 2]]))
        description = r.puller.peers.cached(fp8_owner.tickets["c"].engine_id, fp8_owner.tickets["c"].epoch)
        assert group_scales(description.compat.fields) == [{0: (1.0, 1.0), 1: (0.5, 2.0), 2: (0.0625, 3.0)}]
        assert not untouched(r)
