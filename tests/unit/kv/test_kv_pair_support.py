"""Which (prefill, decode) pairs are supported, and the reasons given for those that are not."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kv.spec.compat import CompatInfo, KVIdentity
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.pair_support import PairSide, group_heads_from_fields, pair_refusal
from services.kv.spec.topology import group_readers_per_remote_rank


def _layout(heads: int = 4, dtype: str = "bfloat16", groups: tuple[KVCacheGroupSpec, ...] | None = None,
            head_dim: int = 16) -> KVLayoutSpec:
    groups = groups or (KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1, 2, 3), 16),)
    return KVLayoutSpec(kind=LayoutKind.CROSS_LAYER, order=BlockOrder.NHD, num_blocks=64, num_kv_heads=heads,
                        head_dim=head_dim, dtype=dtype, groups=groups)


def _dense(heads: int = 4, dtype: str = "bfloat16") -> CompatInfo:
    """A llama-like model: one full-attention group with the model's heads."""
    return CompatInfo.of_identity(KVIdentity.of(architecture="llama", num_layers=4, num_kv_heads=heads, head_dim=16,
                                                layout=_layout(heads, dtype)))


def _hybrid(sliding_heads: int = 8, full_heads: int = 2, full_head_dim: int = 32) -> CompatInfo:
    """Gemma-4-like: 5 sliding layers with the model's heads, one full layer with its own heads and dim."""
    groups = (KVCacheGroupSpec(0, AttentionKind.SLIDING_WINDOW, (0, 1, 2, 3, 4), 16, 512, sliding_heads, 16),
              KVCacheGroupSpec(1, AttentionKind.FULL, (5,), 16, None, full_heads, full_head_dim))
    identity = KVIdentity.of(architecture="gemma4", num_layers=7, num_kv_heads=sliding_heads, head_dim=16,
                             layout=_layout(sliding_heads, groups=groups), kv_sharing={6: 5})
    return CompatInfo.of_identity(identity)


def _side(info: CompatInfo, tp: int = 1, block_size: int | None = 16, **kw) -> PairSide:
    return PairSide(info.hash, info.fields, tp, block_size, **kw)


# ---- per-group heads from the compat fields ----------------------------------------------------


def test_group_heads_from_fields() -> None:
    assert group_heads_from_fields(_dense(4).fields) == {0: 4}
    # the sliding group has the model's heads (left out of kv_groups), the full group its own
    assert group_heads_from_fields(_hybrid(8, 2).fields) == {0: 8, 1: 2}
    assert group_heads_from_fields(_hybrid(8, 8, 16).fields) == {0: 8, 1: 8}
    assert group_heads_from_fields({"num_kv_heads": "3"}) == {0: 3}
    assert group_heads_from_fields({}) == {}
    assert group_heads_from_fields({"num_kv_heads": "x"}) == {}


# ---- supported pairs -----------------------------------------------------------------------------


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 8)])
def test_hybrid_groups_with_their_own_heads_pair_under_tp(prefill_tp: int, decode_tp: int) -> None:
    info = _hybrid(8, 2)
    assert pair_refusal(_side(info, prefill_tp), _side(info, decode_tp)) is None


def test_equal_models_pair_across_tp_and_dividing_block_sizes() -> None:
    info = _dense(3)
    assert pair_refusal(_side(info, 1, 16), _side(info, 3, 64)) is None
    assert pair_refusal(_side(info, 3, 64), _side(info, 1, 16)) is None
    assert pair_refusal(_side(info, 1, None), _side(info, 1, 48)) is None  # a size not reported is not held against


def test_sides_without_fields_are_judged_by_hash_and_block_size() -> None:
    assert pair_refusal(PairSide("h", tp_size=2), PairSide("h", tp_size=3)) is None  # heads unknown: handshake checks
    assert pair_refusal(PairSide("h"), PairSide("h2")) == "compat hash: prefill h vs decode h2"


# ---- refusals ------------------------------------------------------------------------------------


def test_a_compat_difference_names_the_field_and_both_values() -> None:
    reason = pair_refusal(_side(_dense(dtype="float32")), _side(_dense(dtype="bfloat16")))
    assert reason == "compat field dtype: prefill float32 vs decode bfloat16"


