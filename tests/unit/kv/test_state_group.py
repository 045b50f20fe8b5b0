"""The state group (per-request Mamba2 state): slot layout, wire form, compat field and its differences, digest."""

from __future__ import annotations

import pytest
import torch

from services.kv.compat import CompatInfo, KVCompatibilityError, KVIdentity, check_compatible, compat_fields
from services.kv.digest import state_digest
from services.kv.groups import STATE_ALIGN, AttentionKind, KVCacheGroupSpec, StateGroupSpec, StateTensorSpec
from services.kv.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.wire import state_from_proto, state_to_proto

SPEC = StateGroupSpec((0, 2, 3), (StateTensorSpec("ssm", (8, 16, 16), "float32"),
                                  StateTensorSpec("conv", (190, 3), "bfloat16")))


def test_slot_layout_aligns_every_tensor() -> None:
    conv_bytes = 190 * 3 * 2  # 1140: padded to 1152
    assert SPEC.layer_stride == 8 * 16 * 16 * 4 + -(-conv_bytes // STATE_ALIGN) * STATE_ALIGN
    assert SPEC.slot_bytes == 3 * SPEC.layer_stride
    assert [SPEC.offset(layer, "ssm") for layer in (0, 2, 3)] == [0, SPEC.layer_stride, 2 * SPEC.layer_stride]
    assert SPEC.offset(2, "conv") == SPEC.layer_stride + 8192
    with pytest.raises(KeyError):
        SPEC.offset(0, "x")
    with pytest.raises(ValueError):
        StateGroupSpec((0,), (StateTensorSpec("ssm", (8,), "int8"),))


def test_wire_round_trip() -> None:
    assert state_from_proto(state_to_proto(SPEC, 12)) == (SPEC, 12)


def _identity(state: StateGroupSpec | None) -> KVIdentity:
    group = KVCacheGroupSpec(0, AttentionKind.FULL, (1,), 16)
    layout = KVLayoutSpec(LayoutKind.CROSS_LAYER, BlockOrder.NHD, 8, 2, 16, "float32", (group,))
    return KVIdentity.of(architecture="granitemoehybrid", num_layers=4, num_kv_heads=2, head_dim=16, layout=layout,
                         state=state)


def test_compat_field_names_the_state_group_and_field() -> None:
    assert "state" not in compat_fields(_identity(None))  # models without state layers hash as before
    local = CompatInfo.of_identity(_identity(SPEC))
    other = StateGroupSpec((0, 2, 3), (StateTensorSpec("ssm", (8, 16, 32), "float32"), SPEC.tensors[1]),
                           sent_after="all_but_last_prompt_token")
    remote = CompatInfo.of_identity(_identity(other))
    with pytest.raises(KVCompatibilityError) as e:
        check_compatible(local, remote.fields, remote.hash)
    message = str(e.value)
    assert "state group (mamba2): tensor ssm shape local [8, 16, 16] vs remote [8, 16, 32]" in message
    assert "sent_after local all_prompt_tokens vs remote all_but_last_prompt_token" in message
    plain = CompatInfo.of_identity(_identity(None))
    with pytest.raises(KVCompatibilityError, match="state group: local mamba2 vs remote none"):
        check_compatible(local, plain.fields, plain.hash)


def test_state_digest_sees_every_word_and_its_position() -> None:
    slot = torch.randint(0, 256, (SPEC.slot_bytes,), dtype=torch.uint8)
    base = state_digest(slot)
    assert 0 <= base < 2 ** 32 and base == state_digest(slot.clone())
    flipped = slot.clone()
    flipped[SPEC.slot_bytes - 1] ^= 1
    assert state_digest(flipped) != base
    swapped = slot.clone().view(torch.int32)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert swapped[0] == swapped[1] or state_digest(swapped.view(torch.uint8)) != base


def test_engines_of_other_tp_sizes_differ_in_tp_size() -> None:
    """A TP-2 rank holds half the Mamba heads: its state shapes are its own, and the field says of which TP size."""
    half = StateGroupSpec(SPEC.layer_ids, (StateTensorSpec("ssm", (4, 16, 16), "float32"),
                                           StateTensorSpec("conv", (126, 3), "bfloat16")), tp_size=2)
    assert state_from_proto(state_to_proto(half, 3)) == (half, 3)
    local, remote = CompatInfo.of_identity(_identity(SPEC)), CompatInfo.of_identity(_identity(half))
    with pytest.raises(KVCompatibilityError, match="state group \\(mamba2\\): tp_size local 1 vs remote 2"):
        check_compatible(local, remote.fields, remote.hash)
