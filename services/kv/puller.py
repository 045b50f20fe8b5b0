"""Reader (decode) side of KV transfer: ticket -> handshake (cached) -> plan -> NIXL READs.

For each local TP rank, ``rank_reads`` says which remote ranks and head slices it needs; for each
KV group, ``map_blocks`` turns the ticket's remote block ids and the reader's own block ids into
token runs (skipping the prefix the reader already holds and, for sliding-window groups, blocks
outside the window); the planner turns those into the fewest descriptors. Each READ carries the
request id as its notification, so the owner can count its readers and free the blocks.

A ticket is untrusted input: its groups, block ids and token count are checked against the
owner's handshake before anything is planned, and descriptors are only ever computed from the
layout specs, so a forged ticket cannot point a READ outside the owner's registered KV buffers
or the reader's own blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.kv.agent import TransferAgent, TransferError
from services.kv.compat import CompatInfo
from services.kv.exporter import register_rank
from services.kv.handshake import EngineDescription, PeerCache
from services.kv.layout import KVLayoutSpec
from services.kv.planner import TransferPlan, plan_groups
from services.kv.topology import BlockPiece, map_blocks, rank_reads, window_start_token
from services.proto_gen.pdserve.v1 import kv_pb2


class TicketError(ValueError):
    """The ticket does not fit the owner's engine (forged, truncated or from another model)."""


@dataclass(frozen=True)
class ReaderRank:
    agent: TransferAgent
    layout: KVLayoutSpec
    buffers: Sequence[torch.Tensor]


@dataclass(frozen=True)
class PullResult:
    num_bytes: int
    num_descriptors: int
    num_reads: int
    seconds: float


