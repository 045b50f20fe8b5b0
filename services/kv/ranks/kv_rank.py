"""One TP rank's KV memory and NIXL agent, as the exporter (owner) and puller (reader) use it.

Every TP rank owns its KV shard and its own NIXL agent, and only the process that allocated a
buffer can register it. Rank 0 runs the daemon; ranks 1.. run in follower processes. The exporter
and puller therefore talk to each rank through this small interface: :class:`LocalKVRank` for a
rank in this process, and a proxy that forwards the same calls to a follower process
(``services.worker.follower_kv_rank``) for the others.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from services.kv.digest.runner import DigestRunner
from services.kv.digest.scheme import DigestJob, state_digest
from services.kv.nixl.agent import TransferAgent
from services.kv.nixl.descriptors import MemKind
from services.kv.plan.staging import SpanDtype
from services.kv.ranks.span_convert import dequantize_scatter, quantize_gather, span_digests
from services.kv.ranks.staging_area import StagingArea, gather, scatter
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.wire import MemoryRegion


class KVRank(Protocol):
    """What the KV library needs of one TP rank (its memory is registered once, at creation).

    ``name`` is the rank's NIXL agent name (peers name it in notifications); ``regions`` are the
    registered KV buffers, in layout-buffer order.
    """

    name: str
    layout: KVLayoutSpec
    regions: tuple[MemoryRegion, ...]
    # The rank's host KV tier, registered with the same agent (None and () without one).
    host_layout: KVLayoutSpec | None
    host_regions: tuple[MemoryRegion, ...]
    # A model with state layers: the rank's state slots ([slots, slot bytes]), registered with the same agent.
    state_region: MemoryRegion | None
    # The rank's KV staging area (``ranks.staging_area``), when it has one; only a rank in this process does.
    staging: StagingArea | None

    def metadata(self) -> bytes:
        """NIXL agent metadata for a peer (connection info and registered memory)."""
        ...

    def poll_notifications(self) -> dict[str, list[bytes]]:
        """Notifications since the last call: peer agent name -> messages."""
        ...

    def remove_peer(self, name: str) -> None:
        """Forget a peer agent (it restarted or was evicted) and abort reads from it."""
        ...

    async def read(self, peer_metadata: bytes, local_rows: np.ndarray, remote_rows: np.ndarray, notify: bytes,
                   remote_mem_kind: MemKind, timeout_s: float) -> tuple[int, int]:
        """READ ``remote_rows`` of the peer into ``local_rows`` of this rank; (bytes, descriptors).

        With no rows, only ``notify`` is sent (the reader already held every block). Raises
        ``TransferError`` (``TransferTimeout`` after ``timeout_s``).
        """
        ...

    async def digest(self, jobs: Sequence[DigestJob]) -> list[np.ndarray]:
        """Each job's unit digests over this rank's KV (``services.kv.digest.scheme``), computed on its device."""
        ...

    async def state_digest(self, slot: int, runs: Sequence[tuple[int, int, int]]) -> int:
        """The digest of runs of one state slot (``digest.scheme.state_digest``), computed where it lives."""
        ...


def register_rank(
    agent: TransferAgent, layout: KVLayoutSpec, buffers: Sequence[torch.Tensor]
) -> tuple[MemoryRegion, ...]:
    """Register a rank's KV buffers; returns them as wire regions (checked against the layout)."""
    expected = [b.num_bytes for b in layout.buffers()]
    got = [t.numel() * t.element_size() for t in buffers]
    if got != expected:
        raise ValueError(f"KV buffers of {got} bytes do not match the layout's {expected}")
    regions = agent.register(buffers)
    return tuple(MemoryRegion(i, r.addr, r.length, r.device_id, r.mem_kind) for i, r in enumerate(regions))