def test_a_group_difference_names_the_group() -> None:
    reason = pair_refusal(_side(_hybrid(full_head_dim=32)), _side(_hybrid(full_head_dim=16)))
    assert reason == "KV group 1 (full): head_dim prefill 32 vs decode 16"
    reason = pair_refusal(_side(_hybrid(full_heads=2)), _side(_hybrid(full_heads=4)))
    assert reason == "KV group 1 (full): num_kv_heads prefill 2 vs decode 4"


def test_missing_or_forged_hashes_are_refused() -> None:
    info = _dense()
    assert pair_refusal(PairSide(""), _side(info)) == "prefill reports no KV compatibility hash"
    assert pair_refusal(_side(info), PairSide("")) == "decode reports no KV compatibility hash"
    forged = PairSide(info.hash, {**info.fields, "dtype": "float16"})
    assert "decode compatibility hash" in pair_refusal(_side(info), forged)
    assert "does not match its fields" in pair_refusal(_side(info), forged)


def test_block_sizes_that_do_not_divide() -> None:
    info = _dense()
    assert pair_refusal(_side(info, block_size=32), _side(info, block_size=48)) == \
        "block sizes 32 (prefill) and 48 (decode) do not divide each other"
    assert pair_refusal(_side(info, block_size=16), _side(info, block_size=48)) is None  # 48 = 3 x 16
    # per group where known: group 1's sizes are its own
    prefill = _side(_hybrid(), group_block_sizes={0: 16, 1: 32})
    assert pair_refusal(prefill, _side(_hybrid(), group_block_sizes={0: 64, 1: 32})) is None
    assert pair_refusal(prefill, _side(_hybrid(), group_block_sizes={0: 64, 1: 24})) == \
        "KV group 1: block sizes 32 (prefill) and 24 (decode) do not divide each other"


def test_a_tp_size_that_cannot_shard_the_heads() -> None:
    info = _dense(3)
    assert pair_refusal(_side(info, 1), _side(info, 2)) == \
        "decode tp 2 cannot shard 3 KV heads (neither divides the other)"
    assert pair_refusal(_side(info, 2), _side(info, 4)) == (
        "prefill tp 2 cannot shard 3 KV heads (neither divides the other); "
        "decode tp 4 cannot shard 3 KV heads (neither divides the other)")
    assert pair_refusal(_side(info, 1), _side(info, 0)) == "decode tp 0 is not a TP size"


def test_a_group_tp_cannot_shard_is_named_by_group() -> None:
    info = _hybrid(8, 3)  # the full group has 3 heads: tp 2 shards the sliding group but not it
    assert pair_refusal(_side(info, 1), _side(info, 2)) == \
        "KV group 1: decode tp 2 cannot shard 3 KV heads (neither divides the other)"
    assert pair_refusal(_side(info, 1), _side(info, 1)) is None


def test_the_first_failing_check_is_reported() -> None:
    # compat first, then block sizes, then TP: one reason, the most basic one
    a, b = _dense(3, "float32"), _dense(3)
    assert pair_refusal(_side(a, 2, 32), _side(b, 2, 48)).startswith("compat field dtype")
    assert pair_refusal(_side(b, 2, 32), _side(b, 2, 48)).startswith("block sizes")


# ---- agreement with the topology -----------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    sliding=st.sampled_from([1, 2, 3, 4, 8]),
    full=st.sampled_from([1, 2, 3, 4, 8]),
    prefill_tp=st.sampled_from([1, 2, 3, 4, 8]),
    decode_tp=st.sampled_from([1, 2, 3, 4, 8]),
)
def test_supported_exactly_when_the_topology_can_map_it(sliding, full, prefill_tp, decode_tp) -> None:
    """A pair pair_refusal accepts is one group_rank_reads can map, and the other way round."""
    info = _hybrid(sliding, full, 32)
    heads = group_heads_from_fields(info.fields)
    assert heads == {0: sliding, 1: full}
    reason = pair_refusal(_side(info, prefill_tp), _side(info, decode_tp))
    try:
        group_readers_per_remote_rank(decode_tp, prefill_tp, heads)
    except ValueError:
        assert reason is not None and "cannot shard" in reason
    else:
        assert reason is None


def test_pair_side_is_hashable_without_its_mappings() -> None:
    side = _side(_dense())
    assert hash(side) == hash(dataclasses.replace(side, compat_fields={}))
