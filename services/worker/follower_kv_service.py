"""A follower TP rank's KV-transfer service: its NIXL agent over the rank's KV shard.

Installed by rank 0's worker layer (``TPGroup.install_rank_service``) and built in the follower
process, it handles the messages that are not steps: ``OpenAgent`` registers the shard with a new
agent, ``Read`` pulls into it and ``Digest`` checksums it on a transfer thread (beside the steps,
like rank 0's pulls run beside its engine thread), ``RemovePeer`` forgets a peer; NIXL notifications
for the agent are pushed to rank 0 as they come. Rank 0 sees the rank through
``follower_kv_rank.FollowerKVRank``.
"""

from __future__ import annotations

import asyncio
import threading

import msgspec
import numpy as np

from services.engine.tp import messages as m
from services.engine.tp.rank_service import RankContext
from services.kv.digest import DigestJob
from services.kv.nixl.agent import TransferAgent
from services.kv.nixl.errors import TransferTimeout
from services.kv.rank import LocalKVRank

NOTIFICATION_POLL_S = 0.002


class FollowerKVService:
    """A ``rank_service.RankService``; the class itself is the factory the follower builds it with."""

    def __init__(self, context: RankContext) -> None:
        self._context = context
        self.kv_rank: LocalKVRank | None = None
        self._loop = asyncio.new_event_loop()
        self._transfers = threading.Thread(target=self._loop.run_forever, name="tp-transfers", daemon=True)
        self._transfers.start()

    def handle(self, message: m.ToService) -> None:
        if isinstance(message, m.Read):
            asyncio.run_coroutine_threadsafe(self._read(message), self._loop)
        elif isinstance(message, m.Digest | m.StateDigest):
            asyncio.run_coroutine_threadsafe(self._digest(message), self._loop)
        elif isinstance(message, m.OpenAgent):
            self._open_agent(message.name)
        elif isinstance(message, m.RemovePeer) and self.kv_rank is not None:
            self._loop.call_soon_threadsafe(self.kv_rank.remove_peer, message.name)

    def close(self) -> None:
        if self._transfers.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._transfers.join(5)
        if self.kv_rank is not None:
            self.kv_rank.agent.close()

    def _open_agent(self, name: str) -> None:
        ctx = self._context
        agent = TransferAgent(name, device=ctx.device.type)
        self.kv_rank = LocalKVRank(agent, ctx.kv_layout, ctx.kv_cache.buffers, state_buffer=ctx.state_buffer)
        regions = [m.Region(r.address, r.length, r.device_id, r.kind) for r in self.kv_rank.regions]
        state = self.kv_rank.state_region
        state_region = m.Region(state.address, state.length, state.device_id, state.kind) if state else None
        ctx.send(m.AgentOpened(name, agent.metadata(), regions, state_region))
        asyncio.run_coroutine_threadsafe(self._push_notifications(), self._loop)

    async def _read(self, message: m.Read) -> None:
        try:
            if self.kv_rank is None:
                raise RuntimeError("no NIXL agent open on this rank")
            local = np.frombuffer(message.local_rows, dtype=np.uint64).reshape(-1, 3)
            remote = np.frombuffer(message.remote_rows, dtype=np.uint64).reshape(-1, 3)
            num_bytes, num_descriptors = await self.kv_rank.read(
                message.peer_metadata, local, remote, message.notify, message.remote_mem_kind, message.timeout_s)
            reply = m.ReadDone(message.id, num_bytes, num_descriptors)
        except TransferTimeout as e:
            reply = m.ReadDone(message.id, error=str(e), timed_out=True, aborted=e.aborted)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the reader as an error
            reply = m.ReadDone(message.id, error=f"{type(e).__name__}: {e}")
        self._context.send(reply)

    async def _digest(self, message: m.Digest | m.StateDigest) -> None:
        try:
            if self.kv_rank is None:
                raise RuntimeError("no NIXL agent open on this rank")
            if isinstance(message, m.StateDigest):
                units = [np.array([await self.kv_rank.state_digest(message.slot, message.runs)], dtype=np.uint64)]
            else:
                units = await self.kv_rank.digest(msgspec.msgpack.decode(message.jobs, type=list[DigestJob]))
            reply = m.DigestDone(message.id, [u.tobytes() for u in units])
        except Exception as e:  # noqa: BLE001 - every failure goes back to rank 0 as an error
            reply = m.DigestDone(message.id, error=f"{type(e).__name__}: {e}")
        self._context.send(reply)

    async def _push_notifications(self) -> None:
        while True:
            notes = self.kv_rank.poll_notifications()
            if notes:
                self._context.send(m.Notifications(notes))
            await asyncio.sleep(NOTIFICATION_POLL_S)
