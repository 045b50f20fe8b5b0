"""Transfers of MLA KV groups (DeepSeek's latent rows): wire, compat hash, topology, planner, prepared
lists and digest with one plane per layer and one replicated "head", the row.

The invariant throughout: a pull moves exactly one latent row (``kv_lora_rank + qk_rope_head_dim``
elements) per token and layer, byte-exact, in every layout pair and block-size ratio; under TP each
reading rank reads the whole row once, from one owner rank.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from services.kv.digest import scheme as D
from services.kv.digest.runner import digest_job
from services.kv.plan.planner import Descriptor, apply_plan, plan_groups, plan_transfer, unit_runs
from services.kv.plan.read_lists import list_layout
from services.kv.spec.compat import CompatInfo, KVCompatibilityError, KVIdentity, check_compatible, parse_groups
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.pair_support import group_heads_from_fields
from services.kv.spec.topology import (
    BlockPiece,
    RankRead,
    group_rank_reads,
    group_readers_per_remote_rank,
    map_block_arrays,
    map_unit_arrays,
    window_start_token,
)
from services.kv.spec.wire import MemoryRegion, group_from_proto, group_to_proto, layout_from_proto, layout_to_proto

KV_LORA_RANK, ROPE_DIM = 32, 8
ROW = KV_LORA_RANK + ROPE_DIM
LAYERS = (0, 1, 2)
PER, CROSS, HEADS = LayoutKind.PER_LAYER, LayoutKind.CROSS_LAYER, LayoutKind.HEADS_OUTER
NHD, HND = BlockOrder.NHD, BlockOrder.HND
KINDS = [(PER, NHD), (PER, HND), (CROSS, NHD), (CROSS, HND), (HEADS, HND)]
WHOLE = RankRead(0, (0, 1), (0, 1))


def mla(kind: LayoutKind, order: BlockOrder, block_size: int = 8, num_blocks: int = 12, row: int = ROW,
        dtype: str = "bfloat16") -> KVLayoutSpec:
    group = KVCacheGroupSpec(0, AttentionKind.MLA, LAYERS, block_size, None, 1, row)
    return KVLayoutSpec(kind, order, num_blocks, 1, row, dtype, (group,))


def full(block_size: int = 8, heads: int = 1, head_dim: int = ROW) -> KVLayoutSpec:
    group = KVCacheGroupSpec(0, AttentionKind.FULL, LAYERS, block_size)
    return KVLayoutSpec(CROSS, NHD, 12, heads, head_dim, "bfloat16", (group,))


def identity(layout: KVLayoutSpec) -> KVIdentity:
    return KVIdentity.of(architecture="deepseek_v3", num_layers=len(LAYERS), num_kv_heads=1,
                         head_dim=layout.head_dim, layout=layout)


def rows_of(spec: KVLayoutSpec, buffers: list[np.ndarray], table: np.ndarray, start: int, end: int) -> np.ndarray:
    """The logical [layers, tokens, row] bytes of tokens [start, end) read through block table ``table``."""
    bs, elem = spec.block_size(0), spec.element_size
    out = []
    for layer in LAYERS:
        tokens = []
        for t in range(start, end):
            off = spec.byte_offset(layer, 0, int(table[t // bs]), t % bs, 0)
            tokens.append(buffers[spec.buffer_of_layer(layer).index][off:off + ROW * elem])
        out.append(np.stack(tokens))
    return np.stack(out)


def random_bytes(spec: KVLayoutSpec, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.integers(0, 256, b.num_bytes, dtype=np.uint8) for b in spec.buffers()]


# ---- wire and compat ------------------------------------------------------------------------------


def test_the_mla_kind_crosses_the_wire() -> None:
    spec = mla(CROSS, NHD)
    group = spec.groups[0]
    assert group_from_proto(group_to_proto(group)) == group
    assert layout_from_proto(layout_to_proto(spec)) == spec


def test_the_hash_spells_out_the_row_width_and_its_replication() -> None:
    fields = CompatInfo.of_identity(identity(mla(CROSS, NHD))).fields
    assert parse_groups(fields) == [("mla", None, list(LAYERS), 1, ROW, "replicated")]
    assert '"replicated"' in fields["kv_groups"] and str(ROW) in fields["kv_groups"]
    assert group_heads_from_fields(fields) == {0: 1}
    # A TP-sharded engine (other placement and block size) hashes alike: the row is whole on each rank.
    sharded = KVIdentity.of(architecture="deepseek_v3", num_layers=3, num_kv_heads=1, head_dim=ROW,
                            layout=mla(PER, NHD, block_size=16), group_kv_heads={0: 1})
    assert CompatInfo.of_identity(sharded).hash == CompatInfo.of_identity(identity(mla(CROSS, NHD))).hash


def test_a_different_kv_lora_rank_is_refused_naming_the_group_and_row_width() -> None:
    local = CompatInfo.of_identity(identity(mla(CROSS, NHD)))
    remote = CompatInfo.of_identity(identity(mla(CROSS, NHD, row=ROW + 16)))
    with pytest.raises(KVCompatibilityError, match=rf"KV group 0 \(mla\): row_width local {ROW} vs remote {ROW + 16}"):
        check_compatible(local, remote.fields, remote.hash)


def test_mla_against_full_attention_is_refused_naming_the_kind() -> None:
    local = CompatInfo.of_identity(identity(mla(CROSS, NHD)))
    remote = CompatInfo.of_identity(identity(full()))
    with pytest.raises(KVCompatibilityError, match=r"KV group 0 \(mla\): kind local mla vs remote full") as err:
        check_compatible(local, remote.fields, remote.hash)
    assert {g.field for g in err.value.group_differences} >= {"kind", "tp"}


def test_a_forged_placement_is_unreadable_not_misread() -> None:
    fields = dict(CompatInfo.of_identity(identity(mla(CROSS, NHD))).fields)
    fields["kv_groups"] = fields["kv_groups"].replace("replicated", "split")
    assert parse_groups(fields) is None


# ---- topology ------------------------------------------------------------------------------------


def test_mla_attends_over_the_whole_context() -> None:
    a, b = mla(CROSS, NHD, 8).groups[0], mla(PER, NHD, 16).groups[0]
    assert window_start_token(a, b, 1000) == 0


@pytest.mark.parametrize(("local_tp", "remote_tp"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 8)])
def test_each_reading_rank_reads_the_whole_row_once_from_one_owner_rank(local_tp: int, remote_tp: int) -> None:
    for rank in range(local_tp):
        reads = group_rank_reads(local_tp, rank, remote_tp, {0: 1})
        assert reads == {rank % remote_tp: {0: RankRead(rank % remote_tp, (0, 1), (0, 1))}}
    readers = group_readers_per_remote_rank(local_tp, remote_tp, {0: 1})
    assert sum(readers) == local_tp  # one READ per reading rank, never per query head
    assert readers == tuple(len(range(r, local_tp, remote_tp)) for r in range(remote_tp))


# ---- planner -------------------------------------------------------------------------------------


#: Every pair of layouts of one block order (the order is hashed: NHD and HND engines never pair).
PAIRS = [(src, dst) for src, dst in itertools.product(KINDS, KINDS) if src[1] is dst[1]]


@pytest.mark.parametrize(("remote_kind", "local_kind"), PAIRS, ids=lambda k: f"{k[0].value}-{k[1].value}")
@pytest.mark.parametrize(("remote_bs", "local_bs"), [(8, 8), (16, 4), (4, 16)])
def test_plans_move_one_row_per_token_and_layer_byte_exact(remote_kind, local_kind, remote_bs: int,
                                                           local_bs: int) -> None:
    remote, local = mla(*remote_kind, block_size=remote_bs), mla(*local_kind, block_size=local_bs)
    rng = np.random.default_rng(remote_bs * 31 + local_bs)
    num_tokens, start = 45, 16  # a partial last block on both sides, a cached prefix of 16 tokens
    r_table = rng.permutation(remote.num_blocks)[: -(-num_tokens // remote_bs)]
    l_table = rng.permutation(local.num_blocks)[: -(-num_tokens // local_bs)]
    pieces = map_block_arrays(r_table, remote_bs, l_table, local_bs, num_tokens, start)
    plan = plan_transfer(remote, local, 0, pieces, WHOLE)
    assert plan.total_bytes == (num_tokens - start) * len(LAYERS) * ROW * remote.element_size
    src, dst = random_bytes(remote, rng), [np.zeros(b.num_bytes, dtype=np.uint8) for b in local.buffers()]
    apply_plan(plan, src, dst)
    np.testing.assert_array_equal(rows_of(local, dst, l_table, start, num_tokens),
                                  rows_of(remote, src, r_table, start, num_tokens))
    assert not rows_of(local, dst, l_table, 0, start).any()  # the cached prefix is not written


def test_descriptor_counts_and_offsets_are_exact() -> None:
    """Consecutive blocks on both sides, equal block sizes: one descriptor per layer between per-layer
    layouts (no V plane), one in all between cross-layer or heads-outer ones, at the rows' own offsets."""
    bs, elem = 8, 2
    page = bs * ROW * elem  # one layer's block: 8 rows
    blocks = [3, 4, 5]
    pieces = map_block_arrays(blocks, bs, [6, 7, 8], bs, 3 * bs)

    per = plan_transfer(mla(PER, NHD), mla(PER, NHD), 0, pieces, WHOLE)
    assert per.num_descriptors == len(LAYERS)
    assert per.src_buffer.tolist() == per.dst_buffer.tolist() == [0, 1, 2]
    assert per.src_offset.tolist() == [3 * page] * 3 and per.dst_offset.tolist() == [6 * page] * 3
    assert per.length.tolist() == [3 * page] * 3

    for kind, order in ((CROSS, NHD), (CROSS, HND), (HEADS, HND)):
        plan = plan_transfer(mla(kind, order), mla(kind, order), 0, pieces, WHOLE)
        block = len(LAYERS) * page
        assert plan.descriptors() == [Descriptor(0, 3 * block, 0, 6 * block, 3 * block)]

    # A cross-layer block into per-layer buffers: a run per (block, layer), merged along consecutive blocks.
    mixed = plan_transfer(mla(CROSS, NHD), mla(PER, NHD), 0, pieces, WHOLE)
    assert mixed.num_descriptors == 3 * len(LAYERS) and set(mixed.length.tolist()) == {page}
    # One token: one row per layer, at (block, token) of each side.
    one = plan_transfer(mla(PER, HND), mla(PER, HND), 0, [BlockPiece(2, 5, 9, 5, 1)], WHOLE)
    assert one.length.tolist() == [ROW * elem] * 3
    assert one.src_offset.tolist() == [2 * page + 5 * ROW * elem] * 3
    assert one.dst_offset.tolist() == [9 * page + 5 * ROW * elem] * 3


