"""The KV digest: the same logical KV digests the same in every layout, block size, block order, TP slice
and source (device blocks or the host tier), and a one-bit flip anywhere in the covered tokens changes it.

The exporter and the reader compute it on different layouts, so every test writes one logical KV
(``[layers, K/V, tokens, heads, head_dim]``) into two layouts and compares. On CPU the Triton kernel runs
under Triton's interpreter against the host (numpy) path; ``PDSERVE_TEST_DEVICE=cuda`` runs both on the GPU.
"""

from __future__ import annotations

import asyncio
import os
import random

import numpy as np
import pytest
import torch

from services.kv.digest import scheme as D
from services.kv.digest.runner import digest_job
from services.kv.owner.exporter import KVExporter
from services.kv.spec.compat import KVIdentity
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.wire import MemoryRegion, prompt_hash

DEVICE = torch.device(os.environ.get("PDSERVE_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    # At collection, before any test of the run imports Triton (an engine does): the interpreter is chosen when
    # triton.language is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
PROMPT_HASH = prompt_hash(range(30))  # the tickets' prompt (nothing here reads it)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn}


def hybrid_groups(bs_sliding: int, bs_full: int) -> tuple[KVCacheGroupSpec, ...]:
    """Gemma-like: a sliding group of 2 layers (2 heads of 8) and a full group of 1 layer with its own
    shape (1 head of 16)."""
    return (KVCacheGroupSpec(0, AttentionKind.SLIDING_WINDOW, (0, 2), bs_sliding, sliding_window=12),
            KVCacheGroupSpec(1, AttentionKind.FULL, (1,), bs_full, num_kv_heads=1, head_dim=16))


def make(kind: LayoutKind, order: BlockOrder, groups, num_blocks: int, dtype: str = "bfloat16",
         heads: int = 2, head_dim: int = 8) -> tuple[KVLayoutSpec, list[torch.Tensor]]:
    layout = KVLayoutSpec(kind, order, num_blocks, heads, head_dim, dtype, tuple(groups))
    buffers = [torch.zeros(b.num_bytes // layout.element_size, dtype=DTYPES[dtype], device=DEVICE)
               for b in layout.buffers()]
    return layout, buffers


def logical_kv(layout: KVLayoutSpec, group_id: int, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Random [layers, 2, tokens, heads, head_dim] values of a group, in the layout's dtype."""
    g = torch.Generator().manual_seed(seed + group_id)
    shape = (len(layout.groups[group_id].layer_ids), 2, num_tokens, layout.kv_heads(group_id),
             layout.group_head_dim(group_id))
    return torch.randn(shape, generator=g).to(DTYPES[layout.dtype]).to(DEVICE)


def write(layout: KVLayoutSpec, buffers, group_id: int, values: torch.Tensor, block_ids: list[int],
          head_offset: int = 0) -> None:
    """Store tokens of ``values`` (heads ``head_offset ..`` of it) into the group's blocks ``block_ids``."""
    bs = layout.block_size(group_id)
    heads = layout.kv_heads(group_id)
    for i, (_, _, view) in enumerate(D.layer_views(layout, buffers, group_id)):
        typed = view.view(values.dtype)
        for t in range(values.shape[2]):
            typed[block_ids[t // bs], t % bs] = values[i // 2, i % 2, t, head_offset:head_offset + heads]


def units(layout, buffers, group_id, ids, start, end, unit, heads=None, head_key=0) -> np.ndarray:
    h0, h1 = heads or (0, layout.kv_heads(group_id))
    return digest_job(layout, buffers, D.DigestJob(group_id, ids, start, end, unit, h0, h1, head_key))


LAYOUTS = [(LayoutKind.PER_LAYER, BlockOrder.NHD), (LayoutKind.PER_LAYER, BlockOrder.HND),
           (LayoutKind.CROSS_LAYER, BlockOrder.NHD), (LayoutKind.CROSS_LAYER, BlockOrder.HND),
           (LayoutKind.HEADS_OUTER, BlockOrder.HND)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("group_id", [0, 1], ids=["sliding", "full-own-shape"])
def test_the_digest_is_the_same_in_every_layout_block_size_and_order(dtype: str, group_id: int) -> None:
    n = 37  # a partial last block everywhere
    got = []
    for (kind, order), (bs_s, bs_f) in zip(LAYOUTS, [(4, 8), (8, 4), (16, 16), (4, 4), (8, 16)], strict=True):
        layout, buffers = make(kind, order, hybrid_groups(bs_s, bs_f), num_blocks=24, dtype=dtype)
        bs = layout.block_size(group_id)
        ids = random.Random(bs).sample(range(24), -(-n // bs))  # scattered, out of order
        write(layout, buffers, group_id, logical_kv(layout, group_id, n), ids)
        # Unit 4 divides every block size here; a reader may start at any unit boundary.
        got.append([units(layout, buffers, group_id, ids, start, n, 4) for start in (0, 8, 36)])
    for other in got[1:]:
        for a, b in zip(got[0], other, strict=True):
            assert a.tolist() == b.tolist()
    whole, from_8, _ = got[0]
    assert whole[2:].tolist() == from_8.tolist()  # unit digests do not depend on where the range starts
    assert len(set(whole.tolist())) == len(whole)  # distinct per unit


def test_tp_slices_add_up_and_are_keyed_by_the_reading_rank() -> None:
    """An owner rank's share of a reader rank's heads, keyed by the reader's head index, sums to what the
    reader computes over its own heads: TP 1 owner (4 heads) -> TP 2 reader (2 heads each)."""
    n, bs = 21, 4
    groups = (KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1), bs),)
    owner, owner_buffers = make(LayoutKind.CROSS_LAYER, BlockOrder.NHD, groups, num_blocks=8, heads=4)
    values = logical_kv(owner, 0, n)
    ids = [5, 2, 7, 0, 3, 6]
    write(owner, owner_buffers, 0, values, ids)
    for reader_rank in (0, 1):
        reader, reader_buffers = make(LayoutKind.PER_LAYER, BlockOrder.HND, groups, num_blocks=8, heads=2)
        write(reader, reader_buffers, 0, values, list(range(6)), head_offset=2 * reader_rank)
        share = units(owner, owner_buffers, 0, ids, 0, n, bs, heads=(2 * reader_rank, 2 * reader_rank + 2))
        assert share.tolist() == units(reader, reader_buffers, 0, list(range(6)), 0, n, bs).tolist()
        # Split further (heads read from two owner ranks) and the parts still add up.
        parts = [units(owner, owner_buffers, 0, ids, 0, n, bs, heads=(2 * reader_rank + h, 2 * reader_rank + h + 1),
                       head_key=h) for h in (0, 1)]
        assert ((parts[0] + parts[1]) & D.MASK32).tolist() == share.tolist()
    # The same heads keyed as another reader head digest differently: a slice cannot land in the wrong rank.
    assert units(owner, owner_buffers, 0, ids, 0, n, bs, heads=(0, 2), head_key=2).tolist() != \
        units(owner, owner_buffers, 0, ids, 0, n, bs, heads=(0, 2)).tolist()


@pytest.mark.parametrize(("kind", "order"), LAYOUTS)
def test_a_one_bit_flip_anywhere_in_the_covered_tokens_is_detected(kind: LayoutKind, order: BlockOrder) -> None:
    n, start = 19, 4
    layout, buffers = make(kind, order, hybrid_groups(4, 8), num_blocks=10, dtype="bfloat16")
    ids = {0: [9, 1, 8, 2, 7], 1: [3, 6, 0]}
    for g in (0, 1):
        write(layout, buffers, g, logical_kv(layout, g, n), ids[g])
    before = {g: D.total(units(layout, buffers, g, ids[g], start, n, 4)) for g in (0, 1)}
    rng = random.Random(7)
    for g in (0, 1):
        bs = layout.block_size(g)
        views = D.layer_views(layout, buffers, g)
        for trial in range(60):
            _, _, view = views[rng.randrange(len(views))]
            token = rng.randrange(start, n)
            head, dim = rng.randrange(view.shape[2]), rng.randrange(view.shape[3])
            bit = trial % 16 if trial < 32 else rng.randrange(16)  # every bit of a 16-bit element, then random
            view[ids[g][token // bs], token % bs, head, dim] ^= (1 << bit) if bit < 15 else -(1 << 15)
            after = D.total(units(layout, buffers, g, ids[g], start, n, 4))
            view[ids[g][token // bs], token % bs, head, dim] ^= (1 << bit) if bit < 15 else -(1 << 15)
            assert after != before[g], f"group {g}: flipping bit {bit} of token {token} went unnoticed"
        assert D.total(units(layout, buffers, g, ids[g], start, n, 4)) == before[g]


def test_tokens_outside_the_range_and_other_blocks_do_not_count() -> None:
    """The digest covers exactly the pulled tokens: the reader's cached prefix, the padding after the
    prompt in its last block and other requests' blocks may hold anything."""
    n, bs = 10, 4
    groups = (KVCacheGroupSpec(0, AttentionKind.FULL, (0,), bs),)
    layout, buffers = make(LayoutKind.PER_LAYER, BlockOrder.NHD, groups, num_blocks=6)
    ids = [4, 1, 3]
    write(layout, buffers, 0, logical_kv(layout, 0, n), ids)
    before = units(layout, buffers, 0, ids, 4, n, bs).tolist()
    _, _, view = D.layer_views(layout, buffers, 0)[0]
    view[4] ^= 0x55  # block 0: tokens 0..3, before the range
    view[1 + 4, 2] ^= 1  # block 5: not the request's
    view[3, 2:] ^= 1  # tokens 10, 11: past the prompt in its last block
    assert units(layout, buffers, 0, ids, 4, n, bs).tolist() == before


def test_fault_injection_flips_a_bit_in_every_block_of_the_range() -> None:
    n, bs = 13, 4
    groups = (KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1), bs),)
    layout, buffers = make(LayoutKind.CROSS_LAYER, BlockOrder.HND, groups, num_blocks=6)
    ids = [5, 0, 2, 4]
    write(layout, buffers, 0, logical_kv(layout, 0, n), ids)
    clean = [b.clone() for b in buffers]
    job = D.DigestJob(0, ids, 4, n, bs, 0, 2, 0, corrupt=True)
    digest_job(layout, buffers, job)
    changed = {i for i in range(6) for b, c in zip(buffers, clean, strict=True)
               if not torch.equal(b.view(6, -1)[i], c.view(6, -1)[i])}
    assert changed == {0, 2, 4}  # blocks 1..3 of the request (tokens 4..12), not block 0 (cached) nor others


def test_bad_jobs_are_refused() -> None:
    layout, buffers = make(LayoutKind.PER_LAYER, BlockOrder.NHD, hybrid_groups(4, 8), num_blocks=6)
    for job, match in [(D.DigestJob(2, [0], 0, 4, 4, 0, 1, 0), "group 2"),
                       (D.DigestJob(1, [0, 1], 0, 9, 3, 0, 1, 0), "unit 3"),
                       (D.DigestJob(1, [0, 1], 0, 9, 12, 0, 1, 0), "unit 12"),
                       (D.DigestJob(0, [0, 1], 2, 8, 4, 0, 1, 0), "start 2"),
                       (D.DigestJob(0, [0], 0, 5, 4, 0, 1, 0), "outside 1 blocks"),
                       (D.DigestJob(0, [0, 1], 0, 8, 4, 1, 3, 0), "heads"),
                       (D.DigestJob(0, [0, 6], 0, 8, 4, 0, 1, 0), "block ids")]:
        with pytest.raises(ValueError, match=match):
            digest_job(layout, buffers, job)


def test_ticket_units_sum_the_pulled_range() -> None:
    assert D.ticket_units([1, 2, 3, 2**32 - 1], 4, 4, 14) == (2 + 3 + 2**32 - 1) % 2**32
    with pytest.raises(ValueError, match="not on the ticket's digest unit"):
        D.ticket_units([1, 2], 4, 2, 8)
    with pytest.raises(ValueError, match="2 digest units"):
        D.ticket_units([1, 2], 4, 0, 12)


# ---- the exporter: a ticket's digests, device and host-tier parts --------------------------------------
class TensorRank:
    """A KV rank over plain tensors (the exporter's digest path; no NIXL: nothing is read here)."""

    def __init__(self, layout, buffers, host_layout=None, host_buffers=()) -> None:
        self.name, self.layout, self.buffers = "owner-tp0", layout, buffers
        self.host_layout, self.host_buffers = host_layout, host_buffers
        self.regions = tuple(MemoryRegion(i, 0, 1, 0, "DRAM") for i, _ in enumerate(buffers))
        self.host_regions = ()
        self.state_region = None
        self.staging = None

    def metadata(self) -> bytes:
        return b""

    async def digest(self, jobs):
        return [digest_job(*((self.host_layout, self.host_buffers) if j.host_tier else
                               (self.layout, self.buffers)), j) for j in jobs]


def test_a_ticket_digests_its_host_tier_part_and_device_part_as_one_prompt() -> None:
    """Tokens 0..15 from the owner's host tier, 16..29 from its device blocks; the reader holds the whole
    prompt in its own (finer) blocks, and its digest of any unit-aligned suffix matches the ticket's."""
    n, host_tokens = 30, 16
    groups = (KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1), 8),)
    layout, buffers = make(LayoutKind.CROSS_LAYER, BlockOrder.NHD, groups, num_blocks=6)
    host_layout, host_buffers = make(LayoutKind.CROSS_LAYER, BlockOrder.NHD, groups, num_blocks=8)
    values = logical_kv(layout, 0, n)
    write(host_layout, host_buffers, 0, values[:, :, :host_tokens], [7, 2])
    device_ids = [0, 0, 4, 1]  # entries for the host part are placeholders, never read
    write(layout, buffers, 0, torch.cat([values[:, :, :host_tokens], values[:, :, host_tokens:]], dim=2), [5, 3, 4, 1])
    identity = KVIdentity.of(architecture="llama", num_layers=2, num_kv_heads=2, head_dim=8, layout=layout)
    exporter = KVExporter(engine_id="owner", model_name="m", identity=identity,
                          ranks=[TensorRank(layout, buffers, host_layout, host_buffers)])
    ticket = asyncio.run(exporter.hand_out("r", [device_ids], num_tokens=n, first_token_id=1, handshake_address="x",
                                           reader_tp_size=1, prompt_hash=PROMPT_HASH, host_block_ids=[[7, 2]],
                                           num_host_tokens=host_tokens,
                                           reader_block_size=4))
    (entry,) = ticket.digests
    assert (entry.group_id, entry.reader_rank, entry.unit, len(entry.digests)) == (0, 0, 4, 8)
    reader, reader_buffers = make(LayoutKind.PER_LAYER, BlockOrder.HND, (KVCacheGroupSpec(0, AttentionKind.FULL,
                                                                                           (0, 1), 4),), 9)
    ids = [8, 0, 7, 1, 6, 2, 5, 3]
    write(reader, reader_buffers, 0, values, ids)
    for start in (0, 4, 12, 16, 28):
        assert D.total(units(reader, reader_buffers, 0, ids, start, n, 4)) == \
            D.ticket_units(entry.digests, 4, start, n)
    # A wrong host-tier block in the ticket's source would not match: the host part is really covered.
    host_buffers[0].view(8, -1)[2, 0] += 1
    again = asyncio.run(exporter.hand_out("r2", [device_ids], num_tokens=n, first_token_id=1, handshake_address="x",
                                          reader_tp_size=1, prompt_hash=PROMPT_HASH, host_block_ids=[[7, 2]],
                                          num_host_tokens=host_tokens,
                                          reader_block_size=4))
    assert list(again.digests[0].digests)[2:4] != list(entry.digests)[2:4]
    assert list(again.digests[0].digests)[4:] == list(entry.digests)[4:]


def test_no_digest_when_it_is_off() -> None:
    groups = (KVCacheGroupSpec(0, AttentionKind.FULL, (0,), 4),)
    layout, buffers = make(LayoutKind.PER_LAYER, BlockOrder.NHD, groups, num_blocks=4)
    identity = KVIdentity.of(architecture="llama", num_layers=1, num_kv_heads=2, head_dim=8, layout=layout,
                             kv_digest="off")
    exporter = KVExporter(engine_id="owner", model_name="m", identity=identity, ranks=[TensorRank(layout, buffers)])
    ticket = asyncio.run(exporter.hand_out("r", [[0, 1]], num_tokens=7, first_token_id=1, handshake_address="x",
                                           reader_tp_size=1, prompt_hash=PROMPT_HASH))
    assert not ticket.digests


# ---- the Triton kernel against the host path -----------------------------------------------------------
@pytest.mark.parametrize(("kind", "order"), LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
def test_the_triton_kernel_computes_the_host_digest(kind: LayoutKind, order: BlockOrder, dtype: str) -> None:
    from services.kv.digest.kernel import digest_units_cuda

    layout, buffers = make(kind, order, hybrid_groups(8, 16), num_blocks=12, dtype=dtype)
    n = 45
    for g in (0, 1):
        bs = layout.block_size(g)
        num = -(-n // bs)
        # Scattered blocks (their ids go to the device); in bf16 also one run (only its first id does) and a run
        # after a block elsewhere (a run from the second block: what a pull from a mid-prompt start reads).
        runs = [list(range(12 - num, 12)), [0, *range(12 - num + 1, 12)]] if dtype == "bfloat16" else []
        for ids in (random.Random(g).sample(range(12), num), *runs):
            write(layout, buffers, g, logical_kv(layout, g, n), ids)
            views = D.layer_views(layout, buffers, g)
            last_head = (layout.kv_heads(g) - 1, layout.kv_heads(g))
            for start, unit, heads in [(0, bs, (0, layout.kv_heads(g))), (8, 4, (0, 1)), (40, 8, last_head),
                                       (32, 2 * bs, (0, 1))]:  # a unit of two blocks (a coarser owner, no hint)
                job = D.DigestJob(g, ids, start, n, unit, *heads, 3)
                want = D.digest_units_host(views, bs, job).cpu().tolist()
                got = [u & D.MASK32 for u in digest_units_cuda(views, bs, job).cpu().tolist()]
                assert got == want, (g, ids, start, unit, heads)


@pytest.mark.parametrize(("head_dim", "align"), [(8, 4), (6, 1)], ids=["even-rows", "odd-rows"])
def test_the_triton_kernel_computes_the_host_digest_of_rows_of_any_width(head_dim: int, align: int) -> None:
    """Rows of 4 bf16 words (every address a multiple of 16 bytes: read four words a load), and rows of 3
    (head_dim 6: not a power of two, so the kernel masks a word of its tile, and not aligned: read a word a load),
    from mid-block starts and over head slices: the host digest."""
    from services.kv.digest.kernel import _view_table, digest_units_cuda

    layout, buffers = make(LayoutKind.CROSS_LAYER, BlockOrder.NHD, hybrid_groups(8, 16)[:1], num_blocks=6,
                           heads=3, head_dim=head_dim)
    n, ids = 21, [4, 0, 2]
    write(layout, buffers, 0, logical_kv(layout, 0, n), ids)
    views = D.layer_views(layout, buffers, 0)
    assert _view_table(views)[2] == align
    for start, unit, heads in [(0, 8, (0, 3)), (4, 4, (1, 3))]:
        job = D.DigestJob(0, ids, start, n, unit, *heads, 1)
        want = D.digest_units_host(views, 8, job).cpu().tolist()
        assert [u & D.MASK32 for u in digest_units_cuda(views, 8, job).cpu().tolist()] == want
