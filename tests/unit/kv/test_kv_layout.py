"""Layout specs: the heads-outer kind's views and offsets (a head's plane holds every block), and what its head
slices cost to pull."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from services.engine.kv_cache.buffers import KVCache
from services.kv.plan.planner import Descriptor, plan_transfer
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.topology import map_block_arrays, rank_reads

PER, CROSS, HEADS = LayoutKind.PER_LAYER, LayoutKind.CROSS_LAYER, LayoutKind.HEADS_OUTER
NHD, HND = BlockOrder.NHD, BlockOrder.HND


def hybrid(kind: LayoutKind, order: BlockOrder = HND, heads: int = 4, num_blocks: int = 6) -> KVLayoutSpec:
    """Gemma-4-like: a sliding group (layers 0, 1, 3; 4 heads of 8) and a full group (layers 2, 4; 2 heads
    of 16, its own shape)."""
    sliding = KVCacheGroupSpec(0, AttentionKind.SLIDING_WINDOW, (0, 1, 3), 4, 6)
    full = KVCacheGroupSpec(1, AttentionKind.FULL, (2, 4), 8, None, max(heads // 2, 1), 16)
    return KVLayoutSpec(kind, order, num_blocks, heads, 8, "float16", (sliding, full))


def test_heads_outer_views_follow_the_documented_six_axes() -> None:
    """buffer[group] = [heads, num_blocks, layers, K/V, block_size, head_dim], per group with its own shape:
    a head's plane holds every block, so a block is one region per head."""
    s = hybrid(HEADS)
    for g in s.groups:
        gid, layers = g.group_id, g.layer_ids
        h, d, bs = s.kv_heads(gid), s.group_head_dim(gid), g.block_size
        buf = s.buffers()[gid]
        assert buf.layer_ids == layers and buf.num_bytes == s.num_blocks * s.block_bytes(gid)
        assert buf.num_planes == h and buf.block_stride_bytes * h == s.block_bytes(gid)
        assert buf.block_stride_bytes == len(layers) * 2 * bs * d * s.element_size
        shape6 = (h, s.num_blocks, len(layers), 2, bs, d)
        strides6 = np.cumprod((1, *shape6[::-1]))[-2::-1]  # C-order element strides of the six axes
        for slot, layer in enumerate(layers):
            for kv in (0, 1):
                v = s.view(layer, kv)
                assert v.buffer_index == gid and v.shape == (s.num_blocks, bs, h, d)
                assert v.strides == (strides6[1], strides6[4], strides6[0], 1)
                assert v.offset == slot * strides6[2] + kv * strides6[3]
                block, token, head = s.num_blocks - 1, bs - 1, h - 1
                want = (head * strides6[0] + block * strides6[1] + slot * strides6[2] + kv * strides6[3]
                        + token * strides6[4]) * s.element_size
                assert s.byte_offset(layer, kv, block, token, head) == want
                # head 1 of block 0 starts a whole pool of blocks after head 0
                assert s.byte_offset(layer, kv, 0, 0, 1) - s.byte_offset(layer, kv, 0) == s.num_blocks * \
                    buf.block_stride_bytes


def test_every_kind_says_how_many_regions_a_block_is() -> None:
    """``num_planes`` regions of ``block_stride_bytes`` per block: what the host tier copies per block run."""
    for kind, planes in ((PER, 2), (CROSS, 1), (HEADS, None)):
        s = hybrid(kind)
        for b in s.buffers():
            assert b.num_planes == (s.kv_heads(b.group_id) if planes is None else planes)
            assert b.num_planes * s.num_blocks * b.block_stride_bytes == b.num_bytes


@pytest.mark.parametrize(("kind", "order"), [(PER, NHD), (PER, HND), (CROSS, NHD), (CROSS, HND), (HEADS, HND)])
def test_every_row_has_its_own_place_and_the_rows_fill_the_buffers(kind: LayoutKind, order: BlockOrder) -> None:
    """The views of every (layer, K/V) tile each buffer exactly: no row shared, no byte left over."""
    s = hybrid(kind, order)
    seen = [np.zeros(b.num_bytes, dtype=np.int32) for b in s.buffers()]
    for layer in s.layer_ids:
        gid = s.group_of_layer(layer).group_id
        row = s.group_head_dim(gid) * s.element_size
        for kv, block, token, head in itertools.product((0, 1), range(s.num_blocks), range(s.block_size(gid)),
                                                        range(s.kv_heads(gid))):
            at = s.byte_offset(layer, kv, block, token, head)
            seen[s.buffer_of_layer(layer).index][at:at + row] += 1
    assert all((counts == 1).all() for counts in seen)
    assert s.total_bytes == hybrid(CROSS, HND).total_bytes  # the same bytes, placed differently


def test_heads_outer_holds_hnd_blocks_only() -> None:
    assert HEADS.orders == (HND,) and CROSS.orders == PER.orders == (NHD, HND)
    with pytest.raises(ValueError, match="heads_outer KV layout holds HND blocks, not NHD"):
        hybrid(HEADS, NHD)


