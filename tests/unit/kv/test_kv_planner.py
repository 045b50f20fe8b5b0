"""The descriptor planner: byte-exact against a naive per-row copy, and the fewest descriptors."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.parallel import ParallelConfig
from services.kv.plan.planner import Descriptor, TransferPlan, apply_plan, plan_groups, plan_transfer
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import DTYPE_SIZES, BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.topology import BlockPiece, RankRead, map_block_arrays, map_blocks, rank_reads, window_start_token

PER, CROSS, HEADS = LayoutKind.PER_LAYER, LayoutKind.CROSS_LAYER, LayoutKind.HEADS_OUTER
NHD, HND = BlockOrder.NHD, BlockOrder.HND
ALL = RankRead(0, (0, 4), (0, 4))


def spec(
    kind: LayoutKind,
    order: BlockOrder = NHD,
    block_size: int = 4,
    heads: int = 4,
    layers: int = 3,
    num_blocks: int = 16,
    head_dim: int = 8,
    dtype: str = "float16",
) -> KVLayoutSpec:
    group = KVCacheGroupSpec(0, AttentionKind.FULL, tuple(range(layers)), block_size)
    return KVLayoutSpec(kind, order, num_blocks, heads, head_dim, dtype, (group,))


def hybrid(
    kind: LayoutKind,
    order: BlockOrder = NHD,
    *,
    sliding_bs: int = 4,
    full_bs: int = 4,
    window: int = 6,
    full_heads: int = 2,
    full_head_dim: int = 16,
    num_blocks: int = 24,
) -> KVLayoutSpec:
    """Gemma-4-like: layers 0, 1, 3, 4 sliding (4 heads of 8), layer 2 full (2 heads of 16);
    layer 5 reads layer 2's KV (KV sharing) and is in no group."""
    sliding = KVCacheGroupSpec(0, AttentionKind.SLIDING_WINDOW, (0, 1, 3, 4), sliding_bs, window)
    full = KVCacheGroupSpec(1, AttentionKind.FULL, (2,), full_bs, None, full_heads, full_head_dim)
    return KVLayoutSpec(kind, order, num_blocks, 4, 8, "float16", (sliding, full))


def random_buffers(s: KVLayoutSpec, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.integers(0, 256, b.num_bytes, dtype=np.uint8) for b in s.buffers()]


def copy_rows(
    src_spec: KVLayoutSpec,
    src: list[np.ndarray],
    dst_spec: KVLayoutSpec,
    dst: list[np.ndarray],
    layer: int,
    kv: int,
    src_at: tuple[int, int, int],
    dst_at: tuple[int, int, int],
) -> None:
    """Naive reference: one (block, token, head) row, element by element, through byte_offset."""
    e = src_spec.element_size
    s = src_spec.byte_offset(layer, kv, *src_at)
    d = dst_spec.byte_offset(layer, kv, *dst_at)
    sb, db = src[src_spec.buffer_of_layer(layer).index], dst[dst_spec.buffer_of_layer(layer).index]
    for i in range(src_spec.group_head_dim(src_spec.group_of_layer(layer).group_id)):
        db[d + i * e : d + (i + 1) * e] = sb[s + i * e : s + (i + 1) * e]


# ---- the property test -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    order: BlockOrder
    remote_kind: LayoutKind
    local_kind: LayoutKind
    num_kv_heads: int
    head_dim: int
    dtype: str
    layer_groups: tuple[int, ...]  # group id of each layer
    window: int
    remote_bs: int
    local_bs: int
    remote_tp: int
    local_tp: int
    num_tokens: int
    cached_local_blocks: int
    shuffle_remote: bool
    shuffle_local: bool
    seed: int


