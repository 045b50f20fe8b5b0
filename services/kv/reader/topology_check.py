"""The reader's handshake-time check of a peer (``PeerCache``'s ``validate``): refuse a pair this engine could never
transfer between (TP, KV groups, per-group shape, block sizes, head shares, state slots), once per handshake and
after the compatibility check, naming the group and field; and warn of a pair that reads slowly."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.kv.plan.staging import same_layout
from services.kv.plan.state_runs import state_owner_ranks
from services.kv.ranks.kv_rank import KVRank
from services.kv.spec.compat import CompatInfo, KVCompatibilityError, KVIdentity, check_compatible
from services.kv.spec.description import EngineDescription
from services.kv.spec.groups import AttentionKind
from services.kv.spec.kv_convert import KVConversion, conversion
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.pair_support import group_heads_from_fields
from services.kv.spec.topology import RankRead, block_unit, group_rank_reads, kv_head_range

log = logging.getLogger(__name__)


def check_topology(ranks: Sequence[KVRank], identity: KVIdentity, remote: EngineDescription) -> None:
    """Refuse a pair we could never transfer between: TP, groups, per-group shape and block sizes."""
    local, owner = ranks[0].layout, remote.ranks[0].layout
    _check_groups(local, remote)
    own = CompatInfo.of_identity(identity)
    conv = conversion(remote.compat.fields, own.fields) if remote.compat.hash != own.hash else None
    if conv is not None:
        check_conversion(ranks, remote, conv, own)
    # Each group is sharded by its own total heads (from the compat fields both sides hashed);
    # every rank must hold exactly the slice that sharding gives it, or reads would land wrong.
    heads = group_heads_from_fields(remote.compat.fields)
    for side, tp, layouts in (("local", len(ranks), [r.layout for r in ranks]),
                              ("remote", remote.tp_size, [r.layout for r in remote.ranks])):
        _check_head_shares(side, tp, layouts, heads)
    reads = [group_rank_reads(len(ranks), rank, remote.tp_size, heads) for rank in range(len(ranks))]
    if identity.state is not None or remote.state is not None:
        _check_state(ranks, identity, remote, reads)
    if len(ranks) != remote.tp_size and (local.kind, owner.kind) != (LayoutKind.HEADS_OUTER,) * 2:
        log.warning("pulling from %s (tp %d, %s %s) into tp %d (%s %s): each rank reads its heads of a block as "
                    "%s; the heads_outer KV layout on both sides (--kv-layout heads_outer, or auto with "
                    "--peer-tp-size) reads a run per head for consecutive blocks", remote.engine_id,
                    remote.tp_size, owner.kind.value, owner.order.value, len(ranks), local.kind.value,
                    local.order.value,
                    "a run per token, layer and K/V" if local.order is BlockOrder.NHD else "a run per layer and K/V")


def _check_groups(local: KVLayoutSpec, remote: EngineDescription) -> None:
    """The same KV groups in order: kind, window, layers, head dim (an MLA group's row width), and block sizes
    that ``block_unit`` accepts."""
    if len(local.groups) != len(remote.groups):
        raise ValueError(f"remote has {len(remote.groups)} KV groups, local {len(local.groups)}")
    owner = remote.ranks[0].layout
    for lg, rg in zip(local.groups, remote.groups, strict=True):
        for name, a, b in (
            ("kind", lg.kind.value, rg.kind.value),
            ("sliding_window", lg.sliding_window, rg.sliding_window),
            ("layers", sorted(lg.layer_ids), sorted(rg.layer_ids)),
            ("row_width" if AttentionKind.MLA in (lg.kind, rg.kind) else "head_dim",
             local.group_head_dim(lg.group_id), owner.group_head_dim(rg.group_id)),
        ):
            if a != b:
                raise ValueError(f"{lg.label}: {name} local {a} vs remote {b}")
        try:
            block_unit(rg.block_size, lg.block_size)
        except ValueError as e:
            raise ValueError(f"{lg.label}: {e}") from None


def check_conversion(ranks: Sequence[KVRank], remote: EngineDescription, conv: KVConversion, own: CompatInfo
                     ) -> None:
    """A pair whose KV dtypes convert (``spec.kv_convert``) moves every ticket through the staging areas: equal TP
    sizes, the owner's ranks with staging areas (and this engine's, when it dequantizes), and each rank's layout
    the owner's rank's but for the dtype and pool size (kind, block order, every group's block size). A pair
    without them is refused as incompatible (the groups' dtype named as ever), and why it cannot convert."""
    gap = _conversion_gap(ranks, remote, conv)
    if gap is None:
        return
    try:
        check_compatible(own, remote.compat.fields, remote.compat.hash)
    except KVCompatibilityError as e:
        raise KVCompatibilityError(f"{e}; the pair converts KV only through staging, which needs {gap}",
                                   e.differences, e.group_differences) from None


def _conversion_gap(ranks: Sequence[KVRank], remote: EngineDescription, conv: KVConversion) -> str | None:
    """What a converting pair lacks, naming the field (None: nothing)."""
    if len(ranks) != remote.tp_size:
        return f"equal TP sizes: tp local {len(ranks)} vs remote {remote.tp_size}"
    if any(o.staging_region is None for o in remote.ranks):
        return "a staging area on every owner rank: the owner announces none (--kv-staging-mib)"
    if not conv.quantize_on_send and any(q.staging is None for q in ranks):
        return "a staging area on every rank of this engine to dequantize in (--kv-staging-mib)"
    for o, q in zip(remote.ranks, ranks, strict=True):
        if same_layout(o.layout, q.layout, conv.wire_dtype):
            continue
        a, b = q.layout, o.layout
        for lg, rg in zip(a.groups, b.groups, strict=True):
            if lg.block_size != rg.block_size:
                return f"equal block sizes: {lg.label}: block_size local {lg.block_size} vs remote {rg.block_size}"
        for name, x, y in (("kv_layout_kind", a.kind.value, b.kind.value), ("kv_layout", a.order.value, b.order.value)):
            if x != y:
                return f"one layout: {name} local {x} vs remote {y}"
        return f"one layout: local {a} vs remote {b}"
    return None


def _check_head_shares(side: str, tp: int, layouts: Sequence[KVLayoutSpec], heads: dict[int, int]) -> None:
    """Each rank of one side holds its share (``kv_head_range``) of every group's heads."""
    for rank, layout in enumerate(layouts):
        for g in layout.groups:
            start, end = kv_head_range(tp, rank, heads[g.group_id])
            if layout.kv_heads(g.group_id) != end - start:
                raise ValueError(f"{g.label}: {side} rank {rank} of {tp} holds {layout.kv_heads(g.group_id)} "
                                 f"KV heads, its share of {heads[g.group_id]} is {end - start}")


def _check_state(ranks: Sequence[KVRank], identity: KVIdentity, remote: EngineDescription,
                 reads: list[dict[int, dict[int, RankRead]]]) -> None:
    """Both sides hold the same model's state group (the compat field covers its shape; this is the
    description's own), every rank on both sides registered its slots, and each local rank's state comes
    from owner ranks its KV ``reads`` already cover (one READ per pair carries both)."""
    local, theirs = identity.state, remote.state
    if local is None or theirs is None or local.with_tp(1) != theirs.with_tp(1):
        raise ValueError(f"state group: local {local.label if local else 'none'} vs remote "
                         f"{theirs.label if theirs else 'none'}")
    if theirs.tp_size != remote.tp_size or any(r.state_region is None for r in remote.ranks):
        raise ValueError(f"{local.label}: the owner's {remote.tp_size} ranks do not all announce state slots")
    if any(r.state_region is None for r in ranks):
        raise ValueError(f"{local.label}: a rank of this engine registered no state slots")
    for q, by_owner in enumerate(reads):
        owners = state_owner_ranks(theirs, local, q)
        if not set(owners) <= set(by_owner):
            raise ValueError(f"{local.label}: reading rank {q} needs state from owner ranks {owners}, its KV "
                             f"reads cover {sorted(by_owner)}")
