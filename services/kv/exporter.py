"""Owner (prefill) side of KV transfer: publish the engine, hand out tickets, free on notification.

Each TP rank registers its KV buffers with its own NIXL agent. A ticket is handed out with the
reader's TP size, so the owner knows how many reading ranks will notify each of its ranks
(``readers_per_remote_rank``); the request's blocks are released once every owner rank has heard
from all of its readers, or when the lease expires.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from services.kv.agent import NotificationTracker, TransferAgent
from services.kv.compat import CompatInfo, compat_fields
from services.kv.handshake import EngineDescription, RankExport
from services.kv.layout import KVLayoutSpec
from services.kv.topology import readers_per_remote_rank
from services.kv.wire import MemoryRegion
from services.proto_gen.pdserve.v1 import kv_pb2


@dataclass(frozen=True)
class OwnerRank:
    """One TP rank's agent and the KV buffers it owns, in layout-buffer order."""

    agent: TransferAgent
    layout: KVLayoutSpec
    buffers: Sequence[torch.Tensor]


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


class KVExporter:
    def __init__(
        self,
        *,
        engine_id: str,
        model_name: str,
        architecture: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        ranks: Sequence[OwnerRank],
        kv_sharing: Mapping[int, int] | None = None,
        epoch: int | None = None,
        group_kv_heads: Mapping[int, int] | None = None,
    ) -> None:
        """``num_kv_heads``/``head_dim`` are the model's; ``group_kv_heads`` maps KV group id -> the
        model's total KV heads of that group (hybrids whose groups differ in heads; see compat.py)."""
        if not ranks:
            raise ValueError("an engine has at least one TP rank")
        self.engine_id = engine_id
        self.epoch = epoch if epoch is not None else time.time_ns()
        self.num_kv_heads = num_kv_heads
        self._ranks = list(ranks)
        self._regions = [register_rank(r.agent, r.layout, r.buffers) for r in ranks]
        layout = ranks[0].layout
        self.compat = CompatInfo.of(compat_fields(
            architecture=architecture, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            layout=layout, kv_sharing=kv_sharing, group_kv_heads=group_kv_heads,
        ))
        self._description = EngineDescription(
            engine_id=engine_id, epoch=self.epoch, model_name=model_name, num_layers=num_layers,
            num_kv_heads=num_kv_heads, head_dim=head_dim, compat=self.compat, groups=layout.groups,
            ranks=tuple(
                RankExport(i, r.agent.name, r.agent.metadata(), self._regions[i], r.layout)
                for i, r in enumerate(ranks)
            ),
            kv_sharing=dict(kv_sharing or {}),
        )
        self._trackers = [NotificationTracker() for _ in ranks]
        self._waiting: dict[str, set[int]] = {}  # request id -> owner ranks still expecting readers

    @property
    def tp_size(self) -> int:
        return len(self._ranks)

    def describe(self) -> EngineDescription:
        return self._description

    def hand_out(
        self,
        request_id: str,
        block_ids: Sequence[Sequence[int]],
        *,
        num_tokens: int,
        first_token_id: int,
        handshake_address: str,
        reader_tp_size: int,
        first_token_logprob: float = 0.0,
    ) -> kv_pb2.TransferTicket:
        """The ticket for a finished prefill whose blocks stay pinned until read (or the lease ends)."""
        if request_id in self._waiting:
            raise ValueError(f"request {request_id!r} already has a ticket out")
        readers = readers_per_remote_rank(reader_tp_size, self.tp_size, self.num_kv_heads)
        waiting = set()
        for rank, n in enumerate(readers):
            if n:
                self._trackers[rank].expect(request_id.encode(), n)
                waiting.add(rank)
        self._waiting[request_id] = waiting
        return kv_pb2.TransferTicket(
            engine_id=self.engine_id, epoch=self.epoch, request_id=request_id,
            groups=[kv_pb2.GroupBlocks(group_id=g, block_ids=list(ids)) for g, ids in enumerate(block_ids)],
            num_tokens=num_tokens, first_token_id=first_token_id, first_token_logprob=first_token_logprob,
            handshake_address=handshake_address,
        )

    def poll_released(self) -> list[str]:
        """Request ids every reader has finished with: their blocks can be freed now."""
        for rank, r in enumerate(self._ranks):
            for key in self._trackers[rank].feed(r.agent.poll_notifications()):
                self._waiting.get(key.decode(), set()).discard(rank)
        done = [rid for rid, ranks in self._waiting.items() if not ranks]
        for rid in done:
            del self._waiting[rid]
        return done

    def expire(self, lease_s: float) -> list[str]:
        """Request ids whose readers did not all finish within ``lease_s``: freed by the lease."""
        expired: set[str] = set()
        for tracker in self._trackers:
            expired.update(k.decode() for k in tracker.expire(lease_s))
        for rid in expired:
            self.abandon(rid)
        return sorted(expired)

    def abandon(self, request_id: str) -> bool:
        """Stop waiting for a request's readers (it was aborted or its lease ran out)."""
        for tracker in self._trackers:
            tracker.discard(request_id.encode())
        return self._waiting.pop(request_id, None) is not None

    @property
    def num_outstanding(self) -> int:
        return len(self._waiting)