@st.composite
def cases(draw) -> Case:
    num_layers = draw(st.integers(1, 3))
    two_groups = num_layers > 1 and draw(st.booleans())
    layer_groups = (0,) * num_layers
    if two_groups:
        layer_groups = tuple(draw(st.lists(st.integers(0, 1), min_size=num_layers, max_size=num_layers)))
        layer_groups = (0, 1) + layer_groups[2:] if len(set(layer_groups)) < 2 else layer_groups
    small = draw(st.sampled_from([1, 2, 4]))
    a, b = draw(st.sampled_from([(1, 4), (1, 2), (1, 1), (2, 1), (4, 1)]))
    heads = draw(st.sampled_from([1, 2, 4]))
    local_bs = small * b
    num_tokens = draw(st.integers(1, 24))
    remote_kind, local_kind = draw(st.sampled_from(list(LayoutKind))), draw(st.sampled_from(list(LayoutKind)))
    return Case(
        order=draw(st.sampled_from([o for o in BlockOrder if o in remote_kind.orders and o in local_kind.orders])),
        remote_kind=remote_kind,
        local_kind=local_kind,
        num_kv_heads=heads,
        head_dim=draw(st.sampled_from([1, 3, 4])),
        dtype=draw(st.sampled_from(sorted(DTYPE_SIZES))),
        layer_groups=layer_groups,
        window=draw(st.integers(1, 20)),
        remote_bs=small * a,
        local_bs=local_bs,
        remote_tp=draw(st.sampled_from([1, 2, 4])),
        local_tp=draw(st.sampled_from([1, 2, 4])),
        num_tokens=num_tokens,
        cached_local_blocks=draw(st.integers(0, num_tokens // local_bs)),
        shuffle_remote=draw(st.booleans()),
        shuffle_local=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def case_groups(c: Case, block_size: int) -> tuple[KVCacheGroupSpec, ...]:
    groups = []
    for gid in sorted(set(c.layer_groups)):
        layers = tuple(i for i, g in enumerate(c.layer_groups) if g == gid)
        if gid == 0:
            groups.append(KVCacheGroupSpec(0, AttentionKind.FULL, layers, block_size))
        else:
            groups.append(KVCacheGroupSpec(gid, AttentionKind.SLIDING_WINDOW, layers, block_size, c.window))
    return tuple(groups)


def block_table(rng: np.random.Generator, needed: int, num_blocks: int, shuffle: bool) -> np.ndarray:
    if shuffle:
        return rng.permutation(num_blocks)[:needed]
    first = int(rng.integers(0, num_blocks - needed + 1))
    return np.arange(first, first + needed)


def holder_of(head: int, tp: int, num_kv_heads: int) -> tuple[int, int]:
    """First rank holding global ``head`` and its index there (straight from the engine's sharding)."""
    for rank in range(tp):
        start, end = ParallelConfig(tp, rank).kv_head_range(num_kv_heads)
        if start <= head < end:
            return rank, head - start
    raise AssertionError(head)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_plans_copy_exactly_what_a_naive_copy_does(c: Case) -> None:
    rng = np.random.default_rng(c.seed)
    h = c.num_kv_heads

    def make(kind: LayoutKind, tp: int, rank: int, bs: int, num_blocks: int) -> KVLayoutSpec:
        local_heads = ParallelConfig(tp, rank).num_local_kv_heads(h)
        return KVLayoutSpec(kind, c.order, num_blocks, local_heads, c.head_dim, c.dtype, case_groups(c, bs))

    r_need, l_need = -(-c.num_tokens // c.remote_bs), -(-c.num_tokens // c.local_bs)
    r_blocks, l_blocks = r_need + int(rng.integers(0, 4)), l_need + int(rng.integers(1, 4))
    remote = [make(c.remote_kind, c.remote_tp, r, c.remote_bs, r_blocks) for r in range(c.remote_tp)]
    local = [make(c.local_kind, c.local_tp, r, c.local_bs, l_blocks) for r in range(c.local_tp)]
    groups = remote[0].groups
    remote_ids = {g.group_id: block_table(rng, r_need, r_blocks, c.shuffle_remote) for g in groups}
    local_ids = {g.group_id: block_table(rng, l_need, l_blocks, c.shuffle_local) for g in groups}

    # Remote ranks holding the same heads (replicas) hold the same bytes.
    remote_bufs = []
    for r in range(c.remote_tp):
        heads_of = ParallelConfig(c.remote_tp, r).kv_head_range(h)
        same = [q for q in range(r) if ParallelConfig(c.remote_tp, q).kv_head_range(h) == heads_of]
        remote_bufs.append([b.copy() for b in remote_bufs[same[0]]] if same else random_buffers(remote[r], rng))
    local_before = [random_buffers(s, rng) for s in local]
    actual = [[b.copy() for b in bufs] for bufs in local_before]
    expected = [[b.copy() for b in bufs] for bufs in local_before]

    for lr in range(c.local_tp):
        for g in groups:
            start = max(
                c.cached_local_blocks * c.local_bs, window_start_token(g, local[lr].groups[g.group_id], c.num_tokens)
            )
            pieces = map_blocks(
                remote_ids[g.group_id], c.remote_bs, local_ids[g.group_id], c.local_bs, c.num_tokens, start
            )
            for read in rank_reads(c.local_tp, lr, c.remote_tp, h):
                plan = plan_transfer(remote[read.remote_rank], local[lr], g.group_id, pieces, read)
                apply_plan(plan, remote_bufs[read.remote_rank], actual[lr])

            # The naive reference: every token, layer, K/V, global head, element.
            l_start, l_end = ParallelConfig(c.local_tp, lr).kv_head_range(h)
            for t in range(start, c.num_tokens):
                r_at = (int(remote_ids[g.group_id][t // c.remote_bs]), t % c.remote_bs)
                l_at = (int(local_ids[g.group_id][t // c.local_bs]), t % c.local_bs)
                for layer in g.layer_ids:
                    for kv in (0, 1):
                        for head in range(l_start, l_end):
                            rr, r_head = holder_of(head, c.remote_tp, h)
                            copy_rows(
                                remote[rr],
                                remote_bufs[rr],
                                local[lr],
                                expected[lr],
                                layer,
                                kv,
                                (*r_at, r_head),
                                (*l_at, head - l_start),
                            )
    for lr in range(c.local_tp):
        for got, want in zip(actual[lr], expected[lr], strict=True):
            np.testing.assert_array_equal(got, want)  # includes every byte the plan must not touch


@settings(max_examples=60, deadline=None)
@given(cases())
def test_array_pieces_plan_like_block_pieces(c: Case) -> None:
    """The puller's [5, N] piece arrays (``map_block_arrays``) give the very plan ``BlockPiece`` values do,
    padded or not."""
    rng = np.random.default_rng(c.seed)
    r_need, l_need = -(-c.num_tokens // c.remote_bs), -(-c.num_tokens // c.local_bs)
    remote = KVLayoutSpec(c.remote_kind, c.order, r_need + 2, c.num_kv_heads, c.head_dim, c.dtype,
                          case_groups(c, c.remote_bs))
    local = KVLayoutSpec(c.local_kind, c.order, l_need + 2, c.num_kv_heads, c.head_dim, c.dtype,
                         case_groups(c, c.local_bs))
    r_ids = block_table(rng, r_need, r_need + 2, c.shuffle_remote)
    l_ids = block_table(rng, l_need, l_need + 2, c.shuffle_local)
    start = c.cached_local_blocks * c.local_bs
    arrays = map_block_arrays(r_ids, c.remote_bs, l_ids, c.local_bs, c.num_tokens, start)
    pieces = map_blocks(r_ids, c.remote_bs, l_ids, c.local_bs, c.num_tokens, start)
    assert [BlockPiece(*row) for row in arrays.T.tolist()] == list(pieces)
    read = RankRead(0, (0, c.num_kv_heads), (0, c.num_kv_heads))
    for pad in (False, True):
        a = plan_groups(remote, local, {g.group_id: arrays for g in remote.groups}, read, pad_partial_blocks=pad)
        b = plan_groups(remote, local, {g.group_id: pieces for g in remote.groups}, read, pad_partial_blocks=pad)
        assert a.descriptors() == b.descriptors()


def test_whole_cross_layer_blocks_fold_into_one_descriptor_each() -> None:
    """All heads of whole blocks, cross-layer on both sides: each block's 2 * layers pages fold into one
    run before the blocks multiply them; fragmented blocks stay one descriptor each, consecutive merge."""
    s = spec(CROSS, block_size=16, heads=8, layers=32, num_blocks=64, head_dim=128, dtype="bfloat16")
    read = rank_reads(1, 0, 1, 8)[0]
    block = 32 * 2 * 16 * 8 * 128 * 2
    fragmented = map_block_arrays(list(range(0, 40, 2)), 16, list(range(1, 41, 2)), 16, 20 * 16 - 5)
    plan = plan_transfer(s, s, 0, fragmented, read, pad_partial_blocks=True)
    assert plan.num_descriptors == 20 and set(plan.length.tolist()) == {block}
    assert plan.src_offset.tolist() == [b * block for b in range(0, 40, 2)]
    assert plan.dst_offset.tolist() == [b * block for b in range(1, 41, 2)]
    consecutive_ = map_block_arrays(list(range(3, 23)), 16, list(range(30, 50)), 16, 20 * 16)
    plan = plan_transfer(s, s, 0, consecutive_, read)
    assert plan.descriptors() == [Descriptor(0, 3 * block, 0, 30 * block, 20 * block)]


# ---- descriptor counts ---------------------------------------------------------------------------


def consecutive(n: int, first: int = 2) -> list[int]:
    return list(range(first, first + n))


def test_cross_to_cross_consecutive_is_one_descriptor() -> None:
    for order in BlockOrder:
        s = spec(CROSS, order)
        plan = plan_transfer(s, s, 0, map_blocks(consecutive(5), 4, consecutive(5, 7), 4, 20), ALL)
        assert plan.descriptors() == [
            Descriptor(0, 2 * s.block_bytes(0), 0, 7 * s.block_bytes(0), 5 * s.block_bytes(0))
        ]


def test_per_layer_consecutive_is_two_descriptors_per_layer() -> None:
    for order in BlockOrder:
        s = spec(PER, order)
        plan = plan_transfer(s, s, 0, map_blocks(consecutive(5), 4, consecutive(5, 7), 4, 20), ALL)
        assert plan.num_descriptors == 2 * 3
        assert set(plan.length.tolist()) == {5 * s.page_bytes(0)}
        assert plan.total_bytes == 5 * s.block_bytes(0)


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_shuffled_ids_give_more_descriptors(kind: LayoutKind) -> None:
    s = spec(kind, kind.orders[0])
    ids = [9, 2, 5, 0, 12]
    plan = plan_transfer(s, s, 0, map_blocks(ids, 4, consecutive(5), 4, 20), ALL)
    per_block = {PER: 2 * 3, CROSS: 1, HEADS: 4}[kind]  # heads-outer: a run per (head, block)
    assert plan.num_descriptors == 5 * per_block
    # a run that is consecutive on both sides still merges inside a shuffled table
    plan = plan_transfer(s, s, 0, map_blocks([9, 2, 3, 4, 0], 4, [1, 5, 6, 7, 3], 4, 20), ALL)
    assert plan.num_descriptors == 3 * per_block


def test_partial_last_block_moves_only_existing_tokens_unless_padded() -> None:
    s = spec(CROSS)
    pieces = map_blocks(consecutive(3), 4, consecutive(3), 4, 10)
    exact = plan_transfer(s, s, 0, pieces, ALL)
    # two full blocks and the partial block's first page are one run; then one 2-token run per page
    assert exact.num_descriptors == 2 * 3
    assert exact.total_bytes == 10 * s.block_bytes(0) // 4
    padded = plan_transfer(s, s, 0, pieces, ALL, pad_partial_blocks=True)
    assert padded.num_descriptors == 1 and padded.total_bytes == 3 * s.block_bytes(0)
    # the padded plan moves the same existing tokens (plus the stale tail of the last block)
    src = random_buffers(s, np.random.default_rng(2))
    a, b = random_buffers(s, np.random.default_rng(3)), random_buffers(s, np.random.default_rng(3))
    apply_plan(exact, src, a)
    apply_plan(padded, src, b)
    head = s.byte_offset(0, 0, block=4)
    np.testing.assert_array_equal(a[0][:head], b[0][:head])  # the two full blocks and all before
    for layer in range(3):
        for kv in (0, 1):
            at, end = s.byte_offset(layer, kv, block=4), s.byte_offset(layer, kv, block=4, token=2)
            np.testing.assert_array_equal(a[0][at:end], b[0][at:end])  # the 2 existing tokens
            assert (a[0][at:end] == src[0][at:end]).all()


def test_head_slices_and_block_ratios() -> None:
    half = RankRead(0, (2, 4), (0, 2))
    for order, per_page in ((NHD, 4), (HND, 1)):
        # NHD head slice: one run per token; HND head slice of whole blocks: one run per page
        remote, local = spec(PER, order), spec(PER, order, heads=2)
        plan = plan_transfer(remote, local, 0, map_blocks(consecutive(2), 4, consecutive(2), 4, 8), half)
        assert plan.num_descriptors == 2 * 3 * 2 * per_page
    # remote block 16 -> local blocks of 4, per-layer NHD, all heads: consecutive local ids are contiguous
    remote, local = spec(PER, block_size=16), spec(PER, block_size=4)
    plan = plan_transfer(remote, local, 0, map_blocks([3, 4], 16, consecutive(8), 4, 32), ALL)
    assert plan.num_descriptors == 2 * 3
    # HND with a partial block: per-head runs
    remote, local = spec(PER, HND, block_size=16), spec(PER, HND, block_size=4)
    plan = plan_transfer(remote, local, 0, map_blocks([3], 16, consecutive(4), 4, 16), ALL)
    assert plan.num_descriptors == 4 * 4 * 2 * 3


@pytest.mark.parametrize(("remote_kind", "local_kind"), [(PER, CROSS), (CROSS, PER)])
def test_mixed_kinds_merge_nothing_across_layers(remote_kind: LayoutKind, local_kind: LayoutKind) -> None:
    remote, local = spec(remote_kind), spec(local_kind)
    plan = plan_transfer(remote, local, 0, map_blocks(consecutive(4), 4, consecutive(4), 4, 16), ALL)
    assert plan.num_descriptors == 4 * 2 * 3
    assert set(plan.length.tolist()) == {remote.page_bytes(0)}


def test_untouched_destination_bytes_stay_unchanged() -> None:
    rng = np.random.default_rng(0)
    for kind in LayoutKind:
        s = spec(kind, kind.orders[0])
        src = random_buffers(s, rng)
        dst = [np.full(b.num_bytes, 0xAB, dtype=np.uint8) for b in s.buffers()]
        local_ids = [10, 11, 12]  # block 10 is the reader's cached prefix, 12 holds tokens 8..9 only
        apply_plan(plan_transfer(s, s, 0, map_blocks([1, 2, 3], 4, local_ids, 4, 10, start_token=4), ALL), src, dst)
        row_bytes = s.head_dim * s.element_size
        for layer in range(3):
            for kv in (0, 1):
                buf = dst[s.buffer_of_layer(layer).index]
                for block in range(s.num_blocks):
                    for token in range(4):
                        written = (block, token) in {(11, 0), (11, 1), (11, 2), (11, 3), (12, 0), (12, 1)}
                        for head in range(4):
                            at = s.byte_offset(layer, kv, block, token, head)
                            row = buf[at : at + row_bytes]
                            assert (row == 0xAB).all() != written, (kind, layer, kv, block, token, head)


def test_layers_subset_and_groups() -> None:
    full = KVCacheGroupSpec(0, AttentionKind.FULL, (0, 2), 4)
    window = KVCacheGroupSpec(1, AttentionKind.SLIDING_WINDOW, (1, 3), 4, 4)
    s = KVLayoutSpec(CROSS, NHD, 8, 4, 8, "float16", (full, window))
    pieces = map_blocks([0, 1], 4, [2, 3], 4, 8)
    one_layer = plan_transfer(s, s, 0, pieces, ALL, layers=[2])
    assert one_layer.total_bytes == 2 * 2 * s.page_bytes(0)
    both = plan_groups(s, s, {0: pieces, 1: map_blocks([0, 1], 4, [2, 3], 4, 8, start_token=4)}, ALL)
    assert both.num_descriptors == 2 and both.total_bytes == 3 * s.block_bytes(0)


# ---- refusals and apply_plan --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("remote", "local", "match"),
    [
        (spec(PER, dtype="float16"), spec(PER, dtype="float32"), "dtype differs"),
        (spec(PER, head_dim=8), spec(PER, head_dim=4), r"KV group 0 \(full\): head_dim differs"),
        (spec(PER, NHD), spec(PER, HND), "block order differs"),
        (spec(PER, layers=3), spec(PER, layers=2), "layers differ"),
        (hybrid(PER, full_head_dim=16), hybrid(PER, full_head_dim=32), r"KV group 1 \(full\): head_dim differs"),
    ],
)
def test_incompatible_specs_are_refused(remote: KVLayoutSpec, local: KVLayoutSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        for gid in range(len(remote.groups)):
            plan_transfer(remote, local, gid, [BlockPiece(0, 0, 0, 0, 4)], RankRead(0, (0, 1), (0, 1)))


@pytest.mark.parametrize(
    ("pieces", "read", "kwargs", "match"),
    [
        ([BlockPiece(16, 0, 0, 0, 4)], ALL, {}, "remote block id outside"),
        ([BlockPiece(0, 0, -1, 0, 4)], ALL, {}, "local block id outside"),
        ([BlockPiece(0, 2, 0, 0, 4)], ALL, {}, "overruns a remote block"),
        ([BlockPiece(0, 0, 0, 0, 0)], ALL, {}, "at least one token"),
        ([BlockPiece(0, 0, 0, 0, 3), BlockPiece(1, 0, 0, 2, 2)], ALL, {}, "overlap"),
        ([BlockPiece(0, 0, 0, 0, 4)], RankRead(0, (2, 6), (0, 4)), {}, "remote heads"),
        ([BlockPiece(0, 0, 0, 0, 4)], ALL, {"layers": [5]}, "must be distinct layers"),
        ([BlockPiece(0, 0, 0, 0, 4)], ALL, {"layers": [0, 0]}, "must be distinct layers"),
    ],
)
def test_bad_pieces_reads_and_layers_are_refused(pieces, read, kwargs, match: str) -> None:
    s = spec(PER)
    with pytest.raises(ValueError, match=match):
        plan_transfer(s, s, 0, pieces, read, **kwargs)
    with pytest.raises(ValueError, match="no KV group 3"):
        plan_transfer(s, s, 3, [], ALL)


def test_apply_plan_accepts_bytearray_numpy_and_torch() -> None:
    s = spec(CROSS)
    plan = plan_transfer(s, s, 0, map_blocks([1, 2], 4, [3, 4], 4, 6), ALL)
    src = random_buffers(s, np.random.default_rng(1))
    want = [np.zeros(b.num_bytes, dtype=np.uint8) for b in s.buffers()]
    apply_plan(plan, src, want)
    as_bytes = [bytearray(b.tobytes()) for b in src]
    as_torch = [torch.zeros(b.num_bytes // 2, dtype=torch.float16) for b in s.buffers()]
    apply_plan(plan, as_bytes, as_torch)
    assert bytes(as_torch[0].view(torch.uint8).numpy()) == want[0].tobytes()
    with pytest.raises(ValueError, match="past the end"):
        apply_plan(plan, [b[:10] for b in src], want)
    remote_rows, local_rows = plan.address_rows([(1000, 0)], [(5000, 1)])
    assert remote_rows.dtype == np.uint64 and remote_rows.shape == (plan.num_descriptors, 3)
    assert remote_rows[:, 0].tolist() == (1000 + plan.src_offset).tolist()
    assert local_rows[:, 0].tolist() == (5000 + plan.dst_offset).tolist() and set(local_rows[:, 2].tolist()) == {1}
    with pytest.raises(ValueError, match="only 0 regions"):
        plan.address_rows([], [(0, 0)])
    assert TransferPlan.empty(3).num_descriptors == 0 and TransferPlan.empty(3).total_bytes == 0
    with pytest.raises(ValueError, match="read-only"):
        plan.length[0] = 1


def test_llama8b_8k_prompt_plans_fast() -> None:
    """Llama-3.1-8B shape, 8192 tokens in 512 blocks of 16: far from a Python loop per row."""
    ids = list(range(1, 513))
    pieces = map_blocks(ids, 16, ids, 16, 8192)
    read = rank_reads(1, 0, 1, 8)[0]
    for kind, descriptors in ((PER, 64), (CROSS, 1), (HEADS, 8)):  # heads-outer: a run per head plane
        s = spec(kind, kind.orders[0], block_size=16, heads=8, layers=32, num_blocks=1024, head_dim=128,
                 dtype="bfloat16")
        plan_transfer(s, s, 0, pieces, read)  # warm the view cache
        t0 = time.perf_counter()
        plan = plan_transfer(s, s, 0, pieces, read)
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        assert plan.num_descriptors == descriptors and plan.total_bytes == 1 << 30
        assert elapsed_ms < 200  # ~1-2 ms measured; loose for a shared 2-core CI box


# ---- hybrid layouts: per-group heads, head dims, block sizes and windows --------------------------

def test_hybrid_layout_shapes() -> None:
    s = hybrid(CROSS)
    assert (s.kv_heads(0), s.group_head_dim(0), s.kv_heads(1), s.group_head_dim(1)) == (4, 8, 2, 16)
    assert s.page_bytes(0) == 4 * 4 * 8 * 2 and s.page_bytes(1) == 4 * 2 * 16 * 2
    assert s.block_bytes(0) == 2 * 4 * s.page_bytes(0) and s.block_bytes(1) == 2 * s.page_bytes(1)
    assert s.view(2, 1).shape == (24, 4, 2, 16) and s.view(3, 0).shape == (24, 4, 4, 8)
    with pytest.raises(KeyError):
        s.view(5, 0)  # a KV-sharing layer owns no KV
    with pytest.raises(ValueError, match="group ids must be 0..1 in order"):
        KVLayoutSpec(CROSS, NHD, 8, 4, 8, "float16", tuple(reversed(s.groups)))


def _hybrid_tables(rng: np.random.Generator, s: KVLayoutSpec, num_tokens: int, shuffle: bool) -> dict[int, list[int]]:
    """Block tables per group; a sliding group's out-of-window entries are the scratch block."""
    scratch = s.num_blocks - 1
    out = {}
    for g in s.groups:
        ids = block_table(rng, g.num_blocks_for(num_tokens), s.num_blocks - 1, shuffle).tolist()
        first = g.first_needed_block(num_tokens)
        out[g.group_id] = [scratch] * first + ids[first:]
    return out


def _naive(remote: KVLayoutSpec, src, local: KVLayoutSpec, dst, remote_ids, local_ids, num_tokens, starts) -> None:
    for g in remote.groups:
        rbs, lbs = g.block_size, local.block_size(g.group_id)
        for t in range(starts[g.group_id], num_tokens):
            r_at = (remote_ids[g.group_id][t // rbs], t % rbs)
            l_at = (local_ids[g.group_id][t // lbs], t % lbs)
            for layer in g.layer_ids:
                for kv in (0, 1):
                    for head in range(remote.kv_heads(g.group_id)):
                        copy_rows(remote, src, local, dst, layer, kv, (*r_at, head), (*l_at, head))


# Kind pairs of one block order (heads-outer holds HND blocks only): equal and mixed kinds.
KIND_PAIRS = [(order, r, loc) for order in BlockOrder
              for r, loc in [(PER, PER), (CROSS, CROSS), (PER, CROSS), (CROSS, PER), (HEADS, HEADS), (HEADS, CROSS),
                             (PER, HEADS)]
              if order in r.orders and order in loc.orders]


@pytest.mark.parametrize(("order", "remote_kind", "local_kind"), KIND_PAIRS)
@pytest.mark.parametrize(
    # block sizes (sliding, full) on the remote and the local side: ratios per group, both directions
    ("remote_bs", "local_bs"),
    [((4, 4), (4, 4)), ((4, 16), (16, 4)), ((16, 4), (4, 16)), ((2, 8), (8, 2))],
)
@pytest.mark.parametrize("num_tokens", [3, 6, 7, 13, 30, 37])  # shorter than, at and past the window
def test_hybrid_plans_copy_window_and_full_groups_exactly(order, remote_kind, local_kind, remote_bs, local_bs,
                                                          num_tokens) -> None:
    rng = np.random.default_rng(num_tokens)
    remote = hybrid(remote_kind, order, sliding_bs=remote_bs[0], full_bs=remote_bs[1], window=7, num_blocks=24)
    local = hybrid(local_kind, order, sliding_bs=local_bs[0], full_bs=local_bs[1], window=7, num_blocks=24)
    remote_ids = _hybrid_tables(rng, remote, num_tokens, shuffle=True)
    local_ids = _hybrid_tables(rng, local, num_tokens, shuffle=False)
    src = random_buffers(remote, rng)
    before = random_buffers(local, rng)
    actual, expected = [b.copy() for b in before], [b.copy() for b in before]

    starts, pieces = {}, {}
    for rg, lg in zip(remote.groups, local.groups, strict=True):
        starts[rg.group_id] = window_start_token(rg, lg, num_tokens)
        pieces[rg.group_id] = map_blocks(remote_ids[rg.group_id], rg.block_size, local_ids[lg.group_id],
                                         lg.block_size, num_tokens, starts[rg.group_id])
    reads = {0: RankRead(0, (0, 4), (0, 4)), 1: RankRead(0, (0, 2), (0, 2))}
    plan = plan_groups(remote, local, pieces, reads)
    apply_plan(plan, src, actual)
    _naive(remote, src, local, expected, remote_ids, local_ids, num_tokens, starts)
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(got, want)  # every byte outside the window is untouched

    # the scratch block (placeholders) is never read or written
    for side, spec_, buf_col, off_col in ((remote, remote, plan.src_buffer, plan.src_offset),
                                          (local, local, plan.dst_buffer, plan.dst_offset)):
        scratch = spec_.num_blocks - 1
        for layer in spec_.layer_ids:
            gid = spec_.group_of_layer(layer).group_id
            row = spec_.group_head_dim(gid) * spec_.element_size
            sel = buf_col == spec_.buffer_of_layer(layer).index
            for kv, token, head in itertools.product((0, 1), range(spec_.block_size(gid)), range(spec_.kv_heads(gid))):
                lo = spec_.byte_offset(layer, kv, scratch, token, head)  # a page is not one region in every kind
                assert not ((off_col[sel] < lo + row) & (off_col[sel] + plan.length[sel] > lo)).any(), side

    # bytes: the full group moves every token, the sliding group only from its window start
    elem = remote.element_size
    want_bytes = sum(
        (num_tokens - starts[g.group_id]) * len(g.layer_ids) * 2 * remote.kv_heads(g.group_id)
        * remote.group_head_dim(g.group_id) * elem
        for g in remote.groups
    )
    assert plan.total_bytes == want_bytes


def test_hybrid_descriptors_merge_per_group() -> None:
    s = hybrid(CROSS, num_blocks=40)
    ids = list(range(1, 9))  # 8 consecutive blocks, 32 tokens
    pieces = {
        0: map_blocks(ids, 4, list(range(11, 19)), 4, 32, window_start_token(s.groups[0], s.groups[0], 32)),
        1: map_blocks(ids, 4, list(range(21, 29)), 4, 32),
    }
    reads = {0: RankRead(0, (0, 4), (0, 4)), 1: RankRead(0, (0, 2), (0, 2))}
    plan = plan_groups(s, s, pieces, reads)
    assert plan.num_descriptors == 2  # one run per group (cross-layer, consecutive ids)
    # window 6 at 32 tokens: key 26 -> blocks 6, 7 of the sliding group; all 8 of the full group
    assert plan.total_bytes == 2 * s.block_bytes(0) + 8 * s.block_bytes(1)
    per = hybrid(PER, num_blocks=40)
    assert plan_groups(per, per, pieces, reads).num_descriptors == 2 * 4 + 2  # one per (layer, K/V)


def test_hybrid_reads_are_checked_per_group() -> None:
    s = hybrid(CROSS)
    pieces = {0: [BlockPiece(0, 0, 0, 0, 4)], 1: [BlockPiece(0, 0, 0, 0, 4)]}
    with pytest.raises(ValueError, match=r"KV group 1 \(full\): remote heads \(0, 4\) exceed"):
        plan_groups(s, s, pieces, RankRead(0, (0, 4), (0, 4)))  # one read of 4 heads for both groups
    with pytest.raises(ValueError, match=r"no RankRead for KV groups \[1\]"):
        plan_groups(s, s, pieces, {0: RankRead(0, (0, 4), (0, 4))})
    with pytest.raises(ValueError, match="one plan reads one remote rank"):
        plan_groups(s, s, pieces, {0: RankRead(0, (0, 4), (0, 4)), 1: RankRead(1, (0, 2), (0, 2))})
    # the full group's wider rows: a head slice of it is 16 elements per row
    plan = plan_transfer(s, hybrid(CROSS, full_heads=1), 1, [BlockPiece(3, 0, 5, 0, 4)], RankRead(0, (1, 2), (0, 1)))
    assert plan.total_bytes == 4 * 2 * 16 * 2 and set(plan.length.tolist()) == {16 * 2}


def test_puller_pieces_skip_the_cached_prefix_and_clip_the_window_per_group() -> None:
    """The puller's token runs: each group skips its own whole cached blocks, sliding groups start at
    the window, and a sliding group's placeholders before that are never mapped."""
    from types import SimpleNamespace

    from services.kv.reader.pieces import group_pieces

    remote = hybrid(CROSS, sliding_bs=4, full_bs=16, window=6, num_blocks=40)
    local = hybrid(PER, sliding_bs=8, full_bs=4, window=6, num_blocks=40)
    scratch = 39
    n = 30
    remote_ids = [[scratch] * 6 + [20, 21], [5, 6]]  # sliding: key 24 -> remote keeps blocks 6.. of 4
    local_ids = [[scratch] * 3 + [30], list(range(10, 18))]  # local (block 8) keeps block 3.. (token 24)
    description = SimpleNamespace(groups=remote.groups)

    def pieces_of(cached: int) -> dict[int, list[BlockPiece]]:  # the puller keeps them as [5, N] arrays
        arrays = group_pieces(description, local, n, remote_ids, local_ids, cached)
        return {g: [BlockPiece(*row) for row in arr.T.tolist()] for g, arr in arrays.items()}

    for cached, full_start in ((0, 0), (8, 8), (12, 12), (16, 16)):
        pieces = pieces_of(cached)
        # the full group (local block 4) starts at its cached whole blocks; the sliding group at the window
        assert pieces[1][0].remote_offset == full_start % 16 and sum(p.num_tokens for p in pieces[1]) == n - full_start
        assert [(p.remote_block, p.local_block) for p in pieces[0]] == [(20, 30), (21, 30)]
        assert sum(p.num_tokens for p in pieces[0]) == n - 24
    # 28 cached tokens: 7 whole blocks of the full group (block 4), 3 of the sliding one (block 8)
    pieces = pieces_of(28)
    assert sum(p.num_tokens for p in pieces[0]) == n - 24 and sum(p.num_tokens for p in pieces[1]) == n - 28
