"""The READs of a pull from one peer: their targets (local rank, owner rank, source), kept per peer with their
prepared descriptor lists, and the descriptor rows of one pull of them (the "plan" stage).

A target has prepared lists (``read_lists``) when its rank's agent is in this process and the lists stay small:
a pull then takes indices into them (``ListLayout.indices``); the others are planned (``plan_groups``), ranks
whose layouts and head slices match sharing one plan. A ticket with a host-tier part gets a READ from each source,
even an empty one: its notification is what the owner counts.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.kv.nixl.errors import TransferError
from services.kv.nixl.prepared import PreparedLists
from services.kv.plan.planner import TransferPlan, plan_groups
from services.kv.plan.read_lists import ListLayout, list_layout
from services.kv.ranks.kv_rank import KVRank, LocalKVRank
from services.kv.reader.pieces import SourceMap
from services.kv.reader.state import StateRead
from services.kv.spec.description import EngineDescription, RankExport
from services.kv.spec.layout import LayoutKind
from services.kv.spec.pair_support import group_heads_from_fields
from services.kv.spec.topology import RankRead, group_rank_reads

log = logging.getLogger(__name__)


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
class ReadTarget:
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


class ReadTargets:
    """Per peer (by engine id, for the description it handshook with), every local rank's ``group_rank_reads``
    and the READ targets of a pull by (sources, prepared), built once; ``forget`` drops a peer's."""

    def __init__(self, ranks: Sequence[KVRank]) -> None:
        self._ranks = list(ranks)
        self._reads_of: dict[str, tuple[EngineDescription, list]] = {}  # engine id -> (its description, reads)
        # engine id -> (its description, {(sources, prepared): the READs of a pull})
        self._targets_of: dict[str, tuple[EngineDescription, dict[tuple, list[ReadTarget]]]] = {}

    def forget(self, engine_id: str) -> None:
        """Drop a peer's targets (removing its agents' peers then releases their prepared lists)."""
        self._reads_of.pop(engine_id, None)
        self._targets_of.pop(engine_id, None)

    def rank_reads(self, remote: EngineDescription) -> list[dict[int, dict[int, RankRead]]]:
        """``group_rank_reads`` of every local rank against this peer, computed once per peer."""
        entry = self._reads_of.get(remote.engine_id)
        if entry is None or entry[0] is not remote:
            heads = group_heads_from_fields(remote.compat.fields)
            tp = len(self._ranks)
            entry = self._reads_of[remote.engine_id] = (remote, [
                group_rank_reads(tp, r, remote.tp_size, heads) for r in range(tp)])
        return entry[1]

    def targets(self, remote: EngineDescription, sources: tuple[bool, ...], prepared: bool) -> list[ReadTarget]:
        """The READs of a pull from this peer (one per local rank, owner rank and source), with their
        prepared lists: built once per peer and sources, again if the agent released the lists."""
        entry = self._targets_of.get(remote.engine_id)
        if entry is None or entry[0] is not remote:
            entry = self._targets_of[remote.engine_id] = (remote, {})
        targets = entry[1].get((sources, prepared))
        if targets is None or any(t.lists is not None and t.lists.released for t in targets):
            targets = entry[1][sources, prepared] = [
                self._target(remote, local_rank, remote_rank, host, group_reads, prepared)
                for local_rank, by_owner in enumerate(self.rank_reads(remote))
                for remote_rank, group_reads in by_owner.items() for host in sources]
        return targets

    def _target(self, remote: EngineDescription, local_rank: int, remote_rank: int, host: bool,
                group_reads: dict[int, RankRead], prepared: bool) -> ReadTarget:
        """One READ's target, its lists prepared when this rank's agent is in this process and the lists
        stay small (``read_lists.MAX_ENTRIES``); else the planner plans each pull of it.

        Heads-outer KV is always planned: its lists hold an entry per (head, block), and on an H100 NIXL's
        merge of adjacent prepared entries did not merge the copies (1 GiB through 4,096 entries merged to 8
        descriptors took 117 ms; the planner's 8 runs 3.3 ms)."""
        rank, owner = self._ranks[local_rank], remote.ranks[remote_rank]
        target = ReadTarget(rank, owner, host, group_reads)
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
        return ReadTarget(rank, owner, host, group_reads, table, lists)


def plan_reads(targets: list[ReadTarget], units: SourceMap, pieces: SourceMap) -> list[PlannedRead]:
    """One READ per target (local rank, remote rank, source: device blocks or the owner's host tier): a target
    with prepared lists takes its indices of ``units``, the others are planned from ``pieces``."""
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


def with_state_rows(read: PlannedRead, state: StateRead, local_rank: int) -> PlannedRead:
    """The device READ of (local rank ``local_rank``, owner rank r) with the state runs it reads from r appended."""
    rows = state.rows(read.owner, read.rank, local_rank)
    if rows is None:
        return read
    remote_rows, local_rows, num_bytes = rows
    return dataclasses.replace(read, local_rows=np.concatenate([read.local_rows.reshape(-1, 3), local_rows]),
                               remote_rows=np.concatenate([read.remote_rows.reshape(-1, 3), remote_rows]),
                               num_bytes=read.num_bytes + num_bytes,
                               num_descriptors=read.num_descriptors + len(local_rows))


def notify_only(read: PlannedRead) -> PlannedRead:
    """The same READ target with nothing to read: posting it only sends its notification."""
    empty = np.empty((0, 3), dtype=np.uint64) if read.lists is None else np.empty(0, dtype=np.int32)
    return dataclasses.replace(read, local_rows=empty, remote_rows=empty, num_bytes=0, num_descriptors=0)
