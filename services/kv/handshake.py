"""The KV handshake over gRPC (grpc.aio): the owner describes its engine, the reader caches it.

Owner side: :class:`HandshakeServicer` answers ``Handshake`` with an :class:`EngineDescription`
(compatibility hash and fields, layout and registered regions per TP rank, NIXL agent metadata).
Agent metadata makes registered memory readable, so it is only handed to a peer that presents
the shared token when one is set.

Reader side: :class:`PeerCache` handshakes on first contact with an engine and caches the answer
by ``(engine_id, epoch)``. The epoch changes whenever the owner restarts, so a ticket from a
previous life of the engine never meets fresh metadata, and fresh tickets never meet stale
metadata: an epoch mismatch is a :class:`StaleTicketError`, not a read.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from services.common.tls import TLSConfig, open_channel
from services.kv.compat import PROTOCOL_VERSION, CompatInfo, check_compatible
from services.kv.groups import KVCacheGroupSpec, StateGroupSpec
from services.kv.layout import KVLayoutSpec
from services.kv.wire import (
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
from services.proto_gen.pdserve.v1 import kv_pb2, kv_pb2_grpc


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
    # The rank's KV staging buffer (``services.kv.staging``), if it has one.
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
    ticket_key: bytes = b""  # this epoch's ticket signing key (services/kv/wire.py ticket_signature)
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


# A HandshakeRequest is a version, an engine id and the token: a few hundred bytes. The handshake is open to every
# caller (the token is checked inside the request), so a bigger body is refused before it is parsed.
MAX_HANDSHAKE_REQUEST_BYTES = 64 * 1024
HANDSHAKE_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KVHandshake"].full_name


def bounded_handshake_request(data: bytes) -> kv_pb2.HandshakeRequest | None:
    """The handshake's request deserializer: ``None`` (refused unread) for a body over
    ``MAX_HANDSHAKE_REQUEST_BYTES``, so a stranger cannot make the owner parse megabytes."""
    if len(data) > MAX_HANDSHAKE_REQUEST_BYTES:
        return None
    return kv_pb2.HandshakeRequest.FromString(data)


class HandshakeServicer(kv_pb2_grpc.KVHandshakeServicer):
    """Thin servicer: check size, version and token, then describe the engine."""

    def __init__(self, describe: Callable[[], EngineDescription], auth_token: str | None = None) -> None:
        self._describe = describe
        self._token = auth_token

    async def Handshake(self, request: kv_pb2.HandshakeRequest | None,  # noqa: N802
                        context: grpc.aio.ServicerContext):
        if request is None:  # bounded_handshake_request refused it unread
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"handshake request over {MAX_HANDSHAKE_REQUEST_BYTES} bytes")
        if request.protocol_version != PROTOCOL_VERSION:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} is not supported (this engine speaks {PROTOCOL_VERSION})",
            )
        if self._token and not hmac.compare_digest(request.auth_token.encode(), self._token.encode()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "handshake refused: missing or wrong auth token")
        return description_to_proto(self._describe())


def add_handshake_service(server: grpc.aio.Server, servicer: HandshakeServicer) -> None:
    """The generated registration, with ``bounded_handshake_request`` as the request deserializer."""
    handlers = {"Handshake": grpc.unary_unary_rpc_method_handler(
        servicer.Handshake, request_deserializer=bounded_handshake_request,
        response_serializer=kv_pb2.HandshakeResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(HANDSHAKE_SERVICE, handlers),))
    server.add_registered_method_handlers(HANDSHAKE_SERVICE, handlers)


async def fetch_description(
    address: str, *, reader_engine_id: str, auth_token: str | None = None, timeout_s: float = 5.0,
    tls: TLSConfig | None = None,
) -> EngineDescription:
    """One Handshake call to ``address`` (host:port)."""
    request = kv_pb2.HandshakeRequest(
        protocol_version=PROTOCOL_VERSION, reader_engine_id=reader_engine_id, auth_token=auth_token or ""
    )
    async with open_channel(address, tls) as channel:
        try:
            response = await kv_pb2_grpc.KVHandshakeStub(channel).Handshake(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise HandshakeError(f"handshake with {address} failed: {e.code().name}: {e.details()}") from None
    return description_from_proto(response)


class PeerCache:
    """Engine descriptions by ``(engine_id, epoch)``, fetched once, validated once.

    ``validate`` runs on every new description (compatibility, then e.g. topology checks) and
    its error is cached too, so an incompatible peer is refused without a handshake storm.
    ``on_evict`` is called with a description that a newer epoch of the same engine replaced
    (the caller drops that epoch's NIXL peers).
    """

    def __init__(
        self,
        local: CompatInfo,
        *,
        reader_engine_id: str,
        auth_token: str | None = None,
        timeout_s: float = 5.0,
        validate: Callable[[EngineDescription], None] | None = None,
        on_evict: Callable[[EngineDescription], None] | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self._local = local
        self._tls = tls
        self._reader_engine_id = reader_engine_id
        self._token = auth_token
        self._timeout_s = timeout_s
        self._validate = validate
        self._on_evict = on_evict
        self._entries: dict[tuple[str, int], EngineDescription | Exception] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.num_handshakes = 0

    def cached(self, engine_id: str, epoch: int) -> EngineDescription | None:
        entry = self._entries.get((engine_id, epoch))
        return entry if isinstance(entry, EngineDescription) else None

    async def get(self, address: str, engine_id: str, epoch: int) -> EngineDescription:
        """The description of ``engine_id`` at ``epoch``, handshaking with ``address`` if needed."""
        lock = self._locks.setdefault(engine_id, asyncio.Lock())
        async with lock:
            entry = self._entries.get((engine_id, epoch))
            if entry is None:
                entry = await self._handshake(address, engine_id)
                if isinstance(entry, EngineDescription) and entry.epoch != epoch:
                    raise StaleTicketError(
                        f"engine {engine_id} is at epoch {entry.epoch}; the ticket's epoch {epoch} is gone"
                    )
        if isinstance(entry, Exception):
            raise entry
        return entry

    async def _handshake(self, address: str, engine_id: str) -> EngineDescription | Exception:
        self.num_handshakes += 1
        description = await fetch_description(
            address, reader_engine_id=self._reader_engine_id, auth_token=self._token, timeout_s=self._timeout_s,
            tls=self._tls,
        )
        if description.engine_id != engine_id:
            raise HandshakeError(f"{address} serves engine {description.engine_id!r}, not {engine_id!r}")
        key = (engine_id, description.epoch)
        try:
            check_compatible(self._local, description.compat.fields, description.compat.hash)
            if self._validate is not None:
                self._validate(description)
            entry: EngineDescription | Exception = description
        except ValueError as e:
            entry = e
        self._evict_other_epochs(engine_id, description.epoch)
        self._entries[key] = entry
        return entry

    def _evict_other_epochs(self, engine_id: str, epoch: int) -> None:
        for key in [k for k in self._entries if k[0] == engine_id and k[1] != epoch]:
            old = self._entries.pop(key)
            if isinstance(old, EngineDescription) and self._on_evict is not None:
                self._on_evict(old)

    def forget(self, engine_id: str) -> None:
        """Drop every epoch of an engine (e.g. its transfers keep failing)."""
        for key in [k for k in self._entries if k[0] == engine_id]:
            old = self._entries.pop(key)
            if isinstance(old, EngineDescription) and self._on_evict is not None:
                self._on_evict(old)
