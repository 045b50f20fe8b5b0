"""MLA KV-cache groups in every layout kind: exactly one latent row per token and layer, no V plane.

A DeepSeek layer caches ``kv_lora_rank + qk_rope_head_dim`` elements per token; the layout must
allocate exactly that (not a K and a V of it, not the latent without the rope key), give each layer
one view of it, and leave the other groups' bytes where they were.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.kv_cache.buffers import KVCache
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind

KV_LORA_RANK, ROPE_DIM = 512, 64
ROW = KV_LORA_RANK + ROPE_DIM
KINDS = [(LayoutKind.PER_LAYER, BlockOrder.NHD), (LayoutKind.PER_LAYER, BlockOrder.HND),
         (LayoutKind.CROSS_LAYER, BlockOrder.NHD), (LayoutKind.CROSS_LAYER, BlockOrder.HND),
         (LayoutKind.HEADS_OUTER, BlockOrder.HND)]


def mla_layout(kind: LayoutKind, order: BlockOrder, num_blocks: int = 5, block_size: int = 16,
               dtype: str = "bfloat16", layers: tuple[int, ...] = (0, 1, 2)) -> KVLayoutSpec:
    group = KVCacheGroupSpec(0, AttentionKind.MLA, layers, block_size, None, 1, ROW)
    return KVLayoutSpec(kind, order, num_blocks, 1, ROW, dtype, (group,))


@pytest.mark.parametrize(("kind", "order"), KINDS, ids=lambda x: x.value)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_block_is_one_row_per_token_per_layer(kind: LayoutKind, order: BlockOrder, dtype: str) -> None:
    s = mla_layout(kind, order, dtype=dtype)
    elem = s.element_size
    assert s.page_bytes(0) == ROW * 16 * elem  # one layer's block: 16 rows of 576
    assert s.num_kv_planes(0) == 1
    assert s.block_bytes(0) == 3 * ROW * 16 * elem  # 3 layers, no V plane
    assert s.total_bytes == 5 * 3 * ROW * 16 * elem
    buffers = s.buffers()
    if kind is LayoutKind.PER_LAYER:
        assert [b.num_planes for b in buffers] == [1, 1, 1]
        assert all(b.num_bytes == 5 * ROW * 16 * elem for b in buffers)
    else:
        (buf,) = buffers
        assert buf.num_planes == 1 and buf.block_stride_bytes == s.block_bytes(0)
    for layer in (0, 1, 2):
        assert s.view(layer, 0).shape == (5, 16, 1, ROW)
        with pytest.raises(ValueError, match="one latent row"):
            s.view(layer, 1)


@pytest.mark.parametrize(("kind", "order"), KINDS, ids=lambda x: x.value)
def test_the_views_cover_every_byte_once(kind: LayoutKind, order: BlockOrder) -> None:
    """Every (layer, block, token, element) of the views is a distinct element, and together they are
    the whole allocation: nothing overlaps and nothing is allocated that no view reads."""
    s = mla_layout(kind, order, num_blocks=3, block_size=4, dtype="float32")
    cache = KVCache(s, torch.device("cpu"))
    assert all(len(cache.views[layer]) == 1 for layer in (0, 1, 2))  # (rows,): no V view
    for buf in cache.buffers:
        buf.zero_()
    for layer in (0, 1, 2):
        (rows,) = cache.views[layer]
        rows.add_(1.0)
    assert all(bool((buf == 1.0).all()) for buf in cache.buffers)


def test_mla_group_beside_a_full_group_leaves_the_full_group_as_it_was() -> None:
    """The full group's buffers and views are byte for byte those of a layout without the MLA group."""
    full = KVCacheGroupSpec(0, AttentionKind.FULL, (0, 2), 8, None, 2, 16)
    mla = KVCacheGroupSpec(1, AttentionKind.MLA, (1, 3), 8, None, 1, ROW)
    for kind, order in KINDS:
        alone = KVLayoutSpec(kind, order, 4, 2, 16, "float16", (full,))
        both = KVLayoutSpec(kind, order, 4, 2, 16, "float16", (full, mla))
        assert both.block_bytes(0) == alone.block_bytes(0) == 2 * 2 * 8 * 2 * 16 * 2  # K and V, 2 layers
        assert both.block_bytes(1) == 2 * 8 * ROW * 2
        full_buffers = [b for b in both.buffers() if b.group_id == 0]
        assert full_buffers == list(alone.buffers())
        for layer in (0, 2):
            for kv in (0, 1):
                assert both.view(layer, kv) == alone.view(layer, kv)


def test_an_mla_group_states_one_head_of_the_row_width() -> None:
    with pytest.raises(ValueError, match="one latent row"):
        KVCacheGroupSpec(0, AttentionKind.MLA, (0,), 16, None, 2, ROW)
    with pytest.raises(ValueError, match="one latent row"):
        KVCacheGroupSpec(0, AttentionKind.MLA, (0,), 16)
    assert KVCacheGroupSpec(0, AttentionKind.FULL, (0,), 16).num_kv_planes == 2
