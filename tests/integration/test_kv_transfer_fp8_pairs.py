"""KV between an unquantized engine and an FP8 one, over real NIXL: the pair converts through the staging areas.

A float32/bfloat16 owner told its reader's compat hash quantizes the ticket's blocks into its staging area with
the reader's scales, and the FP8 reader holds exactly what quantizing the owner's values locally gives; an FP8
owner's span is read as e4m3 bytes and dequantized by a float32/bfloat16 reader with the owner's scales. Either
way the READ moves the FP8 bytes (half of 16-bit ones, a quarter of float32), the digest checks them, and a pair
the conversion cannot serve is refused at the handshake naming the field.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from bench.kv_synthetic import identity_for, layout_for, pattern
from services.kv.reader.errors import KVIntegrityError, TicketError
from services.kv.spec.compat import CompatInfo, KVCompatibilityError
from tests.integration.test_kv_transfer import BASE, owner_process, reader

FP8 = "float8_e4m3fn"
SCALES = {"1": [0.5, 2.0], "2": [0.0625, 3.0]}  # layer 0 has none: 1.0
AREA = 1 << 20
NUM_TOKENS = 29  # a partial last block
FRAGMENTED = list(range(1, 17, 2))  # the owner's blocks, none adjacent
LOCAL_IDS = list(range(22, 6, -2))
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, FP8: torch.float8_e4m3fn}


def reader_hash(cfg: dict, tp: int = 1) -> str:
    return CompatInfo.of_identity(identity_for(cfg, layout_for(cfg, tp))).hash


def owner_cfg(cfg: dict, name: str, reader_cfg: dict, tp: int = 1, tell: bool = True, rids=("a",)) -> dict:  # noqa: ANN001
    return {**cfg, "engine_id": f"owner-pair-{name}", "tp": tp, "reader_tp": tp, "staging_bytes": AREA,
            "reader_block_size": cfg["block_size"], "reader_compat_hash": reader_hash(reader_cfg, tp) if tell else "",
            "requests": [{"request_id": rid, "num_tokens": NUM_TOKENS, "block_ids": [FRAGMENTED]} for rid in rids]}


def scale_of(layer: int, kv: int) -> float:
    return float(SCALES.get(str(layer), [1.0, 1.0])[kv])


def convert(x: torch.Tensor, to: str, layer: int, kv: int) -> torch.Tensor:
    """What the pair's converting side makes of one owner value tensor: quantized or dequantized locally."""
    s = scale_of(layer, kv)
    if to == FP8:
        return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (x.float() * s).to(TORCH[to])