def test_a_row_width_or_kind_mismatch_is_refused_by_the_planner() -> None:
    pieces = map_block_arrays([0], 8, [0], 8, 8)
    with pytest.raises(ValueError, match="row_width differs"):
        plan_transfer(mla(CROSS, NHD, row=ROW + 8), mla(CROSS, NHD), 0, pieces, WHOLE)
    with pytest.raises(ValueError, match="attention differs"):
        plan_transfer(full(), mla(CROSS, NHD), 0, pieces, WHOLE)


@pytest.mark.parametrize(("remote_tp", "local_tp"), [(1, 2), (2, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("kind", [(PER, NHD), (CROSS, NHD), (HEADS, HND)], ids=lambda k: k[0].value)
def test_tp_every_reading_rank_gets_the_whole_row_from_one_owner_rank(remote_tp: int, local_tp: int,
                                                                      kind) -> None:
    """Synthetic TP: every rank's layout holds the whole row (MLA is not sharded); each reading rank's plan
    reads one owner rank and moves exactly the ideal bytes, byte-exact against that rank's rows."""
    rng = np.random.default_rng(remote_tp * 10 + local_tp)
    remote, local = mla(*kind, block_size=16), mla(*kind, block_size=4)
    num_tokens = 37
    r_table, l_table = rng.permutation(12)[:3], rng.permutation(12)[:10]
    owners = [random_bytes(remote, rng) for _ in range(remote_tp)]  # each owner rank's own bytes
    total = 0
    for rank in range(local_tp):
        (owner, reads), = group_rank_reads(local_tp, rank, remote_tp, {0: 1}).items()
        pieces = map_block_arrays(r_table, 16, l_table, 4, num_tokens)
        plan = plan_groups(remote, local, {0: pieces}, reads)
        dst = [np.zeros(b.num_bytes, dtype=np.uint8) for b in local.buffers()]
        apply_plan(plan, owners[owner], dst)
        np.testing.assert_array_equal(rows_of(local, dst, l_table, 0, num_tokens),
                                      rows_of(remote, owners[owner], r_table, 0, num_tokens))
        assert plan.total_bytes == num_tokens * len(LAYERS) * ROW * remote.element_size
        total += plan.total_bytes
    assert total == local_tp * num_tokens * len(LAYERS) * ROW * remote.element_size


@pytest.mark.parametrize(("remote_kind", "local_kind"), [((CROSS, NHD), (PER, NHD)), ((PER, HND), (CROSS, HND)),
                                                         ((CROSS, NHD), (CROSS, NHD))], ids=str)
def test_prepared_lists_copy_what_the_padded_plan_copies(remote_kind, local_kind) -> None:
    remote, local = mla(*remote_kind, block_size=16), mla(*local_kind, block_size=8)
    runs = unit_runs(remote, local, 0, WHOLE)
    assert runs is not None and runs.num_planes in (1, len(LAYERS))
    base = 1 << 40
    regions = [tuple(MemoryRegion(b.index, (b.index + 1) * base, b.num_bytes, 0, "DRAM") for b in s.buffers())
               for s in (remote, local)]
    table = list_layout(remote, regions[0], local, regions[1], {0: WHOLE})
    rng = np.random.default_rng(3)
    r_table, l_table, n, start = rng.permutation(12)[:3], rng.permutation(12)[:5], 37, 8
    units = map_unit_arrays(r_table, 16, l_table, 8, n, start)
    local_idx, remote_idx, num_bytes, _ = table.indices({0: units})
    plan = plan_transfer(remote, local, 0, map_block_arrays(r_table, 16, l_table, 8, n, start), WHOLE,
                         pad_partial_blocks=True)
    assert num_bytes == plan.total_bytes == (40 - start) * len(LAYERS) * ROW * 2  # padded to the unit's end
    src = random_bytes(remote, rng)
    want = [np.zeros(b.num_bytes, dtype=np.uint8) for b in local.buffers()]
    got = [np.zeros(b.num_bytes, dtype=np.uint8) for b in local.buffers()]
    apply_plan(plan, src, want)
    for (ra, length, _), (la, _, _) in zip(table.remote_rows[remote_idx].tolist(),
                                           table.local_rows[local_idx].tolist(), strict=True):
        sb, so = divmod(ra, base)
        db, do = divmod(la, base)
        got[db - 1][do:do + length] = src[sb - 1][so:so + length]
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)


# ---- digest --------------------------------------------------------------------------------------


def _tensors(spec: KVLayoutSpec) -> list[torch.Tensor]:
    return [torch.zeros(b.num_bytes // spec.element_size, dtype=torch.bfloat16) for b in spec.buffers()]


def _write(spec: KVLayoutSpec, buffers: list[torch.Tensor], values: torch.Tensor, table: list[int]) -> None:
    bs = spec.block_size(0)
    for i, (_, kv, view) in enumerate(D.layer_views(spec, buffers, 0)):
        assert kv == 0
        typed = view.view(torch.bfloat16)
        for t in range(values.shape[1]):
            typed[table[t // bs], t % bs, 0] = values[i, t]


@pytest.mark.parametrize(("kind", "order"), KINDS, ids=lambda k: k.value)
def test_the_digest_reads_one_plane_per_layer_and_is_layout_free(kind: LayoutKind, order: BlockOrder) -> None:
    n = 29
    values = torch.randn(len(LAYERS), n, ROW, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref_spec = mla(CROSS, NHD, block_size=4)
    ref = _tensors(ref_spec)
    ref_table = list(range(11, 3, -1))
    _write(ref_spec, ref, values, ref_table)
    spec = mla(kind, order, block_size=8)
    bufs = _tensors(spec)
    table = [5, 0, 9, 2]
    _write(spec, bufs, values, table)
    assert [kv for _, kv, _ in D.layer_views(spec, bufs, 0)] == [0, 0, 0]  # no V plane
    want = digest_job(ref_spec, ref, D.DigestJob(0, ref_table, 0, n, 4, 0, 1, 0))
    got = digest_job(spec, bufs, D.DigestJob(0, table, 0, n, 4, 0, 1, 0))
    assert got.tolist() == want.tolist()
    # A one-bit flip in the last layer's rope part of one row changes the digest.
    view = D.layer_views(spec, bufs, 0)[-1][2]
    view[table[2], 3, 0, -1] ^= 1
    assert D.total(digest_job(spec, bufs, D.DigestJob(0, table, 0, n, 4, 0, 1, 0))) != D.total(want)


@pytest.mark.parametrize(("kind", "order"), [(PER, NHD), (CROSS, HND), (HEADS, HND)], ids=lambda k: k.value)
def test_the_triton_kernel_computes_the_host_digest_of_latent_rows(kind: LayoutKind, order: BlockOrder) -> None:
    """The kernel walks the group's views as given: one per layer for MLA (rows of 40 elements, 20 words).
    Under Triton's interpreter on CPU; ``PDSERVE_TEST_DEVICE=cuda`` runs it on the GPU."""
    device = torch.device(os.environ.get("PDSERVE_TEST_DEVICE", "cpu"))
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is first imported
    from services.kv.digest.kernel import digest_units_cuda

    n = 21
    values = torch.randn(len(LAYERS), n, ROW, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    spec = mla(kind, order, block_size=8)
    bufs = [b.to(device) for b in _tensors(spec)]
    table = [7, 1, 4]
    _write(spec, bufs, values, table)
    views = D.layer_views(spec, bufs, 0)
    for start, unit in ((0, 8), (8, 4)):
        job = D.DigestJob(0, table, start, n, unit, 0, 1, 0)
        want = D.digest_units_host(views, 8, job).cpu().tolist()
        assert [u & D.MASK32 for u in digest_units_cuda(views, 8, job).cpu().tolist()] == want
