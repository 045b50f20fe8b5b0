"""A KV event source for router app tests whose workers are fakes: subscribed to, it never says anything."""

from __future__ import annotations

import asyncio

from services.proto_gen.pdserve.v1 import worker_pb2
from services.router.pairing import Role


class _SilentCall:
    async def read(self) -> worker_pb2.KVEventBatch:
        await asyncio.Event().wait()  # until cancelled
        raise AssertionError("unreachable")

    def cancel(self) -> bool:
        return True


class SilentKVSource:
    """Every worker's stream stays open and empty (no channel opened), so the app contacts no worker."""

    def __init__(self) -> None:
        self.subscribed: list[tuple[Role, str]] = []

    def kv_events(self, role: Role, address: str) -> _SilentCall:
        self.subscribed.append((role, address))
        return _SilentCall()

    async def kv_snapshot(self, role: Role, address: str, timeout_s: float) -> worker_pb2.KVSnapshotResponse:
        raise AssertionError("a silent stream never reaches the snapshot")
