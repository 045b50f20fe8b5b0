"""Rank 0's view of the follower ranks' KV shards, as the KV library sees them (``KVRank``).

Each shard and its NIXL agent live in a follower process, run by the service this module installs
there (``follower_kv_service.FollowerKVService``). ``FollowerKVRanks`` opens their agents and routes
their answers, which the TP group hands it from the pipes: a ``FollowerKVRank`` proxy per rank holds
what its agent published when it opened (name, metadata, registered regions), forwards reads and
peer removals over the group's pipe, and buffers the notifications the follower pushes until the
exporter polls them, exactly as it polls rank 0's own agent. A failed group fails every pending
read at once.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec
import numpy as np

from services.engine.tp import messages as m
from services.engine.tp.group import TPGroup, TPGroupError
from services.kv.digest.scheme import DigestJob
from services.kv.nixl.descriptors import MemKind
from services.kv.nixl.errors import TransferError, TransferTimeout
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.wire import MemoryRegion
from services.worker.follower_kv_service import FollowerKVService

REPLY_TIMEOUT_S = 60.0
# A follower enforces the read's own timeout; this margin only covers a follower that stopped answering.
REPLY_MARGIN_S = 10.0


class FollowerKVRanks:
    """The followers' KV ranks (1..tp-1) of one TP group, and the routing of their answers."""

    def __init__(self, group: TPGroup) -> None:
        self._group = group
        self._lock = threading.Lock()
        self._opened: dict[int, Future[m.AgentOpened]] = {}
        self._reads: dict[int, Future] = {}  # read or digest id -> its answer
        self._read_ids = itertools.count()
        self._ranks: dict[int, FollowerKVRank] = {}
        group.on_message(self._route)
        group.on_failure(self._fail_pending)

    def open(self, agent_name: Callable[[int], str], layout: KVLayoutSpec) -> list[FollowerKVRank]:
        """Have every follower open its NIXL agent and register its KV shard; their KV ranks, 1..tp-1."""
        group = self._group
        group.install_rank_service(FollowerKVService)
        for rank in group.follower_ranks:
            with self._lock:
                self._opened[rank] = Future()
            group.send(rank, m.OpenAgent(agent_name(rank)))
        ranks = []
        for rank in group.follower_ranks:
            try:
                opened = self._opened[rank].result(timeout=REPLY_TIMEOUT_S)
            except FutureTimeout:
                raise TPGroupError(f"TP rank {rank} sent no AgentOpened within {REPLY_TIMEOUT_S:.0f} s") from None
            self._ranks[rank] = FollowerKVRank(self, rank, opened, layout)
            ranks.append(self._ranks[rank])
        return ranks

    def request(self, rank: int, message: m.Read | m.Digest | m.StateDigest) -> Future:
        """Send ``message`` to ``rank`` under a new id; the future resolves with its answer (``ReadDone`` or
        ``DigestDone``), or TPGroupError."""
        future: Future = Future()
        message = msgspec.structs.replace(message, id=next(self._read_ids))
        with self._lock:
            if self._group.failure is not None:
                future.set_exception(TPGroupError(self._group.failure))
                return future
            self._reads[message.id] = future
        try:
            self._group.send(rank, message)
        except TPGroupError as e:
            with self._lock:
                self._reads.pop(message.id, None)
            future.set_exception(e)
        return future

    def remove_peer(self, rank: int, name: str) -> None:
        if self._group.failure is None:
            self._group.send(rank, m.RemovePeer(name))

    def _route(self, rank: int, message: m.FromService) -> None:
        """A follower's answer (on its pipe thread)."""
        if isinstance(message, m.ReadDone | m.DigestDone):
            with self._lock:
                future = self._reads.pop(message.id, None)
            if future is not None:
                future.set_result(message)
        elif isinstance(message, m.Notifications):
            kv_rank = self._ranks.get(rank)
            if kv_rank is not None:
                kv_rank.deliver(message.by_peer)
        elif isinstance(message, m.AgentOpened):
            with self._lock:
                future = self._opened.get(rank)
            if future is not None and not future.done():
                future.set_result(message)

    def _fail_pending(self, reason: str) -> None:
        """The group failed: every read and agent opening still waiting fails now."""
        with self._lock:
            pending = [*self._reads.values(), *self._opened.values()]
            self._reads = {}
        for future in pending:
            if not future.done():
                future.set_exception(TPGroupError(reason))


class FollowerKVRank:
    """One follower rank's KV shard (a ``services.kv.ranks.kv_rank.KVRank``) behind the group's pipe."""

    def __init__(self, link: FollowerKVRanks, tp_rank: int, opened: m.AgentOpened, layout: KVLayoutSpec) -> None:
        expected = [b.num_bytes for b in layout.buffers()]
        got = [r.length for r in opened.regions]
        if got != expected:
            raise ValueError(f"TP rank {tp_rank} registered KV buffers of {got} bytes, the layout has {expected}")
        self._link = link
        self.tp_rank = tp_rank
        self.name = opened.name
        self.layout = layout
        self.host_layout = None  # host KV tiers run at TP 1 only (EngineConfig)
        self.host_regions = ()
        self.staging = None  # KV staging gathers and scatters where the KV is: ranks in this process only
        state = opened.state_region
        self.state_region = MemoryRegion(0, state.address, state.length, state.device_id, state.kind) \
            if state is not None else None
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
        self._link.remove_peer(self.tp_rank, name)

    async def read(self, peer_metadata: bytes, local_rows: np.ndarray, remote_rows: np.ndarray, notify: bytes,
                   remote_mem_kind: MemKind, timeout_s: float) -> tuple[int, int]:
        future = self._link.request(self.tp_rank, m.Read(
            id=0, peer_metadata=peer_metadata,
            local_rows=np.ascontiguousarray(local_rows, dtype=np.uint64).tobytes(),
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

    async def digest(self, jobs: Sequence[DigestJob]) -> list[np.ndarray]:
        units = await self._answer(m.Digest(id=0, jobs=msgspec.msgpack.encode(list(jobs), enc_hook=_array_as_list)),
                                   "KV digest")
        return [np.frombuffer(u, dtype=np.uint64) for u in units]

    async def _answer(self, message: m.Digest | m.StateDigest, what: str) -> list[bytes]:
        """The units of a digest request's answer; TransferError when the rank fails, is gone or is silent."""
        future = self._link.request(self.tp_rank, message)
        try:
            done = await asyncio.wait_for(asyncio.wrap_future(future), REPLY_TIMEOUT_S)
        except TimeoutError:
            raise TransferError(f"TP rank {self.tp_rank} did not answer a {what} within {REPLY_TIMEOUT_S:.0f} s"
                                ) from None
        except RuntimeError as e:  # TPGroupError: the rank is gone
            raise TransferError(f"TP rank {self.tp_rank}: {e}") from None
        if done.error:
            raise TransferError(f"TP rank {self.tp_rank}: {what} failed: {done.error}")
        return done.units

    async def state_digest(self, slot: int, runs: Sequence[tuple[int, int, int]]) -> int:
        (units,) = await self._answer(m.StateDigest(id=0, slot=slot, runs=[tuple(r) for r in runs]), "state digest")
        return int(np.frombuffer(units, dtype=np.uint64)[0])


def _array_as_list(value: object) -> object:
    """msgspec's hook for what it cannot encode itself: a job's block ids as the reader's int array."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")
