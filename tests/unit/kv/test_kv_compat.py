"""Compatibility hash: what is hashed, and mismatch errors that name every differing field (and, for
KV groups, the group); the KV value types on the wire and in the handshake."""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.engine.kv_cache.buffers import kv_groups_for
from services.kv.spec.compat import CompatInfo, KVCompatibilityError, KVIdentity, check_compatible, compat_hash
from services.kv.spec.description import (
    EngineDescription,
    HandshakeError,
    RankExport,
    description_from_proto,
    description_to_proto,
)
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.wire import MemoryRegion, group_from_proto, group_to_proto, layout_from_proto, layout_to_proto
from services.proto_gen.pdserve.v1 import kv_pb2


def _layout(**overrides) -> KVLayoutSpec:
    base = dict(kind=LayoutKind.CROSS_LAYER, order=BlockOrder.NHD, num_blocks=64, num_kv_heads=2, head_dim=16,
                dtype="float16", groups=kv_groups_for(4, 16, None))
    return KVLayoutSpec(**{**base, **overrides})


def _info(layout: KVLayoutSpec | None = None, **overrides) -> CompatInfo:
    args = dict(architecture="llama", num_layers=4, num_kv_heads=4, head_dim=16, layout=layout or _layout())
    return CompatInfo.of_identity(KVIdentity.of(**{**args, **overrides}))


def test_equal_engines_pass() -> None:
    a, b = _info(), _info()
    check_compatible(a, b.fields, b.hash)


@pytest.mark.parametrize(
    ("remote", "field"),
    [
        (_info(layout=_layout(dtype="bfloat16")), "dtype"),
        (_info(num_layers=6, layout=_layout(groups=kv_groups_for(6, 16, None))), "num_layers"),
        (_info(head_dim=32, layout=_layout(head_dim=32)), "head_dim"),
        (_info(layout=_layout(order=BlockOrder.HND)), "kv_layout"),
        (_info(architecture="qwen3"), "architecture"),
        (_info(layout=_layout(groups=kv_groups_for(4, 16, 128))), "kv_groups"),
        (_info(protocol_version=2), "protocol_version"),
    ],
)
def test_mismatch_names_the_field_and_both_values(remote: CompatInfo, field: str) -> None:
    local = _info()
    with pytest.raises(KVCompatibilityError) as e:
        check_compatible(local, remote.fields, remote.hash)
    assert field in e.value.differences
    a, b = e.value.differences[field]
    assert a == local.fields[field] and b == remote.fields[field]
    if field == "kv_groups":  # spelled out per group and field
        assert "KV group 0 (full): kind local full vs remote sliding_window" in str(e.value)
    else:
        assert f"{field}: local {a!r} vs remote {b!r}" in str(e.value)


def test_reconciled_fields_are_not_hashed() -> None:
    # Block size, TP (local head count), pool size and block placement are reconciled, not required equal.
    local = _info()
    remote = _info(layout=_layout(kind=LayoutKind.PER_LAYER, num_blocks=7, num_kv_heads=1,
                                  groups=kv_groups_for(4, 64, None)))
    assert remote.hash == local.hash
    check_compatible(local, remote.fields, remote.hash)


def test_heads_outer_is_announced_not_hashed_and_its_hnd_blocks_are() -> None:
    """A heads-outer rank pulls from (and into) cross-layer HND ranks: placement is reconciled; against NHD
    blocks the mismatch names kv_layout. Its kind travels in the rank's layout; a peer that cannot decode the
    kind refuses the handshake naming it."""
    heads_outer = _layout(kind=LayoutKind.HEADS_OUTER, order=BlockOrder.HND)
    remote = _info(layout=heads_outer)
    check_compatible(_info(layout=_layout(order=BlockOrder.HND)), remote.fields, remote.hash)
    with pytest.raises(KVCompatibilityError, match="kv_layout: local 'NHD' vs remote 'HND'"):
        check_compatible(_info(), remote.fields, remote.hash)
    m = layout_to_proto(heads_outer)
    assert m.kind == kv_pb2.HEADS_OUTER and layout_from_proto(m) == heads_outer
    m.kind = 7  # a kind this peer does not know
    with pytest.raises(ValueError, match="unknown layout kind 7"):
        layout_from_proto(m)


