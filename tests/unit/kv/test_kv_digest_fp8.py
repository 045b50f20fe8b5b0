"""The KV digest over FP8 KV: it reads the bytes both sides hold (four e4m3 elements a 32-bit word), so every
bit of every element counts, the host path and the Triton kernel agree (``test_kv_digest.py`` runs both over
every layout in float8_e4m3fn too), and fault injection flips each element's top exponent bit."""

from __future__ import annotations

import random

import torch

from services.kv.digest import scheme as D
from services.kv.digest.runner import digest_job
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, LayoutKind
from tests.unit.kv.test_kv_digest import hybrid_groups, logical_kv, make, units, write

FP8 = "float8_e4m3fn"


def test_every_bit_of_an_fp8_element_is_covered() -> None:
    """A bit flipped in any of the four bytes of a word, and any of a byte's 8 bits, changes the digest; an
    element's bits never cancel another's (each byte is its own lane of the word)."""
    n, start = 19, 4
    layout, buffers = make(LayoutKind.CROSS_LAYER, BlockOrder.NHD, hybrid_groups(4, 8), num_blocks=10, dtype=FP8)
    ids = {0: [9, 1, 8, 2, 7], 1: [3, 6, 0]}
    for g in (0, 1):
        write(layout, buffers, g, logical_kv(layout, g, n), ids[g])
    rng = random.Random(3)
    for g in (0, 1):
        before = D.total(units(layout, buffers, g, ids[g], start, n, 4))
        bs = layout.block_size(g)
        _, _, view = D.layer_views(layout, buffers, g)[rng.randrange(2)]
        raw = view.view(torch.uint8)  # [blocks, block_size, heads, head_dim] bytes
        for bit in range(32):  # byte bit // 8 of a word, its bit bit % 8
            token, head = rng.randrange(start, n), rng.randrange(raw.shape[2])
            at = (ids[g][token // bs], token % bs, head, 4 * rng.randrange(raw.shape[3] // 4) + bit // 8)
            raw[at] ^= 1 << (bit % 8)
            after = D.total(units(layout, buffers, g, ids[g], start, n, 4))
            raw[at] ^= 1 << (bit % 8)
            assert after != before, f"group {g}: bit {bit % 8} of byte {bit // 8} went unnoticed"
        assert D.total(units(layout, buffers, g, ids[g], start, n, 4)) == before


def test_the_digest_reads_bytes_not_values() -> None:
    """Two FP8 caches holding the same bytes digest the same whatever they stand for (the scales are the compat
    hash's), and the digest of FP8 KV is the one of the same bytes' words, however they are typed."""
    n, bs = 13, 4
    groups = (KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1), bs),)
    layout, buffers = make(LayoutKind.PER_LAYER, BlockOrder.HND, groups, num_blocks=6, dtype=FP8)
    ids = [5, 0, 2, 4]
    write(layout, buffers, 0, logical_kv(layout, 0, n), ids)
    fp8_units = units(layout, buffers, 0, ids, 0, n, bs).tolist()
    as_int32 = [b.view(torch.int32).clone() for b in buffers]  # the same bytes, another dtype's tensors
    words = D.layer_views(layout, as_int32, 0)
    same = D.digest_units_host(words, bs, D.DigestJob(0, ids, 0, n, bs, 0, 2, 0)).tolist()
    assert same == fp8_units and len(set(fp8_units)) == len(fp8_units)


def test_fault_injection_flips_the_top_exponent_bit_of_each_fp8_element() -> None:
    n, bs = 13, 4
    groups = (KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1), bs),)
    layout, buffers = make(LayoutKind.CROSS_LAYER, BlockOrder.HND, groups, num_blocks=6, dtype=FP8)
    ids = [5, 0, 2, 4]
    write(layout, buffers, 0, logical_kv(layout, 0, n), ids)
    clean = [b.view(torch.uint8).clone() for b in buffers]
    before = units(layout, buffers, 0, ids, 4, n, bs).tolist()
    digest_job(layout, buffers, D.DigestJob(0, ids, 4, n, bs, 0, 2, 0, corrupt=True))
    assert units(layout, buffers, 0, ids, 4, n, bs).tolist() != before
    flipped = torch.cat([(b.view(torch.uint8) ^ c).view(-1) for b, c in zip(buffers, clean, strict=True)])
    assert set(flipped.unique().tolist()) == {0, 0x40}  # only that bit, of whole elements
    k0 = D.layer_views(layout, [c.view(torch.float8_e4m3fn) for c in clean], 0)[0][2].view(torch.uint8)
    k1 = D.layer_views(layout, buffers, 0)[0][2].view(torch.uint8)
    for block in (0, 2, 4):  # the blocks of tokens 4..12: each one's first token, every head and element
        assert bool(((k0[block, 0] ^ k1[block, 0]) == 0x40).all())
    assert int((flipped == 0x40).sum()) == 3 * 2 * 2 * 8  # blocks x layers (K only) x heads x head_dim