class KVPuller:
    def __init__(
        self,
        *,
        engine_id: str,
        compat: CompatInfo,
        num_kv_heads: int,
        ranks: Sequence[ReaderRank],
        auth_token: str | None = None,
        handshake_timeout_s: float = 5.0,
        transfer_timeout_s: float = 30.0,
    ) -> None:
        self.engine_id = engine_id
        self.num_kv_heads = num_kv_heads
        self._ranks = list(ranks)
        self._regions = [register_rank(r.agent, r.layout, r.buffers) for r in ranks]
        self._mem_kind = self._regions[0][0].kind
        self.transfer_timeout_s = transfer_timeout_s
        self.peers = PeerCache(
            compat, reader_engine_id=engine_id, auth_token=auth_token, timeout_s=handshake_timeout_s,
            validate=self._check_topology, on_evict=self._drop_peers,
        )

    @property
    def tp_size(self) -> int:
        return len(self._ranks)

    # ---- handshake-time checks -----------------------------------------------------------------
    def _check_topology(self, remote: EngineDescription) -> None:
        """Refuse a pair we could never transfer between (TP or block-size mismatch)."""
        for rank in range(self.tp_size):
            rank_reads(self.tp_size, rank, remote.tp_size, self.num_kv_heads)
        local_groups = self._ranks[0].layout.groups
        if len(local_groups) != len(remote.groups):
            raise ValueError(f"remote has {len(remote.groups)} KV groups, local {len(local_groups)}")
        for lg, rg in zip(local_groups, remote.groups, strict=True):
            small, large = sorted((lg.block_size, rg.block_size))
            if large % small:
                raise ValueError(
                    f"KV group {lg.group_id}: block sizes {rg.block_size} (remote) and {lg.block_size} (local) "
                    "do not divide each other"
                )

    def _drop_peers(self, old: EngineDescription) -> None:
        for r in self._ranks:
            for remote_rank in old.ranks:
                r.agent.remove_peer(remote_rank.agent_name)

    # ---- pulling -------------------------------------------------------------------------------
    async def pull(
        self, ticket: kv_pb2.TransferTicket, local_block_ids: Sequence[Sequence[int]], num_cached_tokens: int = 0
    ) -> PullResult:
        """Fill the local blocks with the ticket's KV (all local ranks, concurrently).

        ``local_block_ids[g]`` is the reader's block table for group g from token 0;
        ``num_cached_tokens`` (a local block boundary) were already in the reader's prefix cache.
        """
        started = time.perf_counter()
        remote = await self.peers.get(ticket.handshake_address, ticket.engine_id, ticket.epoch)
        remote_ids = self._check_ticket(ticket, remote, local_block_ids)
        # Every local rank shares the block tables, so the token runs are the same for all of them.
        pieces = self._pieces(remote, self._ranks[0].layout, ticket.num_tokens, remote_ids, local_block_ids,
                              num_cached_tokens)
        reads = []
        for local_rank, rank in enumerate(self._ranks):
            for read in rank_reads(self.tp_size, local_rank, remote.tp_size, self.num_kv_heads):
                owner = remote.ranks[read.remote_rank]
                peer = rank.agent.add_peer(owner.agent_metadata)
                # The last block is this request's own (partial blocks are never shared), and decode
                # overwrites the slots past the prompt before reading them: padding it costs no
                # extra descriptors for the stale tail bytes it copies.
                plan = plan_groups(owner.layout, rank.layout, pieces, read, pad_partial_blocks=True)
                reads.append(self._read(rank.agent, peer, plan, owner, local_rank, ticket.request_id.encode()))
        try:
            results = await asyncio.gather(*reads)
        except TransferError:
            # The owner may have restarted (its old agents are gone): handshake afresh next time, so
            # later tickets of the dead epoch fail fast as stale instead of timing out on reads.
            self.peers.forget(ticket.engine_id)
            raise
        return PullResult(
            num_bytes=sum(r[0] for r in results), num_descriptors=sum(r[1] for r in results), num_reads=len(results),
            seconds=time.perf_counter() - started,
        )

    async def _read(self, agent: TransferAgent, peer: str, plan: TransferPlan, owner, local_rank: int,
                    notify: bytes) -> tuple[int, int]:
        if plan.num_descriptors == 0:  # everything already local: still tell the owner we are done
            agent.send_notification(peer, notify)
            return 0, 0
        src = [(r.address, r.device_id) for r in sorted(owner.regions, key=lambda r: r.buffer_index)]
        dst = [(r.address, r.device_id) for r in self._regions[local_rank]]
        remote_rows, local_rows = plan.address_rows(src, dst)
        result = await agent.read(peer, local_rows, remote_rows, notify, self._mem_kind,
                                  remote_mem_kind=owner.regions[0].kind, timeout_s=self.transfer_timeout_s)
        return result.num_bytes, result.num_descriptors

    def _check_ticket(self, ticket: kv_pb2.TransferTicket, remote: EngineDescription,
                      local_block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        groups = {g.group_id: list(g.block_ids) for g in ticket.groups}
        if sorted(groups) != [g.group_id for g in remote.groups]:
            raise TicketError(f"ticket names KV groups {sorted(groups)}, the engine has "
                              f"{[g.group_id for g in remote.groups]}")
        if len(local_block_ids) != len(remote.groups):
            raise TicketError(f"{len(local_block_ids)} local block tables for {len(remote.groups)} KV groups")
        num_blocks = remote.ranks[0].layout.num_blocks
        for g in remote.groups:
            ids = groups[g.group_id]
            if any(not 0 <= b < num_blocks for b in ids):
                raise TicketError(f"ticket block ids for group {g.group_id} fall outside the owner's "
                                  f"{num_blocks} blocks")
            if len(ids) * g.block_size < ticket.num_tokens:
                raise TicketError(f"ticket holds {len(ids)} blocks of {g.block_size} for {ticket.num_tokens} tokens")
        local_blocks = self._ranks[0].layout.num_blocks
        if any(not 0 <= b < local_blocks for ids in local_block_ids for b in ids):
            raise TicketError(f"local block ids fall outside this engine's {local_blocks} blocks")
        return [groups[g.group_id] for g in remote.groups]

    @staticmethod
    def _pieces(remote: EngineDescription, local: KVLayoutSpec, num_tokens: int, remote_ids: list[list[int]],
                local_ids: Sequence[Sequence[int]], num_cached_tokens: int) -> dict[int, tuple[BlockPiece, ...]]:
        out = {}
        for rg, lg in zip(remote.groups, local.groups, strict=True):
            start = max(num_cached_tokens, window_start_token(rg, lg, num_tokens))
            start -= start % lg.block_size
            out[lg.group_id] = map_blocks(remote_ids[rg.group_id], rg.block_size, local_ids[lg.group_id],
                                          lg.block_size, num_tokens, start)
        return out
