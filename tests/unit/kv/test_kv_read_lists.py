"""Prepared descriptor lists (``read_lists``): a pull's indices into them copy exactly the bytes the
planner's plan (partial blocks padded) copies, in as many descriptors as NIXL's merge leaves; and the
unit indices (``map_unit_arrays``) cover the same tokens as ``map_block_arrays``."""

from __future__ import annotations

import numpy as np
import pytest

from services.kv.plan.planner import apply_plan, plan_groups
from services.kv.plan.read_lists import list_layout
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.topology import RankRead, group_rank_reads, map_block_arrays, map_unit_arrays
from services.kv.spec.wire import MemoryRegion

PER, CROSS, HEADS = LayoutKind.PER_LAYER, LayoutKind.CROSS_LAYER, LayoutKind.HEADS_OUTER
NHD, HND = BlockOrder.NHD, BlockOrder.HND
_BASE = 1 << 40  # buffer i lives at (i + 1) << 40 in these fake address spaces


def layout(kind: LayoutKind, order: BlockOrder = NHD, *, heads: int = 4, block_sizes: tuple[int, ...] = (4,),
           num_blocks: int = 12) -> KVLayoutSpec:
    """One full group of 3 layers, or with two block sizes a hybrid: a sliding group (layers 0, 1, 3) and
    a full group (layer 2) with its own heads and head dim."""
    if len(block_sizes) == 1:
        groups = (KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1, 2), block_sizes[0]),)
    else:
        groups = (KVCacheGroupSpec(0, AttentionKind.SLIDING_WINDOW, (0, 1, 3), block_sizes[0], 6),
                  KVCacheGroupSpec(1, AttentionKind.FULL, (2,), block_sizes[1], None, max(heads // 2, 1), 16))
    return KVLayoutSpec(kind, order, num_blocks, heads, 8, "float16", groups)


def regions(spec: KVLayoutSpec) -> tuple[MemoryRegion, ...]:
    return tuple(MemoryRegion(b.index, (b.index + 1) * _BASE, b.num_bytes, 0, "DRAM") for b in spec.buffers())


def run_rows(src: list[np.ndarray], dst: list[np.ndarray], remote_rows: np.ndarray, local_rows: np.ndarray) -> None:
    """Copy (addr, len, dev) rows between the fake address spaces."""
    for (ra, n, _), (la, _, _) in zip(remote_rows.tolist(), local_rows.tolist(), strict=True):
        sb, so = divmod(ra, _BASE)
        db, do = divmod(la, _BASE)
        dst[db - 1][do : do + n] = src[sb - 1][so : so + n]


def merged_count(remote_rows: np.ndarray, local_rows: np.ndarray) -> int:
    """Descriptors after merging consecutive rows adjacent on both sides (what make_prepped_xfer does)."""
    r, q, n = (x.astype(np.int64) for x in (remote_rows[:, 0], local_rows[:, 0], remote_rows[:, 1]))
    return int(r.size - np.count_nonzero((r[:-1] + n[:-1] == r[1:]) & (q[:-1] + n[:-1] == q[1:])))


CASES = {
    # name: (remote spec, local spec, remote tp, local tp)
    "cross-equal": (layout(CROSS), layout(CROSS), 1, 1),
    "per-layer": (layout(PER), layout(PER), 1, 1),
    "cross-to-per": (layout(CROSS), layout(PER), 1, 1),
    "block-ratio": (layout(CROSS, block_sizes=(8,)), layout(PER, block_sizes=(4,)), 1, 1),
    "block-ratio-reversed": (layout(PER, block_sizes=(4,)), layout(CROSS, block_sizes=(8,)), 1, 1),
    "hnd-head-slices": (layout(CROSS, HND, heads=2), layout(CROSS, HND, heads=4), 2, 1),
    "nhd-head-slices": (layout(PER, heads=4), layout(PER, heads=2), 1, 2),
    "hybrid-cross": (layout(CROSS, block_sizes=(4, 4)), layout(CROSS, block_sizes=(4, 4)), 1, 1),
    "hybrid-ratios": (layout(CROSS, block_sizes=(4, 8)), layout(PER, block_sizes=(8, 4)), 1, 1),
    "heads-outer-1-to-2": (layout(HEADS, HND, heads=4), layout(HEADS, HND, heads=2), 1, 2),
    "heads-outer-2-to-1": (layout(HEADS, HND, heads=2), layout(HEADS, HND, heads=4), 2, 1),
    "heads-outer-to-cross": (layout(HEADS, HND, heads=4), layout(CROSS, HND, heads=2), 1, 2),
    "heads-outer-hybrid-ratios": (layout(HEADS, HND, block_sizes=(4, 8)),
                                  layout(HEADS, HND, heads=2, block_sizes=(8, 4)), 1, 2),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("tables", ["ascending", "shuffled"])
def test_prepared_indices_copy_what_the_padded_plan_copies(case: str, tables: str) -> None:
    remote, local, remote_tp, local_tp = CASES[case]
    rng = np.random.default_rng(7)
    heads = {g.group_id: remote.kv_heads(g.group_id) * remote_tp for g in remote.groups}
    num_tokens, start = 19, 4  # a partial last block, a cached first block
    for local_rank in range(local_tp):
        for reads in group_rank_reads(local_tp, local_rank, remote_tp, heads).values():
            ids = {}
            for side, spec in (("remote", remote), ("local", local)):
                ids[side] = {g.group_id: (rng.permutation(spec.num_blocks) if tables == "shuffled"
                                          else np.arange(spec.num_blocks))[: -(-num_tokens // g.block_size)]
                             for g in spec.groups}
            pieces, units = {}, {}
            for rg, lg in zip(remote.groups, local.groups, strict=True):
                args = (ids["remote"][rg.group_id], rg.block_size, ids["local"][lg.group_id], lg.block_size,
                        num_tokens, start)
                pieces[rg.group_id], units[rg.group_id] = map_block_arrays(*args), map_unit_arrays(*args)
            plan = plan_groups(remote, local, pieces, reads, pad_partial_blocks=True)
            table = list_layout(remote, regions(remote), local, regions(local), reads)
            local_idx, remote_idx, num_bytes, num_descriptors = table.indices(units)
            assert local_idx.dtype == remote_idx.dtype == np.int32
            src = [rng.integers(0, 256, b.num_bytes, dtype=np.uint8) for b in remote.buffers()]
            want = [np.zeros(b.num_bytes, dtype=np.uint8) for b in local.buffers()]
            got = [np.zeros(b.num_bytes, dtype=np.uint8) for b in local.buffers()]
            apply_plan(plan, src, want)
            run_rows(src, got, table.remote_rows[remote_idx], table.local_rows[local_idx])
            for w, g in zip(want, got, strict=True):
                np.testing.assert_array_equal(g, w)
            assert num_bytes == plan.total_bytes
            count = merged_count(table.remote_rows[remote_idx], table.local_rows[local_idx])
            assert num_descriptors == count == plan.num_descriptors  # NIXL's merge leaves what the planner's does


def test_whole_cross_layer_blocks_are_one_entry_each_and_adjacent_ones_one_descriptor() -> None:
    spec = layout(CROSS)
    table = list_layout(spec, regions(spec), spec, regions(spec), {0: RankRead(0, (0, 4), (0, 4))})
    assert table.remote_rows.shape == (spec.num_blocks, 3)
    assert table.remote_rows[:, 1].tolist() == [spec.block_bytes(0)] * spec.num_blocks
    units = map_unit_arrays([3, 4, 5, 9], 4, [0, 1, 2, 3], 4, 16)
    local_idx, remote_idx, num_bytes, num_descriptors = table.indices({0: units})
    assert remote_idx.tolist() == [3, 4, 5, 9] and local_idx.tolist() == [0, 1, 2, 3]
    assert (num_bytes, num_descriptors) == (4 * spec.block_bytes(0), 2)


@pytest.mark.parametrize(("remote_tp", "local_tp"), [(1, 2), (2, 1)])
def test_heads_outer_head_slices_are_an_entry_per_head_and_consecutive_units_merge(remote_tp: int,
                                                                                   local_tp: int) -> None:
    """Between different TP sizes a heads-outer unit is one entry per head read (a head's plane holds every
    block), so a pull of N consecutive blocks is one descriptor per head and READ; fragmented blocks are one
    per (head, block); cross-layer HND blocks one per (block, layer, K/V)."""
    heads = 4
    remote, local = layout(HEADS, HND, heads=heads // remote_tp), layout(HEADS, HND, heads=heads // local_tp)
    consecutive = map_unit_arrays([2, 3, 4, 5, 6], 4, [7, 8, 9, 10, 11], 4, 20)
    fragmented = map_unit_arrays([2, 4, 6, 8, 10], 4, [11, 9, 7, 5, 3], 4, 20)
    for local_rank in range(local_tp):
        for reads in group_rank_reads(local_tp, local_rank, remote_tp, {0: heads}).values():
            read_heads = reads[0].num_heads
            assert read_heads == heads // max(remote_tp, local_tp)
            table = list_layout(remote, regions(remote), local, regions(local), reads)
            assert table.remote_rows.shape == (remote.num_blocks * read_heads, 3)  # an entry per (block, head)
            assert table.local_rows.shape == (local.num_blocks * read_heads, 3)
            slice_bytes = 5 * min(remote.block_bytes(0), local.block_bytes(0))  # the reader's heads or the owner's
            _, remote_idx, num_bytes, num_descriptors = table.indices({0: consecutive})
            assert (num_bytes, num_descriptors) == (slice_bytes, read_heads)
            assert table.indices({0: fragmented})[2:] == (slice_bytes, 5 * read_heads)
    cross_r, cross_l = layout(CROSS, HND, heads=heads // remote_tp), layout(CROSS, HND, heads=heads // local_tp)
    reads = next(iter(group_rank_reads(local_tp, 0, remote_tp, {0: heads}).values()))
    _, _, _, cross_descriptors = list_layout(cross_r, regions(cross_r), cross_l, regions(cross_l), reads).indices(
        {0: consecutive})
    assert cross_descriptors == 5 * 2 * 3  # a run per (block, layer, K/V)


def test_lists_past_the_entry_cap_are_not_prepared() -> None:
    spec = layout(PER)
    reads = {0: RankRead(0, (0, 4), (0, 4))}
    assert list_layout(spec, regions(spec), spec, regions(spec), reads, max_entries=6 * spec.num_blocks) is not None
    assert list_layout(spec, regions(spec), spec, regions(spec), reads, max_entries=6 * spec.num_blocks - 1) is None


@pytest.mark.parametrize("sizes", [(4, 4), (16, 4), (4, 16)])
def test_unit_indices_cover_the_tokens_of_the_block_pieces(sizes: tuple[int, int]) -> None:
    remote_bs, local_bs = sizes
    remote_ids, local_ids = [7, 2, 9, 4, 11, 5], [3, 8, 1, 6, 10, 0, 12, 13]
    n = 22
    for start in range(0, 21, min(sizes)):
        pieces = map_block_arrays(remote_ids, remote_bs, local_ids, local_bs, n, start)
        u_r, u_l = map_unit_arrays(remote_ids, remote_bs, local_ids, local_bs, n, start)
        unit = min(sizes)
        rb, ro, lb, lo, _ = pieces
        assert u_r.tolist() == (rb * (remote_bs // unit) + ro // unit).tolist()
        assert u_l.tolist() == (lb * (local_bs // unit) + lo // unit).tolist()


def test_unit_indices_refuse_what_block_pieces_refuse() -> None:
    with pytest.raises(ValueError, match="repeat"):
        map_unit_arrays([1, 1, 2], 4, [0, 1, 2], 4, 12)
    with pytest.raises(ValueError, match="repeat"):
        map_unit_arrays([1, 2, 3], 8, [5, 5, 6, 7, 8, 9], 4, 24)
    with pytest.raises(ValueError, match="need"):
        map_unit_arrays([1, 2], 4, [0, 1, 2], 4, 12)
    with pytest.raises(ValueError, match="boundary"):
        map_unit_arrays([1, 2, 3], 4, [0, 1, 2], 4, 12, start_token=2)
    # an out-of-window placeholder repeats before the start: never read, not refused
    assert map_unit_arrays([0, 0, 3], 4, [0, 0, 5], 4, 12, start_token=8)[0].tolist() == [3]
