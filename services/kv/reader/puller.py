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
inside its lease (``reader.tickets``: a READ is one-sided, its owner cannot refuse it), and its groups, block
ids and token count are checked against the owner's handshake before anything is planned, and descriptors are
only ever computed from the layout specs, so a forged ticket cannot point a READ outside the owner's
registered KV buffers or the reader's own blocks.

``pull`` is a pipeline, each step its own module: check (``ticket_shape``, ``state``, ``tickets``, the digest jobs of
``verify``) -> plan (``pull_plan``: the pull's modes as data, from ``pieces`` and ``read_targets``) -> read
(``post_reads``) -> verify (``verify``, ``state``), timed by one ``StageClock``; the handshake-time check of a peer is
``topology_check``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.tls import TLSConfig
from services.kv.nixl.errors import TransferError
from services.kv.ranks.kv_rank import KVRank
from services.kv.ranks.staging_area import release_spans, unstage
from services.kv.reader.peers import PeerCache
from services.kv.reader.pieces import group_starts, window_prompt_tokens
from services.kv.reader.post_reads import ReadDone, post_reads
from services.kv.reader.pull_plan import CheckedPull, PullPlan, PullPlanner
from services.kv.reader.read_targets import PlannedRead, ReadTargets
from services.kv.reader.stage_clock import StageClock
from services.kv.reader.state import check_state_digest, check_state_ticket
from services.kv.reader.ticket_shape import check_consecutive, check_signed, check_ticket
from services.kv.reader.tickets import TicketChecks
from services.kv.reader.topology_check import check_topology
from services.kv.reader.verify import check_digests, digest_jobs
from services.kv.spec.compat import CompatInfo, KVIdentity
from services.kv.spec.description import EngineDescription
from services.kv.spec.kv_convert import KVConversion, conversion
from services.proto_gen.pdserve.v1 import kv_pb2


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
        before (``reader.tickets``: every ticket is ``take``-n once, then pulled); off only for benchmarks and tests
        that pull one ticket again and again."""
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
        self._prepared_lists = prepared_lists
        self._targets = ReadTargets(self._ranks)
        self._conversions: dict[str, KVConversion | None] = {}  # an owner's compat hash -> the pair's conversion
        self._planner = PullPlanner(self._ranks, self._targets, self._conversion)
        self.peers = PeerCache(
            self.compat, reader_engine_id=engine_id, auth_token=auth_token, timeout_s=handshake_timeout_s,
            validate=functools.partial(check_topology, self._ranks, identity), on_evict=self._drop_peers, tls=tls,
        )

    @property
    def tp_size(self) -> int:
        return len(self._ranks)

    def _conversion(self, remote: EngineDescription) -> KVConversion | None:
        """The KV dtype conversion between ``remote`` and this engine (``spec.kv_convert``; None: equal hashes),
        as the handshake's check accepted it."""
        key = remote.compat.hash
        if key not in self._conversions:
            self._conversions[key] = None if key == self.compat.hash else \
                conversion(remote.compat.fields, self.compat.fields)
        return self._conversions[key]

    def _drop_peers(self, old: EngineDescription) -> None:
        self._targets.forget(old.engine_id)  # removing the peers below releases their prepared lists
        for r in self._ranks:
            for remote_rank in old.ranks:
                r.remove_peer(remote_rank.agent_name)

    # ---- pulling: check -> plan -> read -> verify ----------------------------------------------
    def take(self, tickets: Sequence[kv_pb2.TransferTicket], prompt_hash: bytes) -> None:
        """Take tickets as they arrive, before anything is reserved for them, for the prompt hashed ``prompt_hash``
        (``wire.prompt_hash``): a ``TicketError`` if one names another prompt, was taken before, names no lease or
        prompt, or is past its lease (``reader.tickets``); each ticket is taken once, whatever its pull does."""
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
        clock = StageClock()
        if not 0 <= num_cached_tokens <= ticket.num_tokens:
            raise ValueError(f"num_cached_tokens {num_cached_tokens} outside [0, {ticket.num_tokens}]")
        # A known peer needs no await (and no lock): the common case costs a dict lookup.
        remote = self.peers.cached(ticket.engine_id, ticket.epoch) or \
            await self.peers.get(ticket.handshake_address, ticket.engine_id, ticket.epoch)
        clock.mark("handshake")
        checked = self._check((*earlier, ticket), remote, local_block_ids, num_cached_tokens, local_state_slot)
        clock.mark("check")
        plan = self._planner.plan(checked, remote, self._prepared_lists, clock)  # "pieces", "plan"
        try:
            done = await self._read(plan, clock)
            clock.mark("read")
            if plan.digest_jobs is not None:  # a dequantizing pull's on the FP8 span, before its scatter
                await check_digests(ticket, self._ranks, plan.digest_jobs, plan.spans if plan.dequantize else ())
            if plan.dequantize:
                clock.sub("read.scatter", await unstage(plan.spans))
        finally:
            release_spans(plan.spans)  # once the scatters are done
        if plan.state_digest is not None:
            await check_state_digest(ticket, self._ranks, plan.state_digest)
        clock.mark("digest")
        return _result(plan, done, clock)

    def _check(self, parts: tuple[kv_pb2.TransferTicket, ...], remote: EngineDescription,
               local_block_ids: Sequence[Sequence[int]], num_cached_tokens: int, local_state_slot: int | None
               ) -> CheckedPull:
        """The check step, before anything is planned: every part's signature before anything else, then the
        parts' order, the ticket's shape and state, its lease and use, and the digests it promises."""
        ticket = parts[-1]
        check_signed(parts, remote)
        if len(parts) > 1:
            check_consecutive(parts)
        blocks = check_ticket(ticket, remote, self._ranks[0].layout, local_block_ids)
        state = check_state_ticket(ticket, remote, self.identity, self._ranks, local_state_slot)
        if self.ticket_checks is not None:  # taken, and inside its lease (reserving blocks may have waited)
            self.ticket_checks.check_pull(parts)
        self._num_pulls += 1
        corrupt = self._corrupt_after is not None and self._num_pulls > self._corrupt_after
        jobs = None
        if self.identity.digest_on or corrupt:
            starts = group_starts(remote, self._ranks[0].layout, window_prompt_tokens(ticket), num_cached_tokens)
            jobs = digest_jobs(parts, self._ranks, starts, blocks.local, self.identity.digest_on, corrupt)
        return CheckedPull(parts, blocks, num_cached_tokens, state, jobs,
                           digest_state=state is not None and self.identity.digest_on)

    async def _read(self, plan: PullPlan, clock: StageClock) -> list[ReadDone]:
        """The READ step: the plan's READs, then the scatter of its staged spans (``clock``'s "read.scatter")."""
        try:
            done = await post_reads(plan, self.transfer_timeout_s)
        except TransferError:
            # The owner may have restarted (its old agents are gone): handshake afresh next time, so
            # later tickets of the dead epoch fail fast as stale instead of timing out on reads.
            self.peers.forget(plan.ticket.engine_id)
            raise
        if plan.spans and not plan.dequantize:  # a GPU's scatter is queued before the digest, on its stream
            clock.sub("read.scatter", await unstage(plan.spans))
        return done

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
        """What ``pull`` does before its READs but the signature and digests: check, map, plan (from the blocks)."""
        blocks = check_ticket(ticket, remote, self._ranks[0].layout, local_block_ids)
        return self._planner.block_reads(ticket, remote, blocks, num_cached_tokens, prepared, StageClock())


def _result(plan: PullPlan, done: list[ReadDone], clock: StageClock) -> PullResult:
    """What a pull moved (its host tier's share too) and its stages, each READ's as "read.<stage>"."""
    for read in done:
        clock.subs("read.", read.stages)
    return PullResult(
        num_bytes=sum(d.num_bytes for d in done), num_descriptors=sum(d.num_descriptors for d in done),
        num_reads=len(done), seconds=clock.seconds, stages=clock.stages(), staged=plan.staged,
        host_bytes=sum(d.num_bytes for d, read in zip(done, plan.reads, strict=True) if read.host_tier),
    )
