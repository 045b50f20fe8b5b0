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
import time

import msgspec
import numpy as np

from services.engine.tp import messages as m
from services.engine.tp.rank_service import RankContext
from services.kv.digest.scheme import DigestJob
from services.kv.nixl.agent import TransferAgent
from services.kv.nixl.errors import TransferTimeout
from services.kv.ranks.kv_rank import LocalKVRank

NOTIFICATION_POLL_S = 0.002  # while transfers may be under way
# Once the rank saw no transfer for IDLE_AFTER_S: an idle rank's polling cost ~8% of a CPU core at 2 ms (measured:
# a TP-2 decode worker on CPU, 0.76 s of CPU time in 10 s idle), ~1% at 50 ms. A ticket's digest or a pull wakes
# it, before any reader can notify (with the digest off, a first notification waits up to 50 ms: blocks are freed
# that much later, nothing more).
IDLE_POLL_S = 0.05
IDLE_AFTER_S = 2.0


def notification_poll_s(now: float, active_at: float) -> float:
    """How long the notification loop sleeps: briefly while transfers may be under way, longer once idle."""
    return IDLE_POLL_S if now - active_at > IDLE_AFTER_S else NOTIFICATION_POLL_S


class FollowerKVService:
    """A ``rank_service.RankService``; the class itself is the factory the follower builds it with."""

    def __init__(self, context: RankContext) -> None:
        self._context = context
        self.kv_rank: LocalKVRank | None = None
        self._active_at = time.monotonic()  # the last pull, digest or notification (a float: read across threads)
        self._loop = asyncio.new_event_loop()
        self._transfers = threading.Thread(target=self._loop.run_forever, name="tp-transfers", daemon=True)
        self._transfers.start()

    def handle(self, message: m.ToService) -> None:
        if isinstance(message, m.Read):
            self._active_at = time.monotonic()
            asyncio.run_coroutine_threadsafe(self._read(message), self._loop)
        elif isinstance(message, m.Digest | m.StateDigest):  # a ticket: its reader's notification follows
            self._active_at = time.monotonic()
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
            now = time.monotonic()
            if notes:
                self._active_at = now
                self._context.send(m.Notifications(notes))
            await asyncio.sleep(notification_poll_s(now, self._active_at))
