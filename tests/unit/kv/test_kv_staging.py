"""KV staging (kv/plan/staging.py, kv/ranks/staging_area.py): the span allocator, gather/scatter between pools,
and the READ rows.

The rows are applied here with a byte copy between this process's own buffers (the bytes a READ of
them moves); tests/integration/test_kv_staging.py reads them over NIXL between two processes.
``PDSERVE_TEST_DEVICE=cuda`` runs the pools, areas and copies on the GPU (the side stream).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from bench.kv_synthetic import layout_for
from services.engine.kv_cache.buffers import KVCache
from services.kv.plan.staging import (
    ALIGN,
    plan_rows,
    same_layout,
    staged_blocks,
    staged_spans,
    staged_start,
    worth_staging,
)
from services.kv.ranks.staging_area import StagingArea, gather, scatter
from services.kv.spec.wire import MemoryRegion

DEVICE = torch.device(os.environ.get("PDSERVE_TEST_DEVICE", "cpu"))
KIND = "VRAM" if DEVICE.type == "cuda" else "DRAM"
BASE = dict(order="NHD", num_kv_heads=4, head_dim=8, dtype="float16", num_layers=3, block_size=4)
HYBRID = {"groups": [{"kind": "sliding_window", "layers": [0, 2], "window": 6, "block_size": 2},
                     {"kind": "full", "layers": [1], "block_size": 4, "num_kv_heads": 2, "head_dim": 16}]}
LAYOUTS = {
    "cross_layer": {"kind": "cross_layer"},
    "per_layer": {"kind": "per_layer"},
    "heads_outer": {"kind": "heads_outer", "order": "HND"},
    "hybrid_cross_layer": {"kind": "cross_layer", **HYBRID},
    "hybrid_per_layer": {"kind": "per_layer", **HYBRID},
}


def area(num_bytes: int) -> StagingArea:
    buf = torch.zeros(num_bytes, dtype=torch.uint8, device=DEVICE)
    return StagingArea(buf, MemoryRegion(0, buf.data_ptr(), num_bytes, 0, KIND))


def regions(cache: KVCache) -> tuple[MemoryRegion, ...]:
    return tuple(MemoryRegion(i, b.data_ptr(), b.numel() * b.element_size(), 0, KIND)
                 for i, b in enumerate(cache.buffers))


def zero_cache(layout) -> KVCache:  # noqa: ANN001
    cache = KVCache(layout, DEVICE)
    for b in cache.buffers:
        b.zero_()
    return cache


def random_cache(layout, seed: int) -> KVCache:  # noqa: ANN001
    cache = KVCache(layout, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for b in cache.buffers:
        b.copy_(torch.randn(b.shape, generator=gen).to(b.dtype))
    return cache


def block_bytes(layout, cache: KVCache, group: int, block: int) -> list[bytes]:  # noqa: ANN001
    """Every byte of one block of a group, per buffer and plane (what a transfer must carry)."""
    out = []
    for spec in layout.buffers():
        if spec.group_id == group:
            raw = cache.buffers[spec.index].view(-1).view(torch.uint8).view(spec.num_planes, layout.num_blocks, -1)
            out += [raw[p, block].cpu().numpy().tobytes() for p in range(spec.num_planes)]
    return out


def test_allocator_takes_first_fit_merges_on_free_and_refuses_when_full() -> None:
    a = area(4 * ALIGN)
    x, y, z = a.alloc(1), a.alloc(ALIGN + 1), a.alloc(ALIGN)
    assert (x, y, z) == (0, ALIGN, 3 * ALIGN)
    assert a.alloc(1) is None and a.free_bytes == 0
    a.free(y)
    assert a.alloc(3 * ALIGN) is None  # two free granules, not three in a row
    a.free(x)
    a.free(z)
    assert a.free_bytes == 4 * ALIGN and a.alloc(4 * ALIGN) == 0  # merged back into one span
    with pytest.raises(KeyError):
        a.free(ALIGN)


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn"])  # FP8: moved as bytes (no float8 index_copy_ on CPU)
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_gather_then_scatter_moves_every_block_between_pools(case: str, dtype: str) -> None:
    owner = layout_for({**BASE, **LAYOUTS[case], "num_blocks": 20, "dtype": dtype}, 1)
    reader = layout_for({**BASE, **LAYOUTS[case], "num_blocks": 13, "dtype": dtype}, 1)
    assert same_layout(owner, reader)
    src, dst = random_cache(owner, 1), zero_cache(reader)
    ids = [np.array([7, 2, 19, 4, 11][: 5 - g], dtype=np.int64) for g in range(len(owner.groups))]
    to = [np.array([12, 0, 5, 3, 9][: 5 - g], dtype=np.int64) for g in range(len(owner.groups))]
    _, num_bytes = staged_spans(owner, tuple(len(i) for i in ids))
    staging = area(num_bytes + ALIGN)
    offset = staging.alloc(num_bytes)
    staging.run(gather, owner, src.buffers, staging, offset, ids)
    staging.run(scatter, reader, dst.buffers, staging, offset, to)
    for g in range(len(owner.groups)):
        for a, b in zip(ids[g], to[g], strict=True):
            assert block_bytes(reader, dst, g, int(b)) == block_bytes(owner, src, g, int(a))
    untouched = set(range(reader.num_blocks)) - {int(b) for b in to[0]}
    assert all(not any(any(x) for x in block_bytes(reader, dst, 0, b)) for b in untouched)


def apply(local_rows: np.ndarray, remote_rows: np.ndarray, buffers: list[torch.Tensor]) -> None:
    """What a READ of these rows does, here between ``buffers`` of this process (each row inside one of them)."""
    spans = [(b.data_ptr(), b.view(-1).view(torch.uint8)) for b in buffers]

    def at(address: int, n: int) -> torch.Tensor:
        (view,) = [v[address - base:address - base + n] for base, v in spans if base <= address < base + v.numel()]
        assert view.numel() == n, "a row leaves its buffer"
        return view

    for (dst, n, _), (src, m, _) in zip(local_rows.tolist(), remote_rows.tolist(), strict=True):
        assert n == m
        at(dst, n).copy_(at(src, n))


@pytest.mark.parametrize("case", ["cross_layer", "per_layer", "hybrid_cross_layer", "fp8_hybrid_per_layer"])
@pytest.mark.parametrize("reader_area", [True, False])
def test_rows_of_a_staged_span_land_in_the_reader_blocks(case: str, reader_area: bool) -> None:
    """From the owner's staged span straight into the reader's blocks (no room, or no area), or into the reader's
    area then scattered; the first ``skip`` staged blocks (a held prefix) are not read."""
    over = {**LAYOUTS[case.removeprefix("fp8_")], **({"dtype": "float8_e4m3fn"} if case.startswith("fp8_") else {})}
    owner = layout_for({**BASE, **over, "num_blocks": 40}, 1)
    reader = layout_for({**BASE, **over, "num_blocks": 40}, 1)
    src, dst = random_cache(owner, 2), zero_cache(reader)
    num_tokens = 23
    owner_ids, local_ids, starts = [], [], {}
    for g in owner.groups:
        n = -(-num_tokens // g.block_size)
        owner_ids.append(np.arange(n, dtype=np.int64) * 3 + 1)  # no two adjacent
        local_ids.append(np.arange(n, dtype=np.int64)[::-1] * 2)
        # The reader holds two blocks of each group; a sliding group starts at its window.
        starts[g.group_id] = max(2, staged_start(owner, g.group_id, 0, num_tokens)) * g.block_size
    counts, skip, wanted = staged_blocks(owner, num_tokens, 0, num_tokens, starts, local_ids)
    staged = [ids[s:] for ids, s in zip(owner_ids, [len(i) - c for i, c in zip(owner_ids, counts, strict=True)],
                                        strict=True)]
    assert worth_staging(owner, staged)
    _, num_bytes = staged_spans(owner, counts)
    owner_area = area(num_bytes + ALIGN)
    offset = owner_area.alloc(num_bytes)
    owner_area.run(gather, owner, src.buffers, owner_area, offset, staged)
    local_area = area(num_bytes) if reader_area else None
    plan = plan_rows(owner, owner_area.region, offset, counts, skip, wanted, reader.num_blocks, regions(dst),
                     local_area)
    assert (plan.scatter is not None) == reader_area
    if reader_area:  # one row per (buffer, plane), merged: one READ descriptor for a cross-layer group
        assert len(plan.local_rows) <= sum(b.num_planes for b in owner.buffers())
        if case == "cross_layer":
            assert len(plan.local_rows) == 1
    apply(plan.local_rows, plan.remote_rows,
          [*src.buffers, *dst.buffers, owner_area.buffer, *([local_area.buffer] if local_area else [])])
    if plan.scatter is not None:
        local_area.run(scatter, reader, dst.buffers, local_area, *plan.scatter)
        local_area.free(plan.scatter[0])
        assert local_area.free_bytes == num_bytes
    for g in owner.groups:
        for i, (a, b) in enumerate(zip(owner_ids[g.group_id], local_ids[g.group_id], strict=True)):
            got = block_bytes(reader, dst, g.group_id, int(b))
            if i < starts[g.group_id] // g.block_size:
                assert not any(any(x) for x in got), "a held block was written"
            else:
                assert got == block_bytes(owner, src, g.group_id, int(a))


def test_staging_pays_only_for_many_short_runs() -> None:
    layout = layout_for({**BASE, "kind": "cross_layer", "num_blocks": 64}, 1)
    assert not worth_staging(layout, [np.arange(10, 40)])  # one run: one descriptor already
    assert worth_staging(layout, [np.arange(0, 40, 2)])  # every other block
    assert not worth_staging(layout, [np.array([], dtype=np.int64)])
    per_layer = layout_for({**BASE, "kind": "per_layer", "num_blocks": 64}, 1)
    assert worth_staging(per_layer, [np.array([1, 2, 3, 9, 10])])  # 2 runs x 6 planes against 6


def test_a_block_needed_before_the_staged_ones_declines_the_span() -> None:
    layout = layout_for({**BASE, "kind": "cross_layer", "num_blocks": 64}, 1)
    ids = [np.arange(8, dtype=np.int64)]
    assert staged_blocks(layout, 32, 16, 32, {0: 16}, ids)[0] == (4,)  # a part from token 16: blocks 4..7
    assert staged_blocks(layout, 32, 16, 32, {0: 8}, ids) is None

