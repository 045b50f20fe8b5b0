"""FP8 KV in the compatibility hash: dtype, scale scheme and scales hashed per KV group only when the KV is
quantized (every other engine hashes as before), the values carried exactly, and a mismatch that names the
group and the field."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from services.engine.kv_cache.buffers import kv_groups_for
from services.kv.spec.compat import (
    CompatInfo,
    KVCompatibilityError,
    KVIdentity,
    check_compatible,
    parse_groups,
)
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.kv_quant import SCALE_SCHEME, group_scales, scales_digest
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.pair_support import PairSide, group_heads_from_fields, pair_refusal

FP8 = "float8_e4m3fn"
# float32 values that are not short decimals: they must travel bit for bit
SCALES = {layer: (float(np.float32(0.0173 * (layer + 1))), float(np.float32(1 / 3 + layer))) for layer in range(6)}


def _layout(dtype: str = FP8, **overrides) -> KVLayoutSpec:
    sliding = KVCacheGroupSpec(0, AttentionKind.SLIDING_WINDOW, (0, 1, 2, 3, 4), 16, 512, 8, 16)
    full = KVCacheGroupSpec(1, AttentionKind.FULL, (5,), 16, None, 2, 32)
    base = dict(kind=LayoutKind.CROSS_LAYER, order=BlockOrder.NHD, num_blocks=64, num_kv_heads=8, head_dim=16,
                dtype=dtype, groups=(sliding, full))
    return KVLayoutSpec(**{**base, **overrides})


def _info(layout: KVLayoutSpec | None = None, **overrides) -> CompatInfo:
    args = dict(architecture="gemma4", num_layers=6, num_kv_heads=8, head_dim=16, layout=layout or _layout(),
                group_kv_heads={0: 8, 1: 2}, kv_scales=SCALES)
    return CompatInfo.of_identity(KVIdentity.of(**{**args, **overrides}))


def _refusal(local: CompatInfo, remote: CompatInfo) -> KVCompatibilityError:
    with pytest.raises(KVCompatibilityError) as e:
        check_compatible(local, remote.fields, remote.hash)
    return e.value


def test_unquantized_engines_hash_as_before_and_ignore_scales() -> None:
    bf16 = _layout("bfloat16")
    plain = _info(layout=bf16, kv_scales=None)
    assert _info(layout=bf16).hash == plain.hash  # scales mean nothing for unquantized bytes
    assert all(not isinstance(entry[-1], dict) for entry in json.loads(plain.fields["kv_groups"]))


def test_fp8_groups_carry_dtype_scheme_and_exact_scales() -> None:
    info = _info()
    entries = json.loads(info.fields["kv_groups"])
    assert entries[0][-1] == {"dtype": FP8, "scale": SCALE_SCHEME,
                              "kv_scales": [list(SCALES[x]) for x in range(5)]}
    assert entries[1][:-1] == ["full", None, [5], 2, 32]  # the group's own shape, then its quantization
    assert group_scales(info.fields) == [{x: SCALES[x] for x in range(5)}, {5: SCALES[5]}]  # bit for bit
    # the group parser (router, topology check) reads an FP8 engine's groups as any other's
    assert parse_groups(info.fields)[1] == ("full", None, [5], 2, 32, "sharded")
    assert group_heads_from_fields(info.fields) == {0: 8, 1: 2}
    assert _info(kv_scales=None).hash == _info(kv_scales=dict.fromkeys(range(6), (1.0, 1.0))).hash  # default 1.0


def test_dtype_mismatch_names_each_group_and_field() -> None:
    err = _refusal(_info(layout=_layout("bfloat16")), _info())
    assert "KV group 0 (sliding_window): dtype local bfloat16 vs remote float8_e4m3fn" in str(err)
    assert "KV group 1 (full): dtype local bfloat16 vs remote float8_e4m3fn" in str(err)
    assert f"KV group 1 (full): kv_scales local none vs remote {scales_digest([SCALES[5]])}" in str(err)
    assert {(d.group_id, d.field) for d in err.group_differences} == {
        (g, f) for g in (0, 1) for f in ("dtype", "scale", "kv_scales")}
    assert "dtype: local" not in str(err) and err.differences["dtype"] == ("bfloat16", FP8)


def test_scale_mismatch_names_only_the_group_whose_layer_differs() -> None:
    other = {**SCALES, 5: (SCALES[5][0], math.nextafter(SCALES[5][1], 2.0))}  # one ulp of one V scale
    err = _refusal(_info(), _info(kv_scales=other))
    local, remote = scales_digest([SCALES[5]]), scales_digest([other[5]])
    assert local != remote and str(err) == (
        f"KV caches are incompatible: KV group 1 (full): kv_scales local {local} vs remote {remote}")
    assert [(d.group_id, d.field) for d in err.group_differences] == [(1, "kv_scales")]


def test_pair_check_names_the_group_field_with_prefill_and_decode() -> None:
    """bfloat16 and FP8 KV convert (tests/unit/kv/test_kv_convert.py); float16 and bfloat16 do not, named by group."""
    f16, bf16 = _info(layout=_layout("float16")), _info(layout=_layout("bfloat16"))
    reason = pair_refusal(PairSide(bf16.hash, bf16.fields), PairSide(f16.hash, f16.fields))
    assert "compat field dtype: prefill bfloat16 vs decode float16" in reason
    fp8 = _info()
    assert pair_refusal(PairSide(fp8.hash, fp8.fields), PairSide(fp8.hash, fp8.fields)) is None
    other = _info(kv_scales={0: (0.25, 1.0)})
    assert "KV group 0 (sliding_window): kv_scales prefill sha:" in pair_refusal(
        PairSide(other.hash, other.fields), PairSide(fp8.hash, fp8.fields))


def test_mla_fp8_group_keeps_its_row_and_adds_its_scales() -> None:
    row = KVCacheGroupSpec(0, AttentionKind.MLA, (0, 1), 16, None, 1, 96)
    mla = KVLayoutSpec(kind=LayoutKind.CROSS_LAYER, order=BlockOrder.NHD, num_blocks=8, num_kv_heads=1,
                       head_dim=96, dtype=FP8, groups=(row,))
    info = CompatInfo.of_identity(KVIdentity.of(architecture="deepseek_v3", num_layers=2, num_kv_heads=1,
                                                head_dim=96, layout=mla, kv_scales={0: (0.5, 1.0)}))
    assert parse_groups(info.fields) == [("mla", None, [0, 1], 1, 96, "replicated")]
    assert group_scales(info.fields) == [{0: (0.5, 1.0), 1: (1.0, 1.0)}]


@pytest.mark.parametrize(("scales", "message"), [
    ({0: (0.0, 1.0)}, "finite and positive"),
    ({2: (float("nan"), 1.0)}, "finite and positive"),
    ({9: (1.0, 1.0)}, r"name layers \[9\], the model has 6"),
    ({1: (1.0,)}, r"must be \(k_scale, v_scale\)"),
])
def test_bad_scales_are_refused_by_name(scales: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _info(kv_scales=scales)


def test_a_malformed_quantization_object_falls_back_to_the_raw_field() -> None:
    local = _info()
    entries = json.loads(local.fields["kv_groups"])
    entries[0][-1]["kv_scales"] = "garbage"
    fields = {**local.fields, "kv_groups": json.dumps(entries)}
    remote = CompatInfo.of(fields)
    err = _refusal(local, remote)
    assert err.group_differences == [] and "kv_groups: local" in str(err)
    assert group_scales(fields) is None


def test_homogeneous_fp8_model() -> None:
    layout = KVLayoutSpec(kind=LayoutKind.PER_LAYER, order=BlockOrder.HND, num_blocks=8, num_kv_heads=2,
                          head_dim=16, dtype=FP8, groups=kv_groups_for(4, 16, None))
    info = CompatInfo.of_identity(KVIdentity.of(architecture="llama", num_layers=4, num_kv_heads=2, head_dim=16,
                                                layout=layout))
    assert json.loads(info.fields["kv_groups"]) == [
        ["full", None, [0, 1, 2, 3], {"dtype": FP8, "scale": SCALE_SCHEME, "kv_scales": [[1.0, 1.0]] * 4}]]


def test_scales_keyed_by_layer_name_are_the_same_layers() -> None:
    """Scales read from JSON name their layers as strings: "1" is layer 1, not a layer without scales."""
    from services.kv.spec.kv_quant import layer_scales

    assert layer_scales({"1": (0.5, 2.0)}, [0, 1], 2) == ((0, 1.0, 1.0), (1, 0.5, 2.0))
    with pytest.raises(ValueError, match="name layers \\[2\\]"):
        layer_scales({"2": (0.5, 2.0)}, [0, 1], 2)