def test_hash_that_disagrees_with_its_fields_is_refused() -> None:
    local, remote = _info(), _info(layout=_layout(dtype="bfloat16"))
    with pytest.raises(KVCompatibilityError, match="does not match the fields"):
        check_compatible(local, {**remote.fields, "dtype": "float16"}, remote.hash)


def test_compat_info_is_a_value() -> None:
    info = _info()
    assert dataclasses.replace(info) == info


# ---- hybrid models: per-group KV shape -----------------------------------------------------------


def _hybrid_layout(full_heads: int = 2, full_head_dim: int = 32, tp: int = 1, window: int = 512,
                   block_sizes: tuple[int, int] = (16, 16), **overrides) -> KVLayoutSpec:
    """Gemma-4-like: 5 sliding layers (8 heads of 16), then one full layer with its own shape."""
    sliding = KVCacheGroupSpec(0, AttentionKind.SLIDING_WINDOW, (0, 1, 2, 3, 4), block_sizes[0], window,
                               max(1, 8 // tp), 16)
    full = KVCacheGroupSpec(1, AttentionKind.FULL, (5,), block_sizes[1], None, max(1, full_heads // tp), full_head_dim)
    base = dict(kind=LayoutKind.CROSS_LAYER, order=BlockOrder.NHD, num_blocks=64, num_kv_heads=max(1, 8 // tp),
                head_dim=16, dtype="bfloat16", groups=(sliding, full))
    return KVLayoutSpec(**{**base, **overrides})


def _hybrid_info(layout: KVLayoutSpec | None = None, **overrides) -> CompatInfo:
    args = dict(architecture="gemma4", num_layers=7, num_kv_heads=8, head_dim=16, layout=layout or _hybrid_layout(),
                kv_sharing={6: 5})
    return CompatInfo.of_identity(KVIdentity.of(**{**args, **overrides}))


def test_homogeneous_models_hash_as_before_per_group_shapes() -> None:
    # groups with the model's shape (explicit or not) keep the [kind, window, layers] form
    explicit = _layout(groups=(KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1, 2, 3), 16, None, 2, 16),))
    info = _info(layout=explicit, num_kv_heads=2)
    assert json.loads(info.fields["kv_groups"]) == [["full", None, [0, 1, 2, 3]]]
    assert info.hash == _info(num_kv_heads=2).hash


def test_hybrid_groups_hash_their_shape() -> None:
    info = _hybrid_info()
    assert json.loads(info.fields["kv_groups"]) == [
        ["sliding_window", 512, [0, 1, 2, 3, 4]],  # the model's shape: as before
        ["full", None, [5], 2, 32],  # its own: total heads and head dim
    ]
    assert json.loads(info.fields["kv_sharing"]) == [[6, 5]]


@pytest.mark.parametrize(
    ("remote", "message", "field"),
    [
        (_hybrid_info(layout=_hybrid_layout(full_head_dim=16)), "KV group 1 (full): head_dim local 32 vs remote 16",
         "head_dim"),
        (_hybrid_info(layout=_hybrid_layout(full_heads=4)), "KV group 1 (full): num_kv_heads local 2 vs remote 4",
         "num_kv_heads"),
        (_hybrid_info(layout=_hybrid_layout(window=1024)),
         "KV group 0 (sliding_window): sliding_window local 512 vs remote 1024", "sliding_window"),
    ],
)
def test_group_mismatch_names_the_group_and_the_field(remote: CompatInfo, message: str, field: str) -> None:
    with pytest.raises(KVCompatibilityError) as e:
        check_compatible(_hybrid_info(), remote.fields, remote.hash)
    assert message in str(e.value)
    assert "kv_groups" in e.value.differences  # the compat field, with both values
    assert [(d.group_id, d.field) for d in e.value.group_differences] == [(int(message[9]), field)]
    assert "kv_groups: local" not in str(e.value)  # explained per group, not as two JSON blobs


def test_group_count_and_layer_mismatch() -> None:
    one = _hybrid_layout(groups=(KVCacheGroupSpec(0, AttentionKind.FULL, tuple(range(6)), 16, None, 8, 16),))
    remote = _hybrid_info(layout=one)
    with pytest.raises(KVCompatibilityError, match="KV groups: local 2 vs remote 1") as e:
        check_compatible(_hybrid_info(), remote.fields, remote.hash)
    assert "KV group 0 (sliding_window): kind local sliding_window vs remote full" in str(e.value)
    remote = _hybrid_info(kv_sharing={})
    with pytest.raises(KVCompatibilityError, match="kv_sharing"):
        check_compatible(_hybrid_info(), remote.fields, remote.hash)


def test_group_block_sizes_and_tp_are_not_hashed() -> None:
    local = _hybrid_info()
    # block sizes per group are reconciled; a TP-2 layout with the model's totals per group hashes the same
    assert _hybrid_info(layout=_hybrid_layout(block_sizes=(32, 8))).hash == local.hash
    sharded = _hybrid_layout(tp=2, full_heads=4)
    assert _hybrid_info(layout=sharded, group_kv_heads={0: 8, 1: 4}).hash == \
        _hybrid_info(layout=_hybrid_layout(full_heads=4)).hash
    # without the totals, a sharded group with its own heads cannot be derived: refused, not guessed
    with pytest.raises(ValueError, match=r"KV group 1 \(full\) holds 2 KV heads per rank on a TP-sharded layout"):
        _hybrid_info(layout=sharded)


def test_malformed_remote_groups_fall_back_to_the_raw_field() -> None:
    local = _hybrid_info()
    fields = {**local.fields, "kv_groups": "not json"}
    with pytest.raises(KVCompatibilityError, match="kv_groups: local") as e:
        check_compatible(local, fields, compat_hash(fields))
    assert e.value.group_differences == []


# ---- the wire --------------------------------------------------------------------------------------


def test_groups_and_layouts_round_trip_with_their_shape() -> None:
    layout = _hybrid_layout()
    for g in layout.groups:
        assert group_from_proto(kv_pb2.KVGroup.FromString(group_to_proto(g).SerializeToString())) == g
    plain = KVCacheGroupSpec(0, AttentionKind.FULL, (0, 1), 16)  # None: the layout's shape
    m = group_to_proto(plain)
    assert (m.num_kv_heads, m.head_dim) == (0, 0) and group_from_proto(m) == plain
    assert layout_from_proto(kv_pb2.KVLayout.FromString(layout_to_proto(layout).SerializeToString())) == layout
    # a peer that predates the fields sends 0: read as the layout's own shape
    old = kv_pb2.KVGroup(group_id=0, kind=kv_pb2.FULL, layer_ids=[0, 1], block_size=16)
    assert group_from_proto(old) == plain


def test_handshake_carries_each_group_spec() -> None:
    layout = _hybrid_layout()
    info = _hybrid_info(layout=layout)
    regions = tuple(MemoryRegion(b.index, 4096 * (b.index + 1), b.num_bytes, 0, "DRAM") for b in layout.buffers())
    d = EngineDescription(
        engine_id="p", epoch=3, model_name="m", num_layers=7, num_kv_heads=8, head_dim=16, compat=info,
        groups=layout.groups, ranks=(RankExport(0, "agent", b"meta", regions, layout),), kv_sharing={6: 5},
    )
    m = description_to_proto(d)
    assert [(g.kind, g.sliding_window, list(g.layer_ids), g.num_kv_heads, g.head_dim, g.block_size)
            for g in m.groups] == [(kv_pb2.SLIDING_WINDOW, 512, [0, 1, 2, 3, 4], 8, 16, 16),
                                   (kv_pb2.FULL, 0, [5], 2, 32, 16)]
    back = description_from_proto(kv_pb2.HandshakeResponse.FromString(m.SerializeToString()))
    assert back == d
    # a rank whose layout disagrees with the engine's groups is a malformed handshake
    m.groups[1].head_dim = 16
    with pytest.raises(HandshakeError, match="layout groups differ"):
        description_from_proto(m)


def test_a_pair_that_disagrees_on_the_kv_digest_is_refused_with_the_flag_named() -> None:
    on, off = _info(), _info(kv_digest="off")
    assert on.fields["kv_digest"] != "off" and on.hash != off.hash
    with pytest.raises(KVCompatibilityError, match="kv_digest: local .* vs remote 'off'.*--no-kv-digest") as e:
        check_compatible(on, off.fields, off.hash)
    assert set(e.value.differences) == {"kv_digest"}
