"""The engine description both sides of the handshake share: what an owner announces (compatibility hash and
fields, KV-cache groups, per TP rank its NIXL agent, registered regions and layout, the epoch's ticket key) and its
one proto conversion, which refuses a description whose regions cannot hold its layouts.

The epoch changes whenever the owner restarts, so a ticket from a previous life of the engine never meets fresh
metadata: an epoch mismatch is a :class:`StaleTicketError`, not a read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.kv.spec.compat import PROTOCOL_VERSION, CompatInfo
from services.kv.spec.groups import KVCacheGroupSpec, StateGroupSpec
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.wire import (
    MemoryRegion,
    group_from_proto,
    group_to_proto,
    layout_from_proto,
    layout_to_proto,
    region_from_proto,
    region_to_proto,
    state_from_proto,
    state_to_proto,
)
from services.proto_gen.pdserve.v1 import kv_pb2


class HandshakeError(RuntimeError):
    """The handshake could not be completed (peer unreachable, refused, or inconsistent)."""


class StaleTicketError(HandshakeError):
    """The ticket names an epoch the owner no longer has: it restarted and the blocks are gone."""


@dataclass(frozen=True)
class RankExport:
    """One TP rank of an engine as a reader needs it."""

    tp_rank: int
    agent_name: str
    agent_metadata: bytes
    regions: tuple[MemoryRegion, ...]
    layout: KVLayoutSpec
    # The rank's host KV tier (services/engine/offload/), if it has one: the device layout with
    # more blocks, registered with the same agent.
    host_layout: KVLayoutSpec | None = None
    host_regions: tuple[MemoryRegion, ...] = ()
    # A model with state layers: the rank's state slots (``EngineDescription.state``'s slot layout).
    state_region: MemoryRegion | None = None
    # The rank's KV staging buffer (``services.kv.ranks.staging_area``), if it has one.
    staging_region: MemoryRegion | None = None


@dataclass(frozen=True)
class EngineDescription:
    """What ``Handshake`` carries, as typed values."""

    engine_id: str
    epoch: int
    model_name: str
    num_layers: int
    num_kv_heads: int  # model total, before TP
    head_dim: int
    compat: CompatInfo
    groups: tuple[KVCacheGroupSpec, ...]  # rank 0's layout groups: kind, window, layers, block size, shape
    ranks: tuple[RankExport, ...]
    kv_sharing: Mapping[int, int] = field(default_factory=dict)
    protocol_version: int = PROTOCOL_VERSION
    ticket_key: bytes = b""  # this epoch's ticket signing key (services/kv/spec/wire.py ticket_signature)
    state: StateGroupSpec | None = None  # the per-request state of a model with state layers
    num_state_slots: int = 0  # the owner's state slots (rows of each rank's state_region)

    @property
    def tp_size(self) -> int:
        return len(self.ranks)


def description_to_proto(d: EngineDescription) -> kv_pb2.HandshakeResponse:
    return kv_pb2.HandshakeResponse(
        protocol_version=d.protocol_version,
        engine_id=d.engine_id,
        epoch=d.epoch,
        compat_hash=d.compat.hash,
        compat_fields=dict(d.compat.fields),
        model_name=d.model_name,
        num_layers=d.num_layers,
        num_kv_heads=d.num_kv_heads,
        head_dim=d.head_dim,
        tp_size=d.tp_size,
        groups=[group_to_proto(g) for g in d.groups],
        kv_sharing=[kv_pb2.KVSharing(layer_id=k, source_layer_id=v) for k, v in sorted(d.kv_sharing.items())],
        ranks=[
            kv_pb2.RankInfo(
                tp_rank=r.tp_rank, agent_name=r.agent_name, agent_metadata=r.agent_metadata,
                regions=[region_to_proto(x) for x in r.regions], layout=layout_to_proto(r.layout),
                host_layout=layout_to_proto(r.host_layout) if r.host_layout is not None else None,
                host_regions=[region_to_proto(x) for x in r.host_regions],
                state_region=region_to_proto(r.state_region) if r.state_region is not None else None,
                staging_region=region_to_proto(r.staging_region) if r.staging_region is not None else None,
            )
            for r in d.ranks
        ],
        ticket_key=d.ticket_key,
        state=state_to_proto(d.state, d.num_state_slots) if d.state is not None else None,
    )


def description_from_proto(m: kv_pb2.HandshakeResponse) -> EngineDescription:
    """Decode and validate; a malformed answer is a HandshakeError naming what is wrong."""
    try:
        ranks = tuple(
            RankExport(r.tp_rank, r.agent_name, r.agent_metadata, tuple(region_from_proto(x) for x in r.regions),
                       layout_from_proto(r.layout),
                       layout_from_proto(r.host_layout) if r.HasField("host_layout") else None,
                       tuple(region_from_proto(x) for x in r.host_regions),
                       region_from_proto(r.state_region) if r.HasField("state_region") else None,
                       region_from_proto(r.staging_region) if r.HasField("staging_region") else None)
            for r in m.ranks
        )
        state, num_state_slots = state_from_proto(m.state) if m.HasField("state") else (None, 0)
        for r in ranks:
            _check_state_region(r, state, num_state_slots)
        if [r.tp_rank for r in ranks] != list(range(len(ranks))) or len(ranks) != m.tp_size or not ranks:
            raise ValueError(f"ranks {[r.tp_rank for r in ranks]} do not cover tp_size {m.tp_size}")
        groups = tuple(group_from_proto(g) for g in m.groups)
        for r in ranks:
            if r.layout.groups != groups:
                raise ValueError(f"rank {r.tp_rank}'s layout groups differ from the engine's KV groups")
            _check_regions(r.tp_rank, "", r.layout, r.regions)
            if r.host_layout is not None:
                if r.host_layout.groups != groups:
                    raise ValueError(f"rank {r.tp_rank}'s host tier layout groups differ from the engine's KV groups")
                _check_regions(r.tp_rank, "host tier ", r.host_layout, r.host_regions)
            elif r.host_regions:
                raise ValueError(f"rank {r.tp_rank} sends host tier regions without a host tier layout")
        return EngineDescription(
            engine_id=m.engine_id,
            epoch=m.epoch,
            model_name=m.model_name,
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            compat=CompatInfo(dict(m.compat_fields), m.compat_hash),
            groups=groups,
            ranks=ranks,
            kv_sharing={s.layer_id: s.source_layer_id for s in m.kv_sharing},
            protocol_version=m.protocol_version,
            ticket_key=m.ticket_key,
            state=state,
            num_state_slots=num_state_slots,
        )
    except ValueError as e:
        raise HandshakeError(f"malformed handshake from engine {m.engine_id!r}: {e}") from None


def _check_regions(rank: int, what: str, layout: KVLayoutSpec, regions: tuple[MemoryRegion, ...]) -> None:
    expected = [b.num_bytes for b in layout.buffers()]
    got = [x.length for x in sorted(regions, key=lambda x: x.buffer_index)]
    if got != expected:
        raise ValueError(f"rank {rank} registered {what}regions {got} do not match its {what}layout {expected}")


def _check_state_region(rank: RankExport, state: StateGroupSpec | None, num_slots: int) -> None:
    """A rank's state region holds exactly the engine's slots; none without a state group (whether every rank
    announces one is the reader's check, by name)."""
    if rank.state_region is None:
        return
    if state is None:
        raise ValueError(f"rank {rank.tp_rank} sends a state region without a state group")
    if rank.state_region.length != num_slots * state.slot_bytes:
        raise ValueError(f"rank {rank.tp_rank}'s state region of {rank.state_region.length} bytes does not hold "
                         f"{num_slots} slots of {state.slot_bytes}")
