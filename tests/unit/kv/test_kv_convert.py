"""KV dtype conversion between an unquantized engine and an FP8 one: which pairs convert, who converts with which
scales, the copies that convert in a staging area, and the digest of a staged span."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from services.kv.digest.runner import digest_job
from services.kv.digest.scheme import DigestJob
from services.kv.plan.staging import SpanDtype
from services.kv.ranks.span_convert import dequantize_scatter, quantize_gather, span_digests
from services.kv.ranks.staging_area import StagingArea, gather, scatter
from services.kv.spec.compat import CompatInfo, KVCompatibilityError, KVIdentity
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.kv_convert import check_pair, conversion, fields_as, target_hashes
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.pair_support import PairSide, pair_refusal
from services.kv.spec.wire import MemoryRegion

FP8 = "float8_e4m3fn"
SCALES = {1: (0.5, 2.0), 5: (0.125, 4.0)}


def _layout(dtype: str, kind: LayoutKind = LayoutKind.CROSS_LAYER, order: BlockOrder = BlockOrder.NHD,
            block_size: int = 4) -> KVLayoutSpec:
    sliding = KVCacheGroupSpec(0, AttentionKind.SLIDING_WINDOW, (0, 1, 2, 3, 4), block_size, 512, 4, 8)
    full = KVCacheGroupSpec(1, AttentionKind.FULL, (5,), block_size, None, 2, 16)
    return KVLayoutSpec(kind=kind, order=order, num_blocks=12, num_kv_heads=4, head_dim=8, dtype=dtype,
                        groups=(sliding, full))


def _info(dtype: str, scales: dict | None = None, **layout) -> CompatInfo:
    return CompatInfo.of_identity(KVIdentity.of(
        architecture="gemma4", num_layers=6, num_kv_heads=4, head_dim=8, layout=_layout(dtype, **layout),
        group_kv_heads={0: 4, 1: 2}, kv_scales=SCALES if scales is None else scales))


@pytest.mark.parametrize("other", ["float32", "bfloat16", "float16"])
def test_an_unquantized_and_an_fp8_engine_convert_with_the_fp8_sides_scales(other: str) -> None:
    fp8, plain = _info(FP8), _info(other)
    send = conversion(plain.fields, fp8.fields)
    assert send is not None and send.quantize_on_send and send.wire_dtype == FP8
    assert send.layer_scales() == {0: (1.0, 1.0), 1: (0.5, 2.0), 2: (1.0, 1.0), 3: (1.0, 1.0), 4: (1.0, 1.0),
                                   5: (0.125, 4.0)}
    read = conversion(fp8.fields, plain.fields)
    assert read is not None and not read.quantize_on_send and read.layer_scales() == send.layer_scales()
    # the rewritten fields are the other engine's exactly: the recorded hashes are untouched by this
    assert CompatInfo.of(fields_as(plain.fields, FP8, SCALES)).hash == fp8.hash
    assert CompatInfo.of(fields_as(fp8.fields, other)).hash == plain.hash
    assert check_pair(fp8, plain.fields, plain.hash) == send


def test_pairs_that_differ_in_more_than_a_convertible_dtype_do_not_convert() -> None:
    fp8 = _info(FP8)
    assert conversion(_info("float32").fields, _info("bfloat16").fields) is None  # a cast saves no bytes
    assert conversion(_info("float32", order=BlockOrder.HND).fields, fp8.fields) is None
    assert conversion(fp8.fields, fp8.fields) is None
    with pytest.raises(KVCompatibilityError, match="dtype: local 'bfloat16' vs remote 'float32'"):
        check_pair(_info("bfloat16"), _info("float32").fields, _info("float32").hash)
    with pytest.raises(KVCompatibilityError, match="kv_layout"):
        other = _info("float32", order=BlockOrder.HND)
        check_pair(fp8, other.fields, other.hash)


def test_an_owner_converts_only_for_a_reader_whose_scales_it_holds() -> None:
    plain, fp8 = _info("bfloat16"), _info(FP8)
    assert target_hashes(plain.fields, SCALES) == {fp8.hash: FP8}
    assert fp8.hash not in target_hashes(plain.fields, {1: (0.5, 2.0)})  # layer 5's scales differ
    assert target_hashes(fp8.fields, None)[_info("float32").hash] == "float32"


def test_the_router_pairs_a_converting_pair_of_equal_tp_and_block_sizes_only() -> None:
    plain, fp8 = _info("bfloat16"), _info(FP8)
    assert pair_refusal(PairSide(plain.hash, plain.fields, 1, 4), PairSide(fp8.hash, fp8.fields, 1, 4)) is None
    assert pair_refusal(PairSide(fp8.hash, fp8.fields, 2, 4), PairSide(plain.hash, plain.fields, 2, 4)) is None
    tp = pair_refusal(PairSide(plain.hash, plain.fields, 2, 4), PairSide(fp8.hash, fp8.fields, 1, 4))
    assert tp == ("KV dtype prefill bfloat16 vs decode float8_e4m3fn converts only through staging, which needs "
                  "equal TP sizes: tp prefill 2 vs decode 1")
    blocks = pair_refusal(PairSide(plain.hash, plain.fields, 1, 4), PairSide(fp8.hash, fp8.fields, 1, 8))
    assert "equal block sizes: block_size prefill 4 vs decode 8" in blocks
    other = _info(FP8, scales={})
    assert "kv_scales prefill" in pair_refusal(PairSide(other.hash, other.fields), PairSide(fp8.hash, fp8.fields))


def _pool(layout: KVLayoutSpec, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, FP8: torch.float8_e4m3fn}[layout.dtype]
    return [(torch.randn(b.num_bytes // layout.element_size, generator=gen) * 3).to(dtype) for b in layout.buffers()]


def _area() -> StagingArea:
    return StagingArea(torch.zeros(1 << 18, dtype=torch.uint8), MemoryRegion(0, 0, 1 << 18, 0, None))


def _values(layout: KVLayoutSpec, buffers: list[torch.Tensor], layer: int, kv: int, ids: list[int]) -> torch.Tensor:
    v = layout.view(layer, kv)
    return buffers[v.buffer_index].as_strided(v.shape, v.strides, v.offset)[ids]


KINDS = [(LayoutKind.PER_LAYER, BlockOrder.NHD), (LayoutKind.CROSS_LAYER, BlockOrder.HND),
         (LayoutKind.HEADS_OUTER, BlockOrder.HND)]


@pytest.mark.parametrize(("kind", "order"), KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantize_gather_and_dequantize_scatter_round_values_as_the_engine_does(kind: LayoutKind, order: BlockOrder,
                                                                                dtype: str) -> None:
    plain = _layout(dtype, kind, order)
    fp8 = dataclasses.replace(plain, dtype=FP8)
    src, ids = _pool(plain, 1), [np.array([7, 2, 9]), np.array([3, 11, 0])]
    area, span = _area(), SpanDtype(FP8, SCALES)
    quantize_gather(plain, src, area, 0, ids, span)
    held = [torch.zeros_like(b) for b in _pool(fp8, 0)]
    local = [np.array([1, 4, 5]), np.array([6, 2, 8])]
    scatter(fp8, held, area, 0, local)  # the FP8 reader takes the span as its own blocks' bytes
    back = [torch.zeros_like(b) for b in src]
    dequantize_scatter(plain, back, area, 0, local, span)
    for g in plain.groups:
        for layer in g.layer_ids:
            for kv in range(2):
                s = SCALES.get(layer, (1.0, 1.0))[kv]
                want = (_values(plain, src, layer, kv, list(ids[g.group_id])).float() / s).clamp(-448, 448)
                want = want.to(torch.float8_e4m3fn)
                got = _values(fp8, held, layer, kv, list(local[g.group_id]))
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                again = _values(plain, back, layer, kv, list(local[g.group_id]))
                assert torch.equal(again, (want.float() * s).to(again.dtype))


@pytest.mark.parametrize(("kind", "order"), KINDS)
def test_a_span_digests_as_its_blocks_do(kind: LayoutKind, order: BlockOrder) -> None:
    fp8 = _layout(FP8, kind, order)
    pool, area = _pool(fp8, 3), _area()
    ids = [np.array([5, 1, 8, 3]), np.array([0, 10, 4, 6])]
    gather(fp8, pool, area, 512, [i[1:] for i in ids])  # a span of the blocks from the second one
    for g in fp8.groups:
        job = DigestJob(g.group_id, ids[g.group_id], 4, 15, 2, 0, fp8.kv_heads(g.group_id), 0)
        (from_span,) = span_digests(fp8, area, 512, [3, 3], [job])
        assert np.array_equal(from_span, digest_job(fp8, pool, job))
