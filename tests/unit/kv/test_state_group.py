"""The state group (per-request Mamba2 state): slot layout, TP split and the runs between TP sizes, wire form,
compat field and its differences, digest."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.kv.digest.scheme import state_digest
from services.kv.plan.state_runs import state_owner_ranks, state_runs
from services.kv.spec.compat import CompatInfo, KVCompatibilityError, KVIdentity, check_compatible, compat_fields
from services.kv.spec.groups import STATE_ALIGN, AttentionKind, KVCacheGroupSpec, MambaShape, StateGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.wire import state_from_proto, state_to_proto

ONE_GROUP = MambaShape(num_heads=8, head_dim=4, n_groups=1, d_state=6, d_conv=4, conv_dtype="bfloat16")
TWO_GROUPS = MambaShape(num_heads=8, head_dim=4, n_groups=2, d_state=6, d_conv=4, conv_dtype="float32")
SPEC = StateGroupSpec((0, 2, 3), ONE_GROUP)


def test_slot_layout_aligns_every_tensor() -> None:
    ssm_bytes, conv_bytes = 8 * 4 * 6 * 4, (8 * 4 + 2 * 6) * 3 * 2  # 768, 264 -> 320
    assert SPEC.layer_stride == ssm_bytes + -(-conv_bytes // STATE_ALIGN) * STATE_ALIGN
    assert SPEC.slot_bytes == 3 * SPEC.layer_stride
    assert [SPEC.offset(layer, "ssm") for layer in (0, 2, 3)] == [0, SPEC.layer_stride, 2 * SPEC.layer_stride]
    assert SPEC.offset(2, "conv") == SPEC.layer_stride + ssm_bytes
    with pytest.raises(KeyError):
        SPEC.offset(0, "x")
    half = SPEC.with_tp(2).tensors
    assert half[0].shape == (4, 4, 6) and half[1].shape == (4 * 4 + 2 * 6, 3)  # the one group on both ranks
    assert StateGroupSpec((0,), TWO_GROUPS, tp_size=2).tensors[1].shape == (4 * 4 + 2 * 1 * 6, 3)


def test_shapes_that_do_not_split_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot shard the Mamba2 layers"):
        SPEC.with_tp(3)
    with pytest.raises(ValueError, match="cannot shard the Mamba2 layers"):
        MambaShape(8, 4, 2, 6, 4, "float32").rank_heads(4, 0)  # 2 groups over 4 ranks: a group would be split
    with pytest.raises(ValueError, match="heads a multiple of groups"):
        MambaShape(8, 4, 3, 6, 4, "float32")


def _model_state(shape: MambaShape, layers: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the model's (ssm [heads, p, n] float32, conv [x | B | C, d_conv - 1]) as random bytes."""
    g = torch.Generator().manual_seed(seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[shape.conv_dtype]
    conv_rows = shape.num_heads * shape.head_dim + 2 * shape.n_groups * shape.d_state
    return [(torch.randn(shape.num_heads, shape.head_dim, shape.d_state, generator=g),
             torch.randn(conv_rows, shape.d_conv - 1, generator=g).to(dtype)) for _ in range(layers)]


def _rank_slot(spec: StateGroupSpec, rank: int, model: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Rank ``rank``'s slot, split from the model's state the way the engine's mixer holds it: its heads' SSM rows,
    conv x rows of its heads, then B and C rows of its groups (bytes between tensors left 0xAB)."""
    m = spec.mamba
    heads, groups = m.rank_heads(spec.tp_size, rank), m.rank_groups(spec.tp_size, rank)
    x_rows = [h * m.head_dim + i for h in heads for i in range(m.head_dim)]
    b0, c0 = m.num_heads * m.head_dim, m.num_heads * m.head_dim + m.n_groups * m.d_state
    g_rows = [g * m.d_state + i for g in groups for i in range(m.d_state)]
    slot = torch.full((spec.slot_bytes,), 0xAB, dtype=torch.uint8)
    for layer, (ssm, conv) in zip(spec.layer_ids, model, strict=True):
        parts = {"ssm": ssm[list(heads)], "conv": conv[x_rows + [b0 + r for r in g_rows] + [c0 + r for r in g_rows]]}
        for name, tensor in parts.items():
            raw = tensor.contiguous().view(torch.uint8).flatten()
            at = spec.offset(layer, name)
            slot[at:at + len(raw)] = raw
    return slot


# (shape, owner TP, reader TP): every pair of 1, 2 and 4 ranks for one group (spread over the ranks), and of 1 and
# 2 for two groups (split between the ranks; two groups over four ranks do not split).
RUN_CASES = [(ONE_GROUP, a, b) for a, b in itertools.product((1, 2, 4), repeat=2)] + \
    [(TWO_GROUPS, a, b) for a, b in itertools.product((1, 2), repeat=2)]


@pytest.mark.parametrize(("shape", "owner_tp", "reader_tp"), RUN_CASES,
                         ids=[f"{s.n_groups}g-{a}to{b}" for s, a, b in RUN_CASES])
def test_runs_rebuild_every_reader_slot_from_the_owner_slots(shape: MambaShape, owner_tp: int,
                                                            reader_tp: int) -> None:
    model = _model_state(shape, 2, seed=owner_tp * 10 + reader_tp)
    owner, reader = StateGroupSpec((1, 3), shape, tp_size=owner_tp), StateGroupSpec((1, 3), shape, tp_size=reader_tp)
    owner_slots = [_rank_slot(owner, r, model) for r in range(owner_tp)]
    for q in range(reader_tp):
        got = torch.full((reader.slot_bytes,), 0xAB, dtype=torch.uint8)
        moved = 0
        for r in range(owner_tp):
            for run in state_runs(owner, r, reader, q):
                got[run.dst:run.dst + run.length] = owner_slots[r][run.src:run.src + run.length]
                moved += run.length
        assert torch.equal(got, _rank_slot(reader, q, model)), q
        payload = sum(t.num_bytes for t in reader.tensors) * len(reader.layer_ids)
        assert moved == payload, (q, moved, payload)  # every byte the reader holds, each read once
        assert state_owner_ranks(owner, reader, q) == [r for r in range(owner_tp)
                                                       if set(shape.rank_heads(owner_tp, r))
                                                       & set(shape.rank_heads(reader_tp, q))]


def test_wire_round_trip() -> None:
    for spec in (SPEC, StateGroupSpec((0, 5), TWO_GROUPS, tp_size=2)):
        assert state_from_proto(state_to_proto(spec, 12)) == (spec, 12)


def _identity(state: StateGroupSpec | None) -> KVIdentity:
    group = KVCacheGroupSpec(0, AttentionKind.FULL, (1,), 16)
    layout = KVLayoutSpec(LayoutKind.CROSS_LAYER, BlockOrder.NHD, 8, 2, 16, "float32", (group,))
    return KVIdentity.of(architecture="granitemoehybrid", num_layers=4, num_kv_heads=2, head_dim=16, layout=layout,
                         state=state)


def test_compat_field_names_the_state_group_and_field_and_ignores_tp() -> None:
    assert "state" not in compat_fields(_identity(None))  # models without state layers hash as before
    local = CompatInfo.of_identity(_identity(SPEC))
    assert CompatInfo.of_identity(_identity(SPEC.with_tp(2))).hash == local.hash  # heads are mapped, not hashed
    other = StateGroupSpec(SPEC.layer_ids, MambaShape(8, 4, 1, 12, 4, "bfloat16"), sent_after="all_but_last_token")
    remote = CompatInfo.of_identity(_identity(other))
    with pytest.raises(KVCompatibilityError) as e:
        check_compatible(local, remote.fields, remote.hash)
    message = str(e.value)
    assert "state group (mamba2): d_state local 6 vs remote 12" in message
    assert "sent_after local all_prompt_tokens vs remote all_but_last_token" in message
    plain = CompatInfo.of_identity(_identity(None))
    with pytest.raises(KVCompatibilityError, match="state group: local mamba2 vs remote none"):
        check_compatible(local, plain.fields, plain.hash)


def test_state_digest_is_keyed_by_the_readers_place_and_sees_every_word() -> None:
    slot = torch.randint(0, 256, (SPEC.slot_bytes,), dtype=torch.uint8)
    runs = [(0, 256, 0), (512, 128, 256)]
    base = state_digest(slot, runs)
    assert 0 <= base < 2 ** 32
    assert state_digest(slot, [runs[0]]) + state_digest(slot, [runs[1]]) & 0xFFFFFFFF == base  # it splits by run
    assert state_digest(slot, [(0, 256, 0), (512, 128, 260)]) != base  # the same bytes landing one word later
    for byte in itertools.islice(itertools.chain(range(0, 256, 37), range(512, 640, 29)), 12):
        flipped = slot.clone()
        flipped[byte] ^= 1
        assert state_digest(flipped, runs) != base, byte
