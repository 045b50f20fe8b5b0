"""A pull's plan: everything the READ and verify steps do, decided from the checked tickets before any READ.

The pull's modes are data here, not branches through one body: a staged ticket's plan has its spans (read from the
owner's staging areas, scattered after: ``services.kv.ranks.staging_area``), a host-tier ticket's has a READ from each
source, parts read together (``earlier``) have their notifications, a model with state layers has the state's runs
in its device READs and its state digest, and the KV digest's jobs are None when it is off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from services.kv.plan.staging import SpanDtype, StagedRead, plan_rows, same_layout, span_inside, staged_blocks
from services.kv.ranks.kv_rank import KVRank
from services.kv.ranks.staging_area import release_spans
from services.kv.reader.errors import TicketError
from services.kv.reader.pieces import group_starts, source_maps, window_prompt_tokens
from services.kv.reader.read_targets import PlannedRead, ReadTargets, notify_only, plan_reads, with_state_rows
from services.kv.reader.stage_clock import StageClock
from services.kv.reader.state import StateRead
from services.kv.reader.ticket_shape import TicketBlocks
from services.kv.reader.verify import DigestJobs
from services.kv.spec.description import EngineDescription
from services.kv.spec.kv_convert import KVConversion
from services.proto_gen.pdserve.v1 import kv_pb2


@dataclass(frozen=True)
class CheckedPull:
    """A pull's tickets after every check (signature, parts, shape, state, lease, digests), before anything is
    planned: what its plan is built from."""

    parts: tuple[kv_pb2.TransferTicket, ...]  # the earlier parts read with it, then the ticket
    blocks: TicketBlocks
    num_cached_tokens: int
    state: StateRead | None = None  # the state slot the ticket fills (a model with state layers)
    digest_jobs: DigestJobs | None = None  # None: no KV digest (off, and no fault injection)
    digest_state: bool = False  # digest the state after its READ (the KV digest is on)

    @property
    def ticket(self) -> kv_pb2.TransferTicket:
        return self.parts[-1]


@dataclass(frozen=True)
class PullPlan:
    """What a pull reads and verifies. ``reads`` go under the ticket's notification; each of ``notices`` is an
    earlier part's READ target with nothing left to read, sent after them under that part's notification (the
    owner counts every part's readers); ``spans`` (a staged ticket's) are scattered after the READs and released
    after the digest."""

    ticket: kv_pb2.TransferTicket
    reads: tuple[PlannedRead, ...]
    notices: tuple[tuple[PlannedRead, kv_pb2.TransferTicket], ...] = ()
    spans: tuple[tuple[KVRank, StagedRead], ...] = ()  # (reading rank, its staged READ)
    digest_jobs: DigestJobs | None = None  # None: no KV digest
    state_digest: StateRead | None = None  # the state to digest after the KV's (None: none, or the digest is off)

    @property
    def staged(self) -> bool:
        return bool(self.spans)

    @property
    def dequantize(self) -> bool:
        """Its spans hold FP8 bytes this engine dequantizes in the scatter (digested in its area, before)."""
        return any(span.convert is not None for _, span in self.spans)


class PullPlanner:
    """Plans a checked pull (the "pieces" and "plan" stages): from the owner's staged spans where they hold this
    engine's blocks' bytes, else from its blocks through the peer's READ targets (``ReadTargets``)."""

    def __init__(self, ranks: Sequence[KVRank], targets: ReadTargets,
                 conversion: Callable[[EngineDescription], KVConversion | None] = lambda remote: None) -> None:
        """``conversion``: the KV dtype conversion between an owner and this engine (None: their bytes are equal)."""
        self._ranks = list(ranks)
        self._targets = targets
        self._conversion = conversion

    def plan(self, checked: CheckedPull, remote: EngineDescription, prepared: bool, clock: StageClock) -> PullPlan:
        """The plan of ``checked``; ``prepared``: read through prepared lists where a target has them (never with
        the state, whose runs join the device READs)."""
        ticket, state = checked.ticket, checked.state
        conv = self._conversion(remote)
        if conv is not None:
            return self._converted(checked, remote, conv, clock)
        staged = None
        if ticket.staged_offsets and not ticket.staged_kv_dtype and checked.blocks.host is None and state is None \
                and len(checked.parts) == 1:
            staged = self._staged_reads(ticket, remote, checked.blocks.local, checked.num_cached_tokens)
        verify = dict(digest_jobs=checked.digest_jobs, state_digest=state if checked.digest_state else None)
        if staged is not None:
            clock.mark("pieces")
            plan = PullPlan(ticket, tuple(read for read, _ in staged),
                            spans=tuple((read.rank, span) for read, span in staged), **verify)
            clock.mark("plan")
            return plan
        reads = self.block_reads(ticket, remote, checked.blocks, checked.num_cached_tokens,
                                 prepared and state is None, clock)
        if state is not None:
            reads = [with_state_rows(r, state, self._ranks.index(r.rank)) if not r.host_tier else r for r in reads]
        plan = PullPlan(ticket, tuple(reads), notices=tuple((notify_only(read), part) for part in checked.parts[:-1]
                                                            for read in reads), **verify)
        clock.mark("plan")
        return plan

    def block_reads(self, ticket: kv_pb2.TransferTicket, remote: EngineDescription, blocks: TicketBlocks,
                    num_cached_tokens: int, prepared: bool, clock: StageClock) -> list[PlannedRead]:
        """The READs of a ticket from the owner's blocks (its host tier's first, for a host-tier part): token runs
        (``clock``'s "pieces"), then descriptor rows."""
        targets = self._targets.targets(remote, (False,) if blocks.host is None else (True, False), prepared)
        units, pieces = source_maps(ticket, remote, self._ranks[0].layout, blocks, num_cached_tokens,
                                    units=any(t.lists is not None for t in targets),
                                    runs=any(t.lists is None for t in targets))
        clock.mark("pieces")
        return plan_reads(targets, units, pieces)

    def _converted(self, checked: CheckedPull, remote: EngineDescription, conv: KVConversion,
                   clock: StageClock) -> PullPlan:
        """A converting pair's plan: the owner's staged span, always (its blocks are of another dtype), read into
        this engine's blocks (the owner quantized it) or into its staging area to be dequantized with the owner's
        scales. Anything else is a TicketError: a part read with earlier ones, host-tier tokens, state, or a
        ticket the owner did not stage (it was not told this engine's compat hash)."""
        ticket = checked.ticket
        why = "it was read with earlier parts" if len(checked.parts) > 1 else \
            "it names host-tier tokens" if checked.blocks.host is not None else \
            "it names a state slot" if checked.state is not None else \
            "the owner did not stage it" if not ticket.staged_offsets else \
            f"its span holds {ticket.staged_kv_dtype or conv.owner_dtype} bytes" \
            if ticket.staged_kv_dtype != (conv.reader_dtype if conv.quantize_on_send else "") else ""
        span = None if conv.quantize_on_send else SpanDtype(conv.owner_dtype, conv.layer_scales())
        staged = None if why else self._staged_reads(ticket, remote, checked.blocks.local, checked.num_cached_tokens,
                                                     conv.wire_dtype, span)
        if staged is None:
            raise TicketError(f"ticket for request {ticket.request_id!r}: {conv} reads only a staged span of its "
                              f"own ({why or 'no room in this engine staging area, or a block it needs not staged'})")
        clock.mark("pieces")
        plan = PullPlan(ticket, tuple(read for read, _ in staged), spans=tuple((read.rank, s) for read, s in staged),
                        digest_jobs=checked.digest_jobs)
        clock.mark("plan")
        return plan

    def _staged_reads(self, ticket: kv_pb2.TransferTicket, remote: EngineDescription, local_ids: list[np.ndarray],
                      num_cached_tokens: int, dtype: str | None = None, convert: SpanDtype | None = None
                      ) -> list[tuple[PlannedRead, StagedRead]] | None:
        """The READs of a staged ticket's spans (local rank q from owner rank q), or None when they are not its
        blocks' bytes (TP size, layout, a block it needs not staged): it reads the blocks. A converting pair's:
        ``dtype`` the span's, ``convert`` a dequantizing reader's (None too when its area has no room)."""
        if len(ticket.staged_offsets) != remote.tp_size:
            raise TicketError(f"ticket names {len(ticket.staged_offsets)} staged spans, owner TP {remote.tp_size}")
        if remote.tp_size != len(self._ranks) or any(o.staging_region is None for o in remote.ranks) or \
                not all(same_layout(o.layout, q.layout, dtype)
                        for o, q in zip(remote.ranks, self._ranks, strict=True)):
            return None
        window = window_prompt_tokens(ticket)
        blocks = staged_blocks(remote.ranks[0].layout, ticket.num_tokens, ticket.part_start_token, window,
                               group_starts(remote, self._ranks[0].layout, window, num_cached_tokens), local_ids)
        if blocks is None:
            return None
        # The span's layout: the owner rank's, in the span's dtype when it quantized it.
        spans = [o.layout if dtype is None else dataclasses.replace(o.layout, dtype=dtype) for o in remote.ranks]
        if not all(span_inside(layout, blocks[0], offset, o.staging_region)
                   for layout, o, offset in zip(spans, remote.ranks, ticket.staged_offsets, strict=True)):
            raise TicketError(f"ticket's staged spans {list(ticket.staged_offsets)} leave the owner's staging areas")
        plans = [plan_rows(layout, o.staging_region, offset, *blocks, q.layout.num_blocks, q.regions, q.staging,
                           convert)
                 for q, o, layout, offset in zip(self._ranks, remote.ranks, spans, ticket.staged_offsets, strict=True)]
        if any(p is None for p in plans):
            release_spans([(q, p) for q, p in zip(self._ranks, plans, strict=True) if p is not None])
            return None
        return [(PlannedRead(q, o, p.local_rows, p.remote_rows, p.num_bytes, len(p.local_rows)), p)
                for q, o, p in zip(self._ranks, remote.ranks, plans, strict=True)]