def test_engine_views_address_the_heads_outer_buffer() -> None:
    """The engine's as_strided K/V views (what attention, the K/V write and the digest read) land where
    the six-axis buffer says: a write through a view is that (head, block, layer, K/V, token) there."""
    s = hybrid(HEADS)
    cache = KVCache(s, torch.device("cpu"))
    for layer in s.layer_ids:
        group = s.group_of_layer(layer)
        gid = group.group_id
        six = cache.buffers[gid].view(s.kv_heads(gid), s.num_blocks, len(group.layer_ids), 2, group.block_size,
                                      s.group_head_dim(gid))
        for kv in (0, 1):
            view = cache.views[layer][kv]
            values = torch.randn(view.shape[1:]).to(view.dtype)
            view[3] = values
            slot = group.layer_ids.index(layer)
            torch.testing.assert_close(six[:, 3, slot, kv].transpose(0, 1), values, rtol=0, atol=0)


def _descriptors(kind: LayoutKind, remote_tp: int, local_tp: int, blocks: list[int], pool: int) -> list[int]:
    """Descriptors of each READ of a pull of whole ``blocks`` (the same ids on both sides) between TP sizes,
    for a Llama-3.1-8B KV shape (32 layers, 8 KV heads of 128, block 16) and a pool of ``pool`` blocks."""
    group = (KVCacheGroupSpec(0, AttentionKind.FULL, tuple(range(32)), 16),)

    def spec(tp: int) -> KVLayoutSpec:
        return KVLayoutSpec(kind, HND, pool, 8 // tp, 128, "bfloat16", group)

    pieces = map_block_arrays(blocks, 16, blocks, 16, len(blocks) * 16)
    return [plan_transfer(spec(remote_tp), spec(local_tp), 0, pieces, read).num_descriptors
            for rank in range(local_tp) for read in rank_reads(local_tp, rank, remote_tp, 8)]


@pytest.mark.parametrize(("remote_tp", "local_tp"), [(1, 2), (2, 1), (1, 4), (4, 2), (1, 1), (2, 2)])
def test_a_pull_of_consecutive_blocks_is_one_descriptor_per_head_read(remote_tp: int, local_tp: int) -> None:
    """512 consecutive blocks (8k tokens) of a 513-block pool: a READ of h heads is h descriptors, one per
    head plane, whatever the two TP sizes (cross-layer HND: one per block, layer and K/V between different
    TP sizes, one in all between equal ones)."""
    n, reads = 512, max(remote_tp, local_tp)
    heads_per_read = 8 // reads
    assert _descriptors(HEADS, remote_tp, local_tp, list(range(n)), n + 1) == [heads_per_read] * reads
    cross = 1 if remote_tp == local_tp else n * 2 * 32
    assert _descriptors(CROSS, remote_tp, local_tp, list(range(n)), n + 1) == [cross] * reads


@pytest.mark.parametrize(("remote_tp", "local_tp"), [(1, 2), (2, 1)])
def test_heads_of_fragmented_or_whole_pool_pulls(remote_tp: int, local_tp: int) -> None:
    """Fragmented blocks are a descriptor per (head, block); a pull of the whole pool on both sides is one
    (each head plane ends where the next one starts) when the two sides' head slices are contiguous too."""
    n, reads = 24, max(remote_tp, local_tp)
    assert _descriptors(HEADS, remote_tp, local_tp, list(range(0, 2 * n, 2)), 2 * n) == [n * 8 // reads] * reads
    assert _descriptors(HEADS, remote_tp, local_tp, list(range(n)), n) == [1] * reads


def test_a_head_slice_of_a_block_run_is_a_run_per_head_plane() -> None:
    """TP 1 -> 2, reading rank 1 (remote heads 2, 3 into its heads 0, 1): blocks 2..5 -> 7..10 are two
    descriptors, head by head, each from where the head's plane holds block 2 to where it holds block 6."""
    group = (KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1, 2), 4),)
    remote = KVLayoutSpec(HEADS, HND, 12, 4, 8, "float16", group)
    local = KVLayoutSpec(HEADS, HND, 16, 2, 8, "float16", group)
    (read,) = rank_reads(2, 1, 1, 4)
    assert (read.remote_heads, read.local_heads) == ((2, 4), (0, 2))
    stride = remote.buffers()[0].block_stride_bytes  # a block of one head: 3 layers x K/V x 4 tokens x 8
    assert stride == local.buffers()[0].block_stride_bytes == 3 * 2 * 4 * 8 * 2
    plan = plan_transfer(remote, local, 0, map_block_arrays([2, 3, 4, 5], 4, [7, 8, 9, 10], 4, 16), read)
    assert plan.descriptors() == [Descriptor(0, (h + 2) * 12 * stride + 2 * stride, 0, h * 16 * stride + 7 * stride,
                                             4 * stride) for h in (0, 1)]
