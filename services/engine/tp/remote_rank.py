"""A follower rank's KV shard as the KV library sees it (``services.kv.rank.KVRank``).

The shard and its NIXL agent live in the follower process; this proxy holds what the agent
published when it opened (name, metadata, registered regions) and forwards reads and peer
removals over the group's pipe. Notifications the follower pushes are buffered here until the
exporter polls them, exactly as it polls rank 0's own agent.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

import numpy as np

from services.kv.agent import MemKind, TransferError, TransferTimeout
from services.kv.layout import KVLayoutSpec
from services.kv.wire import MemoryRegion

if TYPE_CHECKING:
    from services.engine.tp.group import TPGroup
    from services.engine.tp.messages import AgentOpened

# A follower enforces the read's own timeout; this margin only covers a follower that stopped answering.
REPLY_MARGIN_S = 10.0


class FollowerKVRank:
    def __init__(self, group: TPGroup, tp_rank: int, opened: AgentOpened, layout: KVLayoutSpec) -> None:
        expected = [b.num_bytes for b in layout.buffers()]
        got = [r.length for r in opened.regions]
        if got != expected:
            raise ValueError(f"TP rank {tp_rank} registered KV buffers of {got} bytes, the layout has {expected}")
        self._group = group
        self.tp_rank = tp_rank
        self.name = opened.name
        self.layout = layout
        self.host_layout = None  # host KV tiers run at TP 1 only (EngineConfig)
        self.host_regions = ()
        self.regions = tuple(MemoryRegion(i, r.address, r.length, r.device_id, r.kind)
                             for i, r in enumerate(opened.regions))
        self._metadata = opened.metadata
        self._notes: dict[str, list[bytes]] = {}
        self._notes_lock = threading.Lock()

    def metadata(self) -> bytes:
        return self._metadata

    def deliver(self, by_peer: dict[str, list[bytes]]) -> None:
        """Notifications the follower pushed (called on the group's pipe thread)."""
        with self._notes_lock:
            for peer, messages in by_peer.items():
                self._notes.setdefault(peer, []).extend(messages)

    def poll_notifications(self) -> dict[str, list[bytes]]:
        with self._notes_lock:
            notes, self._notes = self._notes, {}
        return notes

    def remove_peer(self, name: str) -> None:
        self._group.remove_peer(self.tp_rank, name)

    async def read(self, peer_metadata: bytes, local_rows: np.ndarray, remote_rows: np.ndarray, notify: bytes,
                   remote_mem_kind: MemKind, timeout_s: float) -> tuple[int, int]:
        future = self._group.read(self.tp_rank, dict(
            peer_metadata=peer_metadata, local_rows=np.ascontiguousarray(local_rows, dtype=np.uint64).tobytes(),
            remote_rows=np.ascontiguousarray(remote_rows, dtype=np.uint64).tobytes(), notify=notify,
            remote_mem_kind=remote_mem_kind, timeout_s=timeout_s))
        try:
            done = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s + REPLY_MARGIN_S)
        except TimeoutError:
            raise TransferTimeout(f"TP rank {self.tp_rank} did not answer a READ within {timeout_s:.1f} s",
                                  aborted=False) from None
        except RuntimeError as e:  # TPGroupError: the rank is gone
            raise TransferError(f"TP rank {self.tp_rank}: {e}") from None
        if done.timed_out:
            raise TransferTimeout(f"TP rank {self.tp_rank}: {done.error}", aborted=done.aborted)
        if done.error:
            raise TransferError(f"TP rank {self.tp_rank}: {done.error}")
        return done.num_bytes, done.num_descriptors