def check_converted(owner: dict, r, tp: int, start: int = 0) -> None:  # noqa: ANN001
    """Every pulled (token, head) row of every layer's K and V, as bytes, is the owner's value converted."""
    values, bs = pattern(owner), owner["block_size"]
    heads = owner["num_kv_heads"] // tp
    for rank, cache in enumerate(r.caches):
        for layer, views in cache.views.items():
            for kv, got in enumerate(views):
                for t in range(start, NUM_TOKENS):
                    src = values[layer][kv, FRAGMENTED[t // bs], t % bs, rank * heads:(rank + 1) * heads]
                    want = convert(src, r.cfg["dtype"], layer, kv).view(torch.uint8)
                    row = got[LOCAL_IDS[t // bs], t % bs].cpu().contiguous().view(torch.uint8)
                    assert torch.equal(row, want), f"rank {rank} layer {layer} {'KV'[kv]} token {t}"


KINDS = {"per_layer": {}, "cross_layer": {"kind": "cross_layer"},
         "heads_outer": {"kind": "heads_outer", "order": "HND"}}
PAIRS = [("float32", FP8, "per_layer", 1), ("float32", FP8, "cross_layer", 1), ("float32", FP8, "heads_outer", 2),
         ("bfloat16", FP8, "cross_layer", 1), (FP8, "float32", "per_layer", 1), (FP8, "float32", "heads_outer", 2),
         (FP8, "bfloat16", "cross_layer", 1)]


@pytest.mark.parametrize(("owner_dtype", "reader_dtype", "kind", "tp"), PAIRS)
def test_a_converting_pair_reads_the_fp8_bytes_and_holds_the_converted_values(owner_dtype: str, reader_dtype: str,
                                                                              kind: str, tp: int) -> None:
    base = {**BASE, **KINDS[kind], "kv_scales": SCALES}
    rcfg = {**base, "dtype": reader_dtype}
    ocfg = owner_cfg({**base, "dtype": owner_dtype}, f"{owner_dtype}-{reader_dtype}-{kind}-{tp}", rcfg, tp)
    with owner_process(ocfg) as owner, reader(rcfg, tp, staging_bytes=AREA) as r:
        ticket = owner.tickets["a"]
        assert ticket.staged_offsets and ticket.staged_kv_dtype == (FP8 if reader_dtype == FP8 else "")
        result = asyncio.run(r.puller.pull(ticket, [LOCAL_IDS]))
        check_converted(ocfg, r, tp)
        # 8 blocks of 4 tokens, 3 layers, K and V, 4 heads (over all ranks) of 8 one-byte elements
        assert result.staged and result.num_bytes == 8 * 4 * 3 * 2 * 4 * 8
        assert all(rank.staging.free_bytes == AREA for rank in r.ranks)
        owner.wait_released("a")


@pytest.mark.parametrize(("owner_dtype", "reader_dtype"), [("float32", FP8), (FP8, "float32")])
def test_a_prefix_held_is_skipped_and_a_corrupted_span_is_caught(owner_dtype: str, reader_dtype: str) -> None:
    base = {**BASE, "kind": "cross_layer", "kv_scales": SCALES}
    rcfg = {**base, "dtype": reader_dtype}
    ocfg = owner_cfg({**base, "dtype": owner_dtype}, f"prefix-{owner_dtype}", rcfg, rids=("held", "bad"))
    with owner_process(ocfg) as owner:
        with reader(rcfg, 1, staging_bytes=AREA) as r:
            held = asyncio.run(r.puller.pull(owner.tickets["held"], [LOCAL_IDS], num_cached_tokens=12))
            check_converted(ocfg, r, 1, start=12)
            assert held.num_bytes == 5 * 4 * 3 * 2 * 4 * 8
        with reader(rcfg, 1, staging_bytes=AREA, corrupt=True) as r, pytest.raises(KVIntegrityError):
            asyncio.run(r.puller.pull(owner.tickets["bad"], [LOCAL_IDS]))


def test_the_fp8_pull_moves_half_the_bytes_of_a_bfloat16_one() -> None:
    base = {**BASE, "kind": "cross_layer", "kv_scales": SCALES}
    got = {}
    for name, reader_dtype in (("same", "bfloat16"), ("fp8", FP8)):
        rcfg = {**base, "dtype": reader_dtype}
        ocfg = owner_cfg({**base, "dtype": "bfloat16"}, f"bytes-{name}", rcfg)
        with owner_process(ocfg) as owner, reader(rcfg, 1, staging_bytes=AREA) as r:
            got[name] = asyncio.run(r.puller.pull(owner.tickets["a"], [LOCAL_IDS]))
    assert got["fp8"].staged and got["same"].staged
    assert got["fp8"].num_bytes * 2 == got["same"].num_bytes


REFUSED = {  # name: (owner overrides, reader overrides, reader tp, reader staging, what the refusal names)
    "tp": ({"dtype": "float32"}, {"dtype": FP8}, 2, AREA,
           r"KV group 0 \(full\): dtype local float8_e4m3fn vs remote float32.*needs equal TP sizes: tp local 2 vs "
           r"remote 1"),
    "block_size": ({"dtype": "float32"}, {"dtype": FP8, "block_size": 8}, 1, AREA,
                   r"needs equal block sizes: KV group 0 \(full\): block_size local 8 vs remote 4"),
    "layout_kind": ({"dtype": FP8}, {"dtype": "float32", "kind": "cross_layer"}, 1, AREA,
                    r"kv_layout_kind local cross_layer vs remote per_layer"),
    "no_reader_area": ({"dtype": FP8}, {"dtype": "float32"}, 1, 0, r"a staging area on every rank of this engine"),
    "bf16_fp32": ({"dtype": "float32"}, {"dtype": "bfloat16"}, 1, AREA,
                  r"dtype: local 'bfloat16' vs remote 'float32'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_pair_the_conversion_cannot_serve_is_refused_at_the_handshake(case: str) -> None:
    owner_over, reader_over, tp, area, message = REFUSED[case]
    base = {**BASE, "kv_scales": SCALES}
    rcfg = {**base, **reader_over}
    ocfg = {**owner_cfg({**base, **owner_over}, f"refused-{case}", rcfg, tell=False), "reader_tp": tp}
    with owner_process(ocfg) as owner, reader(rcfg, tp, staging_bytes=area) as r:
        with pytest.raises(ValueError, match=message) as e:
            asyncio.run(r.puller.pull(owner.tickets["a"], [LOCAL_IDS]))
        assert isinstance(e.value, KVCompatibilityError) and "dtype" in e.value.differences


def test_an_owner_not_told_the_reader_hash_stages_its_own_bytes_and_is_refused() -> None:
    """Without the reader's hash an unquantized owner stages (or not) its own dtype: the FP8 reader refuses the
    ticket by name rather than read 16-bit bytes as e4m3."""
    base = {**BASE, "kind": "cross_layer", "kv_scales": SCALES}
    rcfg = {**base, "dtype": FP8}
    with owner_process(owner_cfg({**base, "dtype": "bfloat16"}, "untold", rcfg, tell=False)) as owner, \
            reader(rcfg, 1, staging_bytes=AREA) as r:
        assert owner.tickets["a"].staged_offsets and not owner.tickets["a"].staged_kv_dtype
        with pytest.raises(TicketError, match="its span holds bfloat16 bytes"):
            asyncio.run(r.puller.pull(owner.tickets["a"], [LOCAL_IDS]))
