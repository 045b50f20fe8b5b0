"""Compatibility hash: what is hashed, and mismatch errors that name every differing field."""

from __future__ import annotations

import dataclasses

import pytest

from services.engine.kv_cache import kv_groups_for
from services.kv.compat import CompatInfo, KVCompatibilityError, check_compatible, compat_fields
from services.kv.layout import BlockOrder, KVLayoutSpec, LayoutKind


def _layout(**overrides) -> KVLayoutSpec:
    base = dict(kind=LayoutKind.CROSS_LAYER, order=BlockOrder.NHD, num_blocks=64, num_kv_heads=2, head_dim=16,
                dtype="float16", groups=kv_groups_for(4, 16, None))
    return KVLayoutSpec(**{**base, **overrides})


def _info(layout: KVLayoutSpec | None = None, **overrides) -> CompatInfo:
    args = dict(architecture="llama", num_layers=4, num_kv_heads=4, head_dim=16, layout=layout or _layout())
    return CompatInfo.of(compat_fields(**{**args, **overrides}))


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
    assert f"{field}: local {a!r} vs remote {b!r}" in str(e.value)


def test_reconciled_fields_are_not_hashed() -> None:
    # Block size, TP (local head count), pool size and block placement are reconciled, not required equal.
    local = _info()
    remote = _info(layout=_layout(kind=LayoutKind.PER_LAYER, num_blocks=7, num_kv_heads=1,
                                  groups=kv_groups_for(4, 64, None)))
    assert remote.hash == local.hash
    check_compatible(local, remote.fields, remote.hash)


def test_hash_that_disagrees_with_its_fields_is_refused() -> None:
    local, remote = _info(), _info(layout=_layout(dtype="bfloat16"))
    with pytest.raises(KVCompatibilityError, match="does not match the fields"):
        check_compatible(local, {**remote.fields, "dtype": "float16"}, remote.hash)


def test_compat_info_is_a_value() -> None:
    info = _info()
    assert dataclasses.replace(info) == info
