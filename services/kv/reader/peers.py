"""The reader's side of the KV handshake: :func:`fetch_description` (one ``Handshake`` call) and
:class:`PeerCache`, which handshakes on first contact with an engine and caches the answer (or the refusal) by
``(engine_id, epoch)``, so fresh tickets never meet stale metadata.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from services.common.tls import TLSConfig, open_channel
from services.kv.spec.compat import PROTOCOL_VERSION, CompatInfo
from services.kv.spec.description import (
    EngineDescription,
    HandshakeError,
    StaleTicketError,
    description_from_proto,
)
from services.kv.spec.kv_convert import check_pair
from services.proto_gen.pdserve.v1 import kv_pb2, kv_pb2_grpc


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
            check_pair(self._local, description.compat.fields, description.compat.hash)  # or a pair that converts
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