class LocalKVRank:
    """A rank whose KV buffers and agent live in this process; registers the buffers at once,
    and the host tier's (``host_layout``/``host_buffers``) when it has one, so a peer can read either.
    ``staging_bytes`` > 0: a staging area of that size beside the KV, registered too (``ranks.staging_area``)."""

    def __init__(self, agent: TransferAgent, layout: KVLayoutSpec, buffers: Sequence[torch.Tensor],
                 host_layout: KVLayoutSpec | None = None, host_buffers: Sequence[torch.Tensor] = (),
                 state_buffer: torch.Tensor | None = None, staging_bytes: int = 0) -> None:
        self.agent = agent
        self.name = agent.name
        self.layout = layout
        self.buffers = tuple(buffers)
        self.regions = register_rank(agent, layout, buffers)
        self.host_layout = host_layout
        self.host_buffers = tuple(host_buffers)
        self.host_regions = register_rank(agent, host_layout, host_buffers) if host_layout is not None else ()
        self._digests = DigestRunner(layout, self.buffers, host_layout, self.host_buffers)
        self.state_buffer = state_buffer
        self.state_region = None
        if state_buffer is not None:
            r = agent.register([state_buffer])[0]
            self.state_region = MemoryRegion(0, r.addr, r.length, r.device_id, r.mem_kind)
        self.staging = None
        if staging_bytes > 0:
            area = torch.empty(staging_bytes, dtype=torch.uint8, device=self.buffers[0].device)
            r = agent.register([area])[0]
            self.staging = StagingArea(area, MemoryRegion(0, r.addr, r.length, r.device_id, r.mem_kind),
                                       self._digests.stream)

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def poll_notifications(self) -> dict[str, list[bytes]]:
        return self.agent.poll_notifications()

    def remove_peer(self, name: str) -> None:
        self.agent.remove_peer(name)

    async def read(self, peer_metadata: bytes, local_rows: np.ndarray, remote_rows: np.ndarray, notify: bytes,
                   remote_mem_kind: MemKind, timeout_s: float) -> tuple[int, int]:
        peer = self.agent.add_peer(peer_metadata)
        if len(local_rows) == 0:
            self.agent.send_notification(peer, notify)
            return 0, 0
        result = await self.agent.read(peer, local_rows, remote_rows, notify, self.regions[0].kind,
                                       remote_mem_kind=remote_mem_kind, timeout_s=timeout_s)
        return result.num_bytes, result.num_descriptors

    async def digest(self, jobs: Sequence[DigestJob]) -> list[np.ndarray]:
        return await self._digests.digests(jobs)

    async def state_digest(self, slot: int, runs: Sequence[tuple[int, int, int]]) -> int:
        if self.state_buffer is None:
            raise ValueError(f"rank {self.name} holds no state slots")
        return await asyncio.to_thread(state_digest, self.state_buffer[slot], runs)

    async def gather(self, offset: int, block_ids: Sequence[np.ndarray], convert: SpanDtype | None = None) -> None:
        """Stage blocks (per group) into this rank's staging span at ``offset`` (``staging_area.gather``), done on
        return; ``convert``: quantized into that FP8 dtype with its scales (``span_convert.quantize_gather``)."""
        copy = gather if convert is None else functools.partial(quantize_gather, span=convert)
        await self._staging_copy(copy, offset, block_ids, settle=True)

    async def scatter(self, offset: int, block_ids: Sequence[np.ndarray], convert: SpanDtype | None = None) -> None:
        """The staged span at ``offset`` into blocks (per group) of this rank (``staging_area.scatter``; ``convert``:
        an FP8 span, dequantized, ``span_convert.dequantize_scatter``). On a GPU it is queued on the side stream this
        rank's digest shares, not waited for (``StagingArea.wait``)."""
        copy = scatter if convert is None else functools.partial(dequantize_scatter, span=convert)
        await self._staging_copy(copy, offset, block_ids, settle=False)

    async def span_digest(self, layout: KVLayoutSpec, offset: int, counts: Sequence[int],
                          jobs: Sequence[DigestJob]) -> list[np.ndarray]:
        """Digest jobs over this rank's staged span at ``offset`` (``counts[g]`` blocks per group of ``layout``)
        instead of its blocks (``span_convert.span_digests``): a converting pair's FP8 bytes."""
        staging = self._staging()
        staging.wait()  # what was queued on the side stream (a scatter, a READ's copy) is done
        if staging.stream is None:
            return await asyncio.to_thread(span_digests, layout, staging, offset, counts, jobs)
        with torch.cuda.stream(staging.stream):
            return span_digests(layout, staging, offset, counts, jobs)

    async def _staging_copy(self, copy, offset: int, block_ids: Sequence[np.ndarray], *,  # noqa: ANN001
                            settle: bool) -> None:
        """``copy`` (``gather`` or ``scatter``) between this rank's KV and its staging area: on a GPU queued on the
        side stream from here (and awaited when ``settle``), on CPU done in a worker thread."""
        staging = self._staging()
        if staging.stream is None:
            await asyncio.to_thread(staging.run, copy, self.layout, self.buffers, staging, offset, block_ids)
            return
        staging.enqueue(copy, self.layout, self.buffers, staging, offset, block_ids)
        if settle:
            await staging.settled()

    def _staging(self) -> StagingArea:
        if self.staging is None:
            raise ValueError(f"rank {self.name} has no staging area")
        return self.staging
