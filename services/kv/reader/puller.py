"""Reader (decode) side of KV transfer: ticket -> handshake (cached) -> plan -> NIXL READs.

For each local TP rank, ``group_rank_reads`` says which remote ranks and head slices it needs per
KV group (groups may differ in heads and head dim: Gemma-4); for each group, ``map_blocks`` turns
the ticket's remote block ids and the reader's own block ids into token runs (skipping the prefix
the reader already holds and, for sliding-window groups, blocks outside the window); the planner
turns those into the fewest descriptors, one plan per (local rank, remote rank) across groups.
Each READ's notification is ``<request id>#<ticket nonce>`` (``/host`` appended for a host-tier
READ: ``wire.notification_key``), so the owner can count its readers and free the blocks. A ticket
whose blocks the owner staged (``services.kv.plan.staging``) is read from that span when this engine's
layout and TP size are the owner's. A sliding-window group's ticket may name a placeholder (any
in-range id, e.g. the owner's scratch block, repeated) for blocks that fell out of the window: they
are range-checked like every id and never read, since the pieces start at ``window_start_token``.

A ticket is untrusted input: it must be taken first (``take``: of the prompt it came with, never taken
before), carry the owner's signature (HMAC under the key of the owner's epoch, from the handshake), be
inside its lease (``pull_tickets``: a READ is one-sided, its owner cannot refuse it), and its groups, block
ids and token count are checked against the owner's handshake before anything is planned, and descriptors are
only ever computed from the layout specs, so a forged ticket cannot point a READ outside the owner's
registered KV buffers or the reader's own blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.tls import TLSConfig
from services.kv.nixl.agent import read_stages
from services.kv.nixl.errors import TransferError
from services.kv.nixl.prepared import PreparedLists
from services.kv.plan.planner import TransferPlan, plan_groups
from services.kv.plan.read_lists import ListLayout, list_layout
from services.kv.plan.staging import StagedRead, plan_rows, same_layout, span_inside, staged_blocks
from services.kv.plan.state_runs import state_owner_ranks
from services.kv.ranks.kv_rank import KVRank, LocalKVRank
from services.kv.ranks.staging_area import release_spans, unstage
from services.kv.reader.errors import TicketError
from services.kv.reader.peers import PeerCache
from services.kv.reader.state import StateRead, check_state_digest, check_state_ticket
from services.kv.reader.tickets import TicketChecks
from services.kv.reader.verify import check_digests, digest_jobs
from services.kv.spec.compat import CompatInfo, KVIdentity
from services.kv.spec.description import EngineDescription, RankExport
from services.kv.spec.groups import AttentionKind
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.pair_support import group_heads_from_fields
from services.kv.spec.topology import (
    RankRead,
    block_unit,
    group_rank_reads,
    kv_head_range,
    map_block_arrays,
    map_unit_arrays,
    window_start_token,
)
from services.kv.spec.wire import notification_key, ticket_is_signed_by
from services.proto_gen.pdserve.v1 import kv_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullResult:
    num_bytes: int
    num_descriptors: int
    num_reads: int
    seconds: float
    host_bytes: int = 0  # of num_bytes, read from the owner's host KV tier
    #: Seconds per stage, in order: handshake (the peer cache; the Handshake RPC on first contact), check (the ticket),
    #: pieces (token runs), plan (descriptor rows, every rank), read (every READ until the last completion reached this
    #: coroutine), digest (the KV digest of what arrived, every rank; a staged span's scatter: on CPU in read); and
    #: "read.<stage>" in one READ (``TransferAgent.read``: submit, prepare, post, complete, wake; the ranks' largest;
    #: and scatter, of a staged span: a GPU's is queued, and done in digest).
    stages: dict[str, float] = field(default_factory=dict)
    staged: bool = False  # read from the owner's staged span (``services.kv.plan.staging``), not from its blocks


@dataclass(frozen=True)
class PlannedRead:
    """One READ of a pull: which local rank reads which owner rank, and the descriptor rows."""

    rank: KVRank
    owner: RankExport
    local_rows: np.ndarray
    remote_rows: np.ndarray
    num_bytes: int
    num_descriptors: int
    host_tier: bool = False  # reads the owner's host KV tier, not its device blocks
    #: Lists prepared for this (owner rank, local rank, source) (``read_lists``): the rows above are then
    #: int32 indices into them, and the READ is ``TransferAgent.read_prepared``.
    lists: PreparedLists | None = None


@dataclass(frozen=True, eq=False)
class _Target:
    """One READ a pull of this peer issues (local rank, owner rank, source), with what does not depend on
    the ticket: the groups' head reads, and the prepared lists when it has them."""

    rank: KVRank
    owner: RankExport
    host: bool
    group_reads: dict[int, RankRead]
    table: ListLayout | None = None
    lists: PreparedLists | None = None

    @functools.cached_property
    def address_tables(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(owner's, this rank's) (base address, device) per buffer index, for a planned READ's rows."""
        regions = self.owner.host_regions if self.host else self.owner.regions
        return ([(r.address, r.device_id) for r in sorted(regions, key=lambda r: r.buffer_index)],
                [(r.address, r.device_id) for r in self.rank.regions])


class KVPuller:
    def __init__(
        self,
        *,
        engine_id: str,
        identity: KVIdentity,
        ranks: Sequence[KVRank],
        auth_token: str | None = None,
        handshake_timeout_s: float = 5.0,
        transfer_timeout_s: float = 30.0,
        tls: TLSConfig | None = None,
        corrupt_pulled_kv_after: int | None = None,
        prepared_lists: bool = True,
        check_tickets: bool = True,
    ) -> None:
        """``identity`` is the reading engine's (``KVIdentity.of``); an owner must hash the same to be read.
        ``corrupt_pulled_kv_after``: fault injection (``kv_corrupt:N``): after N pulls, flip bits in every
        pulled block after its READ, before the digest check (None: never). ``prepared_lists``: read through
        descriptor lists prepared once per peer where the rank and layouts allow (``read_lists``); off, every
        pull is planned from scratch. ``check_tickets``: refuse a ticket of another prompt, past its lease or pulled
        before (``pull_tickets``: every ticket is ``take``-n once, then pulled); off only for benchmarks and tests that
        pull one ticket again and again."""
        if ranks:
            identity.check_layout(ranks[0].layout)
        self.engine_id = engine_id
        self.identity = identity
        self.compat = CompatInfo.of_identity(identity)
        self._ranks = list(ranks)
        self.transfer_timeout_s = transfer_timeout_s
        self._corrupt_after = corrupt_pulled_kv_after
        self._num_pulls = 0
        self.ticket_checks = TicketChecks() if check_tickets else None
        self._reads_of: dict[str, tuple[EngineDescription, list]] = {}  # engine id -> (its description, reads)
        self._prepared_lists = prepared_lists
        # engine id -> (its description, {(sources, prepared): the READs of a pull})
        self._targets_of: dict[str, tuple[EngineDescription, dict[tuple, list[_Target]]]] = {}
        self.peers = PeerCache(
            self.compat, reader_engine_id=engine_id, auth_token=auth_token, timeout_s=handshake_timeout_s,
            validate=self._check_topology, on_evict=self._drop_peers, tls=tls,
        )

    @property
    def tp_size(self) -> int:
        return len(self._ranks)

    # ---- handshake-time checks -----------------------------------------------------------------
    def _check_topology(self, remote: EngineDescription) -> None:
        """Refuse a pair we could never transfer between: TP, groups, per-group shape and block sizes. Runs once
        per handshake, after the compatibility check, and names the group and field."""
        local = self._ranks[0].layout
        if len(local.groups) != len(remote.groups):
            raise ValueError(f"remote has {len(remote.groups)} KV groups, local {len(local.groups)}")
        owner = remote.ranks[0].layout
        for lg, rg in zip(local.groups, remote.groups, strict=True):
            for name, a, b in (
                ("kind", lg.kind.value, rg.kind.value),
                ("sliding_window", lg.sliding_window, rg.sliding_window),
                ("layers", sorted(lg.layer_ids), sorted(rg.layer_ids)),
                ("row_width" if AttentionKind.MLA in (lg.kind, rg.kind) else "head_dim",
                 local.group_head_dim(lg.group_id), owner.group_head_dim(rg.group_id)),
            ):
                if a != b:
                    raise ValueError(f"{lg.label}: {name} local {a} vs remote {b}")
            try:
                block_unit(rg.block_size, lg.block_size)
            except ValueError as e:
                raise ValueError(f"{lg.label}: {e}") from None
        # Each group is sharded by its own total heads (from the compat fields both sides hashed);
        # every rank must hold exactly the slice that sharding gives it, or reads would land wrong.
        heads = group_heads_from_fields(remote.compat.fields)
        for side, tp, ranks in (("local", self.tp_size, [r.layout for r in self._ranks]),
                                ("remote", remote.tp_size, [r.layout for r in remote.ranks])):
            for rank, layout in enumerate(ranks):
                for g in layout.groups:
                    start, end = kv_head_range(tp, rank, heads[g.group_id])
                    if layout.kv_heads(g.group_id) != end - start:
                        raise ValueError(f"{g.label}: {side} rank {rank} of {tp} holds {layout.kv_heads(g.group_id)} "
                                         f"KV heads, its share of {heads[g.group_id]} is {end - start}")
        for rank in range(self.tp_size):
            group_rank_reads(self.tp_size, rank, remote.tp_size, heads)
        if self.identity.state is not None or remote.state is not None:
            self._check_state(remote)
        if self.tp_size != remote.tp_size and (local.kind, owner.kind) != (LayoutKind.HEADS_OUTER,) * 2:
            log.warning("pulling from %s (tp %d, %s %s) into tp %d (%s %s): each rank reads its heads of a block as "
                        "%s; the heads_outer KV layout on both sides (--kv-layout heads_outer, or auto with "
                        "--peer-tp-size) reads a run per head for consecutive blocks", remote.engine_id,
                        remote.tp_size, owner.kind.value,
                        owner.order.value, self.tp_size, local.kind.value, local.order.value,
                        "a run per token, layer and K/V" if local.order is BlockOrder.NHD else
                        "a run per layer and K/V")

    def _check_state(self, remote: EngineDescription) -> None:
        """Both sides hold the same model's state group (the compat field covers its shape; this is the
        description's own), every rank on both sides registered its slots, and each local rank's state comes
        from owner ranks its KV reads already cover (one READ per pair carries both)."""
        local, theirs = self.identity.state, remote.state
        if local is None or theirs is None or local.with_tp(1) != theirs.with_tp(1):
            raise ValueError(f"state group: local {local.label if local else 'none'} vs remote "
                             f"{theirs.label if theirs else 'none'}")
        if theirs.tp_size != remote.tp_size or any(r.state_region is None for r in remote.ranks):
            raise ValueError(f"{local.label}: the owner's {remote.tp_size} ranks do not all announce state slots")
        if any(r.state_region is None for r in self._ranks):
            raise ValueError(f"{local.label}: a rank of this engine registered no state slots")
        for q, by_owner in enumerate(self._rank_reads(remote)):
            owners = state_owner_ranks(theirs, local, q)
            if not set(owners) <= set(by_owner):
                raise ValueError(f"{local.label}: reading rank {q} needs state from owner ranks {owners}, its KV "
                                 f"reads cover {sorted(by_owner)}")

    def _drop_peers(self, old: EngineDescription) -> None:
        self._reads_of.pop(old.engine_id, None)
        self._targets_of.pop(old.engine_id, None)  # removing the peers below releases their prepared lists
        for r in self._ranks:
            for remote_rank in old.ranks:
                r.remove_peer(remote_rank.agent_name)

    # ---- pulling -------------------------------------------------------------------------------
    def take(self, tickets: Sequence[kv_pb2.TransferTicket], prompt_hash: bytes) -> None:
        """Take tickets as they arrive, before anything is reserved for them, for the prompt hashed ``prompt_hash``
        (``wire.prompt_hash``): a ``TicketError`` if one names another prompt, was taken before, names no lease or
        prompt, or is past its lease (``pull_tickets``); each ticket is taken once, whatever its pull does."""
        if self.ticket_checks is not None:
            self.ticket_checks.take(tickets, prompt_hash)

    async def pull(
        self, ticket: kv_pb2.TransferTicket, local_block_ids: Sequence[Sequence[int]], num_cached_tokens: int = 0,
        local_state_slot: int | None = None, *, earlier: Sequence[kv_pb2.TransferTicket] = (),
    ) -> PullResult:
        """Fill the local blocks with the ticket's KV (all local ranks, concurrently).

        ``earlier``: part tickets of the same request that ``ticket`` continues, in order, read together with it
        (a reader that fell behind its parts): one READ per pair from the first one's start, planned from
        ``ticket``'s block ids (a part's ids run from token 0), digested against the sum of the parts' digests, and
        each earlier part's own notification sent after it, as a pull of a part whose blocks were all cached
        does. Staged spans are not read then, only the blocks (the owner keeps them pinned either way); a part
        with a host-tier prefix is pulled on its own.

        A model with state layers: a ticket with the state (a whole ticket, or a part ticket's last part) also
        fills ``local_state_slot`` with the owner's state slot: a few more runs of each device READ
        (``state_runs``), digested like the KV.

        ``local_block_ids[g]`` is the reader's block table for group g from token 0;
        ``num_cached_tokens`` (a local block boundary in every group) were already in the reader's
        prefix cache: each group skips its whole cached blocks. Sliding-window groups move only the
        blocks their window still reads (``window_start_token``); the rest of a table is not read.

        Checked tickets (``check_tickets``) must have been taken (``take``); each is refused (``TicketError``) past
        its lease, after its signature and before anything is read.
        """
        started = time.perf_counter()
        if not 0 <= num_cached_tokens <= ticket.num_tokens:
            raise ValueError(f"num_cached_tokens {num_cached_tokens} outside [0, {ticket.num_tokens}]")
        # A known peer needs no await (and no lock): the common case costs a dict lookup.
        remote = self.peers.cached(ticket.engine_id, ticket.epoch) or \
            await self.peers.get(ticket.handshake_address, ticket.engine_id, ticket.epoch)
        t_handshake = time.perf_counter()
        parts = (*earlier, ticket)
        for part in parts:
            if not ticket_is_signed_by(part, remote.ticket_key):
                # Not issued by that engine as it is (forged, altered in transit, or from a peer too old to sign):
                # the blocks it names need not be this request's.
                raise TicketError(f"ticket for request {part.request_id!r} is not signed by engine "
                                  f"{part.engine_id} (epoch {part.epoch})", reason="signature")
        if earlier:
            _check_consecutive(parts)
        remote_ids, host_ids, local_ids = self._check_ticket(ticket, remote, local_block_ids)
        state = check_state_ticket(ticket, remote, self.identity, self._ranks, local_state_slot)
        if self.ticket_checks is not None:  # taken, and inside its lease (reserving blocks may have waited)
            self.ticket_checks.check_pull(parts)
        self._num_pulls += 1
        corrupt = self._corrupt_after is not None and self._num_pulls > self._corrupt_after
        digested = self.identity.digest_on or corrupt
        jobs = digest_jobs(parts, self._ranks,
                           self._group_starts(remote, self._ranks[0].layout, _window_end(ticket), num_cached_tokens),
                           local_ids, self.identity.digest_on, corrupt) if digested else []
        t_check = time.perf_counter()
        staged = self._staged_reads(ticket, remote, local_ids, num_cached_tokens) \
            if ticket.staged_offsets and host_ids is None and state is None and not earlier else None
        spans = [(read.rank, plan) for read, plan in staged or ()]  # (reading rank, its staged READ)
        t_pieces = time.perf_counter()
        if staged is None:  # the state's runs join the device READs, so those are planned (lists take indices)
            targets = self._targets(remote, (False,) if host_ids is None else (True, False),
                                    self._prepared_lists and state is None)
            units, pieces = self._source_maps(ticket, remote, remote_ids, host_ids, local_ids, num_cached_tokens,
                                              targets)
            t_pieces = time.perf_counter()
            reads = self._plan_reads(targets, units, pieces)
            if state is not None:
                reads = [self._with_state_rows(r, state) if not r.host_tier else r for r in reads]
        else:
            reads = [read for read, _ in staged]
        t_plan = time.perf_counter()
        nonce = ticket.notify_nonce
        try:
            try:
                if len(reads) == 1:  # no task to create and schedule for the one READ of a TP-1 pair
                    results = [await self._read(reads[0], ticket.request_id, nonce)]
                else:
                    results = await asyncio.gather(*(self._read(read, ticket.request_id, nonce) for read in reads))
                if earlier:  # each earlier part's readers notify its own key, with nothing left to read
                    await asyncio.gather(*(self._read(_notify_only(read), part.request_id, part.notify_nonce)
                                           for part in earlier for read in reads))
            except TransferError:
                # The owner may have restarted (its old agents are gone): handshake afresh next time, so
                # later tickets of the dead epoch fail fast as stale instead of timing out on reads.
                self.peers.forget(ticket.engine_id)
                raise
            scatter_s = await unstage(spans)  # a GPU's scatter is queued before the digest, on its stream
            t_read = time.perf_counter()
            if digested:
                await check_digests(ticket, self._ranks, jobs)
        finally:
            release_spans(spans)  # once the scatters are done
        if state is not None and self.identity.digest_on:
            await check_state_digest(ticket, self._ranks, state)
        done = time.perf_counter()
        stages = {"handshake": t_handshake - started, "check": t_check - t_handshake, "pieces": t_pieces - t_check,
                  "plan": t_plan - t_pieces, "read": t_read - t_plan, "digest": done - t_read,
                  **({"read.scatter": scatter_s} if spans else {})}
        for _, _, sub in results:
            for name, seconds in sub.items():
                stages[f"read.{name}"] = max(stages.get(f"read.{name}", 0.0), seconds)
        return PullResult(
            num_bytes=sum(r[0] for r in results), num_descriptors=sum(r[1] for r in results), num_reads=len(results),
            seconds=done - started, stages=stages, staged=staged is not None,
            host_bytes=sum(r[0] for r, read in zip(results, reads, strict=True) if read.host_tier),
        )

    def _with_state_rows(self, read: PlannedRead, state: StateRead) -> PlannedRead:
        """The device READ of (local rank q, owner rank r) with the state runs q reads from r appended."""
        rows = state.rows(read.owner, read.rank, self._ranks.index(read.rank))
        if rows is None:
            return read
        remote_rows, local_rows, num_bytes = rows
        return dataclasses.replace(read, local_rows=np.concatenate([read.local_rows.reshape(-1, 3), local_rows]),
                                   remote_rows=np.concatenate([read.remote_rows.reshape(-1, 3), remote_rows]),
                                   num_bytes=read.num_bytes + num_bytes,
                                   num_descriptors=read.num_descriptors + len(local_rows))

    def _staged_reads(self, ticket: kv_pb2.TransferTicket, remote: EngineDescription, local_ids: list[np.ndarray],
                      num_cached_tokens: int) -> list[tuple[PlannedRead, StagedRead]] | None:
        """The READs of a staged ticket's spans (``services.kv.plan.staging``: local rank q from owner rank q), or None
        when they are not its blocks' bytes (TP size, layout, a block it needs not staged): it reads the blocks."""
        if len(ticket.staged_offsets) != remote.tp_size:
            raise TicketError(f"ticket names {len(ticket.staged_offsets)} staged spans, owner TP {remote.tp_size}")
        if remote.tp_size != self.tp_size or any(o.staging_region is None for o in remote.ranks) or \
                not all(same_layout(o.layout, q.layout) for o, q in zip(remote.ranks, self._ranks, strict=True)):
            return None
        window = _window_end(ticket)
        blocks = staged_blocks(remote.ranks[0].layout, ticket.num_tokens, ticket.part_start_token, window,
                               self._group_starts(remote, self._ranks[0].layout, window, num_cached_tokens), local_ids)
        if blocks is None:
            return None
        if not all(span_inside(o.layout, blocks[0], offset, o.staging_region)
                   for o, offset in zip(remote.ranks, ticket.staged_offsets, strict=True)):
            raise TicketError(f"ticket's staged spans {list(ticket.staged_offsets)} leave the owner's staging areas")
        plans = [plan_rows(o.layout, o.staging_region, offset, *blocks, q.layout.num_blocks, q.regions, q.staging)
                 for q, o, offset in zip(self._ranks, remote.ranks, ticket.staged_offsets, strict=True)]
        return [(PlannedRead(q, o, p.local_rows, p.remote_rows, p.num_bytes, len(p.local_rows)), p)
                for q, o, p in zip(self._ranks, remote.ranks, plans, strict=True)]

    def planned_reads(self, ticket: kv_pb2.TransferTicket, local_block_ids: Sequence[Sequence[int]],
                      num_cached_tokens: int = 0, *, prepared: bool | None = None) -> list[PlannedRead]:
        """The READs ``pull`` would issue for this ticket (its owner already handshaken), without issuing
        them: for benchmarks and tests that compare with the same descriptors. ``prepared=False``: as
        descriptor rows from the planner even where ``pull`` reads through prepared lists."""
        remote = self.peers.cached(ticket.engine_id, ticket.epoch)
        if remote is None:
            raise ValueError(f"engine {ticket.engine_id} epoch {ticket.epoch} is not handshaken")
        return self._reads_for(ticket, remote, local_block_ids, num_cached_tokens,
                               self._prepared_lists if prepared is None else prepared)

    def _reads_for(self, ticket: kv_pb2.TransferTicket, remote: EngineDescription,
                   local_block_ids: Sequence[Sequence[int]], num_cached_tokens: int, prepared: bool = False
                   ) -> list[PlannedRead]:
        """What ``pull`` does before its READs but the signature and digests: check, map, plan."""
        remote_ids, host_ids, local_ids = self._check_ticket(ticket, remote, local_block_ids)
        targets = self._targets(remote, (False,) if host_ids is None else (True, False), prepared)
        units, pieces = self._source_maps(ticket, remote, remote_ids, host_ids, local_ids, num_cached_tokens, targets)
        return self._plan_reads(targets, units, pieces)

    def _source_maps(self, ticket: kv_pb2.TransferTicket, remote: EngineDescription, remote_ids: list[np.ndarray],
                     host_ids: list[np.ndarray] | None, local_ids: list[np.ndarray], num_cached_tokens: int,
                     targets: list[_Target]) -> tuple[dict[bool, dict[int, tuple]], dict[bool, dict[int, np.ndarray]]]:
        """(unit indices, token runs) per source (host tier: True) and group, each only when a READ takes
        that form (prepared lists take units, the planner runs). Every local rank shares the block
        tables, so they are the same for all of them. The host tier holds the prompt's first
        ``num_host_tokens``, the device blocks the rest."""
        local, window = self._ranks[0].layout, _window_end(ticket)
        if host_ids is None:
            spans = {False: (remote_ids, 0, None)}
        else:
            spans = {True: (host_ids, 0, ticket.num_host_tokens), False: (remote_ids, ticket.num_host_tokens, None)}
        maps: list[dict] = [{}, {}]
        for i, (wanted, mapper) in enumerate(((any(t.lists is not None for t in targets), map_unit_arrays),
                                              (any(t.lists is None for t in targets), map_block_arrays))):
            if wanted:
                maps[i] = {host: self._pieces(remote, local, ticket.num_tokens, ids, local_ids, num_cached_tokens,
                                              begin=begin, end=end, window_end=window, mapper=mapper)
                           for host, (ids, begin, end) in spans.items()}
        return maps[0], maps[1]

    def _targets(self, remote: EngineDescription, sources: tuple[bool, ...], prepared: bool) -> list[_Target]:
        """The READs of a pull from this peer (one per local rank, owner rank and source), with their
        prepared lists: built once per peer and sources, again if the agent released the lists."""
        entry = self._targets_of.get(remote.engine_id)
        if entry is None or entry[0] is not remote:
            entry = self._targets_of[remote.engine_id] = (remote, {})
        targets = entry[1].get((sources, prepared))
        if targets is None or any(t.lists is not None and t.lists.released for t in targets):
            targets = entry[1][sources, prepared] = [
                self._target(remote, local_rank, remote_rank, host, group_reads, prepared)
                for local_rank, by_owner in enumerate(self._rank_reads(remote))
                for remote_rank, group_reads in by_owner.items() for host in sources]
        return targets

    def _target(self, remote: EngineDescription, local_rank: int, remote_rank: int, host: bool,
                group_reads: dict[int, RankRead], prepared: bool) -> _Target:
        """One READ's target, its lists prepared when this rank's agent is in this process and the lists
        stay small (``read_lists.MAX_ENTRIES``); else the planner plans each pull of it.

        Heads-outer KV is always planned: its lists hold an entry per (head, block), and on an H100 NIXL's
        merge of adjacent prepared entries did not merge the copies (1 GiB through 4,096 entries merged to 8
        descriptors took 117 ms; the planner's 8 runs 3.3 ms)."""
        rank, owner = self._ranks[local_rank], remote.ranks[remote_rank]
        target = _Target(rank, owner, host, group_reads)
        layout, regions = (owner.host_layout, owner.host_regions) if host else (owner.layout, owner.regions)
        if not prepared or not isinstance(rank, LocalKVRank) or \
                LayoutKind.HEADS_OUTER in (layout.kind, rank.layout.kind):
            return target
        table = list_layout(layout, regions, rank.layout, rank.regions, group_reads)
        if table is None:
            return target
        try:
            peer = rank.agent.add_peer(owner.agent_metadata)
            lists = rank.agent.prepare_lists(peer, table.local_rows, table.remote_rows, rank.regions[0].kind,
                                             remote_mem_kind=regions[0].kind)
        except TransferError as exc:  # planned READs fail or succeed on their own
            log.warning("preparing descriptor lists for %s failed, planning each pull instead: %s",
                        owner.agent_name, exc)
            return target
        return _Target(rank, owner, host, group_reads, table, lists)

    def _plan_reads(self, targets: list[_Target], units: dict[bool, dict[int, tuple]],
                    pieces: dict[bool, dict[int, np.ndarray]]) -> list[PlannedRead]:
        """One READ per target (local rank, remote rank, source: device blocks or the owner's host tier).

        A target with prepared lists takes its indices (``ListLayout.indices``); the others are planned.
        Ranks whose layouts and head slices match (equal TP sizes: rank r reads rank r) share one
        plan; only the addresses differ. A ticket with a host-tier part gets a READ from each
        source, even an empty one: its notification is what the owner counts.
        """
        plans: dict[tuple, TransferPlan] = {}
        reads: list[PlannedRead] = []
        for t in targets:
            if t.table is not None:
                local_idx, remote_idx, num_bytes, num_descriptors = t.table.indices(
                    {g: units[t.host][g] for g in t.group_reads})
                reads.append(PlannedRead(t.rank, t.owner, local_idx, remote_idx, num_bytes, num_descriptors,
                                         host_tier=t.host, lists=t.lists))
                continue
            owner_layout = t.owner.host_layout if t.host else t.owner.layout
            key = (t.host, id(owner_layout), id(t.rank.layout),
                   tuple((g, r.remote_heads, r.local_heads) for g, r in t.group_reads.items()))
            plan = plans.get(key)
            if plan is None:
                # The prompt's last block is this request's own (partial blocks are never shared),
                # and decode overwrites the slots past the prompt before reading them: padding it
                # costs no extra descriptors for the stale tail bytes it copies. A host-tier part
                # ends mid-prompt, where the device part's READ writes the rest of the block.
                plan = plans[key] = plan_groups(owner_layout, t.rank.layout,
                                                {g: pieces[t.host][g] for g in t.group_reads}, t.group_reads,
                                                pad_partial_blocks=not t.host)
            remote_rows, local_rows = plan.address_rows(*t.address_tables)
            reads.append(PlannedRead(t.rank, t.owner, local_rows, remote_rows, plan.total_bytes,
                                     plan.num_descriptors, host_tier=t.host))
        return reads

    def _rank_reads(self, remote: EngineDescription) -> list[dict[int, dict[int, RankRead]]]:
        """``group_rank_reads`` of every local rank against this peer, computed once per peer."""
        entry = self._reads_of.get(remote.engine_id)
        if entry is None or entry[0] is not remote:
            heads = group_heads_from_fields(remote.compat.fields)
            entry = self._reads_of[remote.engine_id] = (remote, [
                group_rank_reads(self.tp_size, r, remote.tp_size, heads) for r in range(self.tp_size)])
        return entry[1]

    async def _read(self, read: PlannedRead, request_id: str, nonce: str) -> tuple[int, int, dict[str, float]]:
        """One READ from one owner rank (or, when everything was local, only the notification):
        (bytes, descriptors, the READ's stages)."""
        owner = read.owner
        notify = notification_key(request_id, read.host_tier, nonce)
        sub: dict[str, float] = {}
        token = read_stages.set(sub)  # the agent's READ adds its stages here
        kind = (owner.host_regions if read.host_tier else owner.regions)[0].kind
        try:
            if read.lists is None:
                got = await read.rank.read(owner.agent_metadata, read.local_rows, read.remote_rows, notify, kind,
                                           self.transfer_timeout_s)
            elif not read.local_rows.size:  # everything was local: only the notification
                await read.rank.agent.notify(read.lists.peer, notify)  # off the loop while READs stream
                got = (0, 0)
            else:
                result = await read.rank.agent.read_prepared(
                    read.lists, read.local_rows, read.remote_rows, notify, num_bytes=read.num_bytes,
                    num_descriptors=read.num_descriptors, timeout_s=self.transfer_timeout_s)
                got = (result.num_bytes, result.num_descriptors)
        finally:
            read_stages.reset(token)
        return got[0], got[1], sub

    def _check_ticket(self, ticket: kv_pb2.TransferTicket, remote: EngineDescription,
                      local_block_ids: Sequence[Sequence[int]]
                      ) -> tuple[list[np.ndarray], list[np.ndarray] | None, list[np.ndarray]]:
        """The ticket's and the reader's block ids per group (arrays), after checking them against the
        owner's handshake and this engine.

        Every id must be inside the owner's blocks, placeholders included (they are never read but
        a forged id is refused all the same); repeats are only refused where a transfer reads them
        (``map_blocks``), since a sliding group's out-of-window placeholders may repeat.
        """
        if len(local_block_ids) != len(remote.groups):
            raise TicketError(f"{len(local_block_ids)} local block tables for {len(remote.groups)} KV groups")
        owner = remote.ranks[0]
        device_ids = _ticket_groups(ticket.groups, remote, owner.layout.num_blocks, ticket.num_tokens, "")
        host_ids = None
        if ticket.num_host_tokens or ticket.host_groups:
            if owner.host_layout is None:
                raise TicketError(f"ticket names host-tier blocks, engine {remote.engine_id} has no host tier")
            if not 0 < ticket.num_host_tokens <= ticket.num_tokens:
                raise TicketError(f"ticket reads {ticket.num_host_tokens} tokens from the host tier of a "
                                  f"{ticket.num_tokens}-token prompt")
            if any(ticket.num_host_tokens % g.block_size for g in remote.groups):
                raise TicketError(f"ticket's host-tier part ({ticket.num_host_tokens} tokens) ends inside a block")
            host_ids = _ticket_groups(ticket.host_groups, remote, owner.host_layout.num_blocks,
                                      ticket.num_host_tokens, "host-tier ")
        local_blocks = self._ranks[0].layout.num_blocks
        local_ids = [np.asarray(ids) for ids in local_block_ids]  # map_block_arrays refuses non-integers
        if not all(_inside(ids, local_blocks) for ids in local_ids):
            raise TicketError(f"local block ids fall outside this engine's {local_blocks} blocks")
        return device_ids, host_ids, local_ids

    @staticmethod
    def _pieces(remote: EngineDescription, local: KVLayoutSpec, num_tokens: int, remote_ids: list[np.ndarray],
                local_ids: Sequence[np.ndarray], num_cached_tokens: int, begin: int = 0, end: int | None = None,
                window_end: int | None = None, mapper=map_block_arrays) -> dict[int, Any]:
        """Token runs per group (``map_block_arrays``, or another ``mapper`` of the same arguments) of the
        prompt's tokens ``begin .. end``: from the reader's cached prefix (whole local blocks of that group)
        or, for a sliding group, the window's start (of a prompt of ``window_end`` tokens: a part ticket's
        whole prompt), whichever is later; to ``end`` (the prompt's end by default)."""
        end = num_tokens if end is None else end
        starts = KVPuller._group_starts(remote, local, window_end or num_tokens, num_cached_tokens)
        out = {}
        for rg, lg in zip(remote.groups, local.groups, strict=True):
            start = min(max(starts[lg.group_id], begin), end)
            out[lg.group_id] = mapper(remote_ids[rg.group_id], rg.block_size, local_ids[lg.group_id], lg.block_size,
                                      end, start)
        return out

    @staticmethod
    def _group_starts(remote: EngineDescription, local: KVLayoutSpec, num_tokens: int, num_cached_tokens: int
                      ) -> dict[int, int]:
        """Per group, the first token a pull moves: after the reader's cached prefix (whole local blocks of
        that group) or, for a sliding group, the window's start, whichever is later."""
        return {lg.group_id: max(num_cached_tokens - num_cached_tokens % lg.block_size,
                                 window_start_token(rg, lg, num_tokens))
                for rg, lg in zip(remote.groups, local.groups, strict=True)}


def _window_end(ticket: kv_pb2.TransferTicket) -> int:
    """The prompt length sliding windows are clipped for: a part ticket's whole prompt, else its own tokens."""
    return max(ticket.num_prompt_tokens, ticket.num_tokens)


def _check_consecutive(parts: Sequence[kv_pb2.TransferTicket]) -> None:
    """Part tickets read in one pull: one request's, from one owner, each starting where the one before ended,
    and none with a host-tier prefix (its READ from the host tier is a pull of its own)."""
    first = parts[0]
    for before, part in zip(parts, parts[1:], strict=False):
        if (part.engine_id, part.epoch, part.request_id, part.num_prompt_tokens) != \
                (first.engine_id, first.epoch, first.request_id, first.num_prompt_tokens) or \
                part.part_start_token != before.num_tokens or not part.num_prompt_tokens:
            raise ValueError(f"tickets of tokens {before.part_start_token}..{before.num_tokens} and "
                             f"{part.part_start_token}..{part.num_tokens} are not consecutive parts of one request")
    if any(p.num_host_tokens for p in parts):
        raise ValueError("a part ticket that reads the owner's host tier is pulled on its own")


def _notify_only(read: PlannedRead) -> PlannedRead:
    """The same READ target with nothing to read: ``_read`` then only sends its notification."""
    empty = np.empty((0, 3), dtype=np.uint64) if read.lists is None else np.empty(0, dtype=np.int32)
    return dataclasses.replace(read, local_rows=empty, remote_rows=empty, num_bytes=0, num_descriptors=0)


def _ticket_groups(groups: Sequence[kv_pb2.GroupBlocks], remote: EngineDescription, num_blocks: int,
                   num_tokens: int, what: str) -> list[np.ndarray]:
    """A ticket's block ids per group, checked: every group once, ids inside the owner's blocks,
    enough of them for ``num_tokens``."""
    by_group: dict[int, np.ndarray] = {}
    for g in groups:
        if g.group_id in by_group:
            raise TicketError(f"ticket names {what}KV group {g.group_id} twice")
        by_group[g.group_id] = np.asarray(g.block_ids, dtype=np.int64)
    if sorted(by_group) != [g.group_id for g in remote.groups]:
        raise TicketError(f"ticket names {what}KV groups {sorted(by_group)}, the engine has "
                          f"{[g.group_id for g in remote.groups]}")
    for g in remote.groups:
        ids = by_group[g.group_id]
        if not _inside(ids, num_blocks):
            raise TicketError(f"ticket {what}block ids for {g.label} fall outside the owner's {num_blocks} blocks")
        if len(ids) * g.block_size < num_tokens:
            raise TicketError(f"ticket holds {len(ids)} {what}blocks of {g.block_size} for {num_tokens} tokens "
                              f"in {g.label}")
    return [by_group[g.group_id] for g in remote.groups]


def _inside(ids: np.ndarray, num_blocks: int) -> bool:
    return ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < num_blocks)
