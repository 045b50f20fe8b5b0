"""Owner (prefill) side of KV transfer: publish the engine, hand out tickets, free on notification.

Each TP rank registers its KV buffers with its own NIXL agent (``services.kv.ranks.kv_rank``; the ranks
may live in other processes). A ticket is handed out with the reader's TP size, so the owner
knows how many reading ranks will notify each of its ranks (``group_readers_per_remote_rank``,
each KV group sharded by its own heads); the request's blocks are released once every owner rank
has heard from all of its readers, or when the lease expires.

A ticket names its lease's end (``lease_deadline_unix_ms``) and its prompt (``prompt_hash``), signed with the rest:
a READ is one-sided, so it is the reader that refuses a ticket past its lease or of another prompt
(``services.kv.reader.tickets``).

``hand_out`` runs its steps over one :class:`~services.kv.owner.hand_out.HandOutPlan` (the call's ticket and
options, decided first): the checks, the digests (``ticket_digests``), staging, the ticket put out (its nonce,
the notifications expected, its lease) and its signature, in that order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from services.kv.owner.hand_out import HandOutPlan
from services.kv.owner.notifications import NotificationTracker
from services.kv.owner.ticket_digests import kv_digests, state_digests
from services.kv.plan.staging import SpanDtype, staged_spans, staged_start, worth_staging
from services.kv.ranks.kv_rank import KVRank, LocalKVRank
from services.kv.spec import kv_quant
from services.kv.spec.compat import CompatInfo, KVIdentity
from services.kv.spec.description import EngineDescription, RankExport
from services.kv.spec.kv_convert import target_hashes
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.pair_support import group_heads_from_fields
from services.kv.spec.topology import group_readers_per_remote_rank
from services.kv.spec.wire import (
    MemoryRegion,
    notification_key,
    notification_parts,
    notification_request,
    ticket_signature,
)
from services.proto_gen.pdserve.v1 import kv_pb2


class KVExporter:
    def __init__(
        self,
        *,
        engine_id: str,
        model_name: str,
        identity: KVIdentity,
        ranks: Sequence[KVRank],
        epoch: int | None = None,
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        checkpoint_kv_scales: Mapping[int, Sequence[float]] | None = None,
    ) -> None:
        """``identity`` is the engine's (``KVIdentity.of``: the model's shape, its layout); it must
        describe the ranks' layout. ``lease_s``: how long a ticket's blocks stay pinned unread (the lease the
        caller's ``expire`` runs with: ``--kv-lease-s``), which sets each ticket's deadline on ``clock`` (wall
        time, which the reader compares with its own). ``checkpoint_kv_scales`` (layer -> (k, v), 1.0 where absent):
        what an unquantized engine quantizes with for an FP8 reader whose own they are (``spec.kv_convert``)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if not ranks:
            raise ValueError("an engine has at least one TP rank")
        layout = ranks[0].layout
        identity.check_layout(layout)
        self.engine_id = engine_id
        self.identity = identity
        self.epoch = epoch if epoch is not None else time.time_ns()
        self.lease_s = lease_s
        self._clock = clock
        self._ticket_key = secrets.token_bytes(32)  # this epoch's; readers get it in the handshake
        self._ranks = list(ranks)
        self.compat = CompatInfo.of_identity(identity)
        self._description = _describe(engine_id, self.epoch, model_name, identity, self.compat, ranks,
                                      self._ticket_key)
        # The model's total KV heads per group: each group is sharded by its own (Gemma-4's differ).
        self._group_heads = group_heads_from_fields(self.compat.fields)
        self._trackers = [NotificationTracker() for _ in ranks]
        # request id -> (owner rank, host tier, nonce) sources still expecting readers, over all its tickets
        self._waiting: dict[str, set[tuple[int, bool, str]]] = {}
        self._nonces: dict[str, list[str]] = {}  # request id -> its tickets' notification nonces
        # request id -> nonce -> that ticket's lease end (wall s), in the order handed out (so of growing ends); the
        # tickets read since are dropped from the front as new parts go out (``_lease_deadline``)
        self._lease_ends: dict[str, dict[str, float]] = {}
        self._open: dict[str, int] = {}  # request id -> end of its last part ticket, while its last is not out
        # (request id, nonce) -> per owner rank, its staged span's offset while that rank's readers have not notified
        self._staged: dict[tuple[str, str], dict[int, int]] = {}
        self.num_staged = 0  # tickets staged, and those worth it that found no room (``hand_out``)
        self.num_staging_full = 0
        # Every rank has a staging area in this process (fixed at creation: a follower's rank never has one).
        self._can_stage = all(isinstance(r, LocalKVRank) and r.staging is not None for r in self._ranks)
        # What it quantizes with for an FP8 reader, and a reader's compat hash -> its KV dtype, for each reader
        # this engine converts KV for (``kv_convert``).
        self._quant_scales = {layer: (k, v) for layer, k, v in kv_quant.layer_scales(
            checkpoint_kv_scales, layout.layer_ids, identity.num_layers)}
        self._converts = target_hashes(self.compat.fields, self._quant_scales)

    @property
    def tp_size(self) -> int:
        return len(self._ranks)

    def describe(self) -> EngineDescription:
        return self._description

    async def hand_out(
        self,
        request_id: str,
        block_ids: Sequence[Sequence[int]],
        *,
        num_tokens: int,
        first_token_id: int,
        handshake_address: str,
        reader_tp_size: int,
        prompt_hash: bytes,
        first_token_logprob: float = 0.0,
        host_block_ids: Sequence[Sequence[int]] = (),
        num_host_tokens: int = 0,
        reader_block_size: int = 0,
        part_start_token: int = 0,
        num_prompt_tokens: int = 0,
        state_slot: int | None = None,
        reader_compat_hash: str = "",
    ) -> kv_pb2.TransferTicket:
        """The ticket for a prefill whose blocks stay pinned until read (or the lease ends).

        ``num_host_tokens`` > 0: the prompt's first tokens are read from the host tier's
        ``host_block_ids`` (per group, from token 0), and each reader notifies once per source.
        With the KV digest on, the ticket carries it per group and reading rank (computed on every
        owner rank, where the KV lives); ``reader_block_size`` (the reader's block size, or the gcd of
        its groups'; 0: this engine's) sets its unit, which must divide both sides' block sizes.
        ``prompt_hash``: the whole prompt's (``wire.prompt_hash``, computed once per request), on every part.

        A part ticket (KV sent per prefill chunk) holds tokens ``part_start_token .. num_tokens`` of a
        prompt of ``num_prompt_tokens``: the request's parts follow each other (each starts where the one
        before ended), each with its own nonce, and the request counts as released only once its last part
        (``num_tokens == num_prompt_tokens``) is out and every part was read. A part after the request was
        abandoned (Release, Abort, a part's lease) is a ValueError: its earlier blocks are gone.

        A model with state layers: ``state_slot`` is the request's held state slot, holding its state after the
        whole prompt; named (with its digest) on the whole ticket or the last part only.

        ``reader_compat_hash``: the reader's compatibility hash ("": this engine's). A reader whose KV dtype this
        engine converts for (``spec.kv_convert``) gets a staged ticket, whatever its runs: quantized into the span
        (an FP8 reader; the digest then covers the span's bytes) or the FP8 blocks as they are (a reader that
        dequantizes). A ticket that cannot be staged for it is a ValueError naming why; so is a hash this engine
        neither has nor converts for.
        """
        convert = self._reader_dtype(reader_compat_hash)
        plan = HandOutPlan(
            request_id=request_id, block_ids=block_ids, num_tokens=num_tokens, first_token_id=first_token_id,
            first_token_logprob=first_token_logprob, handshake_address=handshake_address,
            reader_tp_size=reader_tp_size, reader_block_size=reader_block_size, prompt_hash=prompt_hash,
            host_block_ids=host_block_ids, num_host_tokens=num_host_tokens, part_start_token=part_start_token,
            num_prompt_tokens=num_prompt_tokens, state_slot=state_slot, opened=self._open.get(request_id),
            digest=self.identity.digest_on and bool(num_tokens),
            state_digest=self.identity.digest_on and state_slot is not None,
            stage=self._may_stage(reader_tp_size, reader_block_size, num_tokens, num_host_tokens, state_slot),
            convert=convert)
        self._check(plan)
        digests, state, staged = await self._digest_and_stage(plan)
        nonce, deadline = self._open_ticket(plan, staged)
        ticket = plan.ticket(self.engine_id, self.epoch, nonce, deadline, digests, state, staged)
        ticket.signature = ticket_signature(ticket, self._ticket_key)
        return ticket

    async def _digest_and_stage(self, plan: HandOutPlan) -> tuple[list[kv_pb2.GroupDigests], list[int], dict[int, int]]:
        """The ticket's KV and state digests and its staged spans. A ticket this engine quantizes is staged first and
        its spans digested (the bytes a READ returns); any other's blocks are digested, then staged if worth it."""
        quantize = self._span_dtype(plan) if plan.stage else None
        staged = await self._stage(plan, quantize) if quantize is not None else {}
        try:
            span = (self._span_layout(quantize), self._staged_counts(plan), staged) if quantize else None
            digests = await kv_digests(self._ranks, self._group_heads, plan, span) if plan.digest else []
            state = await state_digests(self._ranks, self.identity.state, plan) if plan.state_digest else []
            if quantize is None and plan.stage:
                staged = await self._stage(plan)
        except BaseException:
            self._unstage(staged)
            raise
        return digests, state, staged

    def quantizes_for(self, reader_compat_hash: str) -> str:
        """The FP8 KV dtype this engine quantizes a ticket into for that reader ("": none), which the prefill then
        rounds the request's K/V through (``engine.attention.kv_rounding``); ValueError as ``hand_out``'s."""
        dtype = self._reader_dtype(reader_compat_hash)
        return dtype if kv_quant.is_quantized(dtype) else ""

    def _reader_dtype(self, reader_compat_hash: str) -> str:
        """The KV dtype of a reader this engine converts for ("": none, its hash is this engine's or not given)."""
        if not reader_compat_hash or reader_compat_hash == self.compat.hash:
            return ""
        if reader_compat_hash not in self._converts:
            raise ValueError(f"reader's KV compatibility hash {reader_compat_hash[:12]} is neither this engine's "
                             f"({self.compat.hash[:12]}) nor one whose KV dtype it converts for: its dtype, its "
                             "scales or another field differ (the router's pair check names them)")
        return self._converts[reader_compat_hash]

    def _span_dtype(self, plan: HandOutPlan) -> SpanDtype | None:
        """What the staged span holds when this engine quantizes for its reader (None: it does not)."""
        if not plan.convert or not kv_quant.is_quantized(plan.convert):
            return None
        return SpanDtype(plan.convert, self._quant_scales)

    def _span_layout(self, quantize: SpanDtype | None) -> KVLayoutSpec:
        """The layout a staged span is laid out as: this engine's, in the FP8 dtype when it quantizes."""
        layout = self._ranks[0].layout
        return layout if quantize is None else dataclasses.replace(layout, dtype=quantize.dtype)

    def _check(self, plan: HandOutPlan) -> None:
        """Refuse a call that cannot make a ticket (before any step: nothing is drawn, registered or staged)."""
        request_id, whole, state_slot = plan.request_id, plan.whole, plan.state_slot
        slots, hash_bytes = self._description.num_state_slots, len(plan.prompt_hash)
        if hash_bytes != 32:
            raise ValueError(f"request {request_id!r}: a prompt hash is 32 bytes (SHA-256), got {hash_bytes}")
        if self.identity.state is not None and plan.last and plan.num_tokens and state_slot is None:
            raise ValueError(f"request {request_id!r}: a model with state layers hands out its state slot")
        if state_slot is not None and not (plan.last and 0 <= state_slot < slots):
            raise ValueError(f"request {request_id!r}: state slot {state_slot} on "
                             + ("a part before the last" if not plan.last else f"an engine of {slots} slots"))
        begin, end = plan.part_start_token, plan.num_tokens
        if not 0 <= begin < end <= whole and not (end == whole == begin == 0):
            raise ValueError(f"a part of tokens {begin}..{end} of a {whole}-token prompt")
        opened = plan.opened
        if begin != (opened or 0):
            raise ValueError(f"request {request_id!r}: a part from token {begin}, "
                             + (f"its parts so far end at {opened}" if opened else "but it has no parts out"))
        if opened is None and request_id in self._waiting:
            raise ValueError(f"request {request_id!r} already has a ticket out")
        if plan.host and self._ranks[0].host_layout is None:
            raise ValueError("a ticket names host-tier blocks but this engine has no host tier")
        if plan.convert and plan.num_tokens and not plan.stage:
            raise ValueError(f"request {request_id!r}: a reader of KV dtype {plan.convert} reads this engine's "
                             f"{self.identity.dtype} KV only staged, and this ticket cannot be: "
                             + self._why_not_staged(plan))

    def _why_not_staged(self, plan: HandOutPlan) -> str:
        if not self._can_stage:
            return "not every rank has a staging area here (--kv-staging-mib)"
        if plan.reader_tp_size != self.tp_size:
            return f"reader tp {plan.reader_tp_size} vs tp {self.tp_size}"
        if plan.host or plan.state_slot is not None:
            return "it holds host-tier tokens or a state slot"
        return f"reader block size {plan.reader_block_size} vs this engine's"

    def _open_ticket(self, plan: HandOutPlan, staged: dict[int, int]) -> tuple[str, float]:
        """Put the ticket out: its nonce (its readers' notifications expected), its lease's deadline (wall s), its
        staged span kept; the request stays open for its next part. Refused when the request was abandoned (or
        another part went out) while the ticket was digested or staged, its span freed."""
        request_id = plan.request_id
        if self._open.get(request_id) != plan.opened:
            self._unstage(staged)
            raise ValueError(f"request {request_id!r} was abandoned while its part was digested")
        issued = self._clock()  # before the lease starts (``_expect``): the deadline is never after its end
        nonce = self._expect(request_id, plan.reader_tp_size, plan.host)
        deadline = self._lease_deadline(request_id, nonce, issued + self.lease_s)
        if staged:
            self._staged[request_id, nonce] = staged
        if plan.part:
            self._open[request_id] = plan.num_tokens
        else:
            self._open.pop(request_id, None)
        return nonce, deadline

    def _lease_deadline(self, request_id: str, nonce: str, lease_end: float) -> float:
        """The new ticket's deadline (wall s): its own ``lease_end``, or an earlier one of the request's tickets
        still unread, since any lease that runs out frees the whole request's blocks (``expire`` abandons it).

        The request's lease ends grow in the order its tickets went out, so the earliest unread is the first
        still unread: the read ones before it are dropped here, each once, so a part costs O(TP size)
        amortized, not O(parts)."""
        ends = self._lease_ends.setdefault(request_id, {})
        waiting = self._waiting.get(request_id, set())
        while ends:
            first = next(iter(ends))
            if any((rank, host, first) in waiting for rank in range(self.tp_size) for host in (False, True)):
                break
            del ends[first]  # every reader of that ticket notified: its lease no longer frees anything
        earliest = next(iter(ends.values()), lease_end)
        ends[nonce] = lease_end
        return min(earliest, lease_end)

    def _may_stage(self, reader_tp_size: int, reader_block_size: int, num_tokens: int, num_host_tokens: int,
                   state_slot: int | None) -> bool:
        """Whether a ticket could be staged: every rank has a staging area here, the ticket has tokens and none
        from the host tier nor state, and its reader (of this TP size, of this block size or the gcd of its
        groups') could read the span."""
        layout = self._ranks[0].layout
        return not num_host_tokens and state_slot is None and self._can_stage and reader_tp_size == self.tp_size \
            and bool(num_tokens) and reader_block_size in (0, math.gcd(*(g.block_size for g in layout.groups)))

    def _staged_ids(self, plan: HandOutPlan) -> list[np.ndarray]:
        """Per group, the ticket's blocks a staged span holds (past its earlier parts and its window)."""
        layout = self._ranks[0].layout
        ids = []
        for g in layout.groups:
            used = -(-plan.num_tokens // g.block_size)
            ids.append(np.asarray(plan.block_ids[g.group_id][:used], dtype=np.int64)[
                staged_start(layout, g.group_id, plan.part_start_token, plan.whole):])
        return ids

    def _staged_counts(self, plan: HandOutPlan) -> tuple[int, ...]:
        return tuple(len(i) for i in self._staged_ids(plan))

    async def _stage(self, plan: HandOutPlan, quantize: SpanDtype | None = None) -> dict[int, int]:
        """Gather the ticket's blocks into every rank's staging area (``ranks.staging_area``) when they lie in
        runs enough to pay for it, or always for a converting reader (``quantize``: into that FP8 dtype); the span's
        offset per rank ({}: not staged). All ranks or none: a rank without room frees the others' spans (a
        converting reader's ticket is then a ValueError)."""
        layout, ids = self._ranks[0].layout, self._staged_ids(plan)
        if not plan.convert and not worth_staging(layout, ids):
            return {}
        _, num_bytes = staged_spans(self._span_layout(quantize), tuple(len(i) for i in ids))
        offsets = {rank: off for rank, r in enumerate(self._ranks) if (off := r.staging.alloc(num_bytes)) is not None}
        if len(offsets) < self.tp_size:
            self.num_staging_full += 1
            self._unstage(offsets)
            if plan.convert:
                raise ValueError(f"request {plan.request_id!r}: no room for its {num_bytes} bytes in the staging area, "
                                 f"which a reader of KV dtype {plan.convert} reads from (--kv-staging-mib)")
            return {}
        try:
            await asyncio.gather(*(self._ranks[rank].gather(off, ids, **({"convert": quantize} if quantize else {}))
                                   for rank, off in offsets.items()))
        except BaseException:
            self._unstage(offsets)
            raise
        self.num_staged += 1
        return offsets

    def _unstage(self, offsets: dict[int, int]) -> None:
        for rank, offset in offsets.items():
            self._ranks[rank].staging.free(offset)

    def _expect(self, request_id: str, reader_tp_size: int, host: bool) -> str:
        """Register the notifications one ticket's readers will send (each source of each owner rank a
        reader reads from); the ticket's new nonce."""
        sources = (False, True) if host else (False,)
        readers = group_readers_per_remote_rank(reader_tp_size, self.tp_size, self._group_heads)
        nonce = secrets.token_hex(8)
        waiting = self._waiting.setdefault(request_id, set())
        for rank, n in enumerate(readers):
            for source in sources if n else ():
                self._trackers[rank].expect(notification_key(request_id, source, nonce), n)
                waiting.add((rank, source, nonce))
        self._nonces.setdefault(request_id, []).append(nonce)
        return nonce

    def collect_notifications(self) -> list[dict[str, list[bytes]]]:
        """Every rank's new NIXL notifications, by rank. The NIXL call may wait: over UCX's TCP transport the
        data of READs from this worker moves inside it (tens of ms), so an event loop calls this on a thread;
        it touches no state of the exporter's own."""
        return [r.poll_notifications() for r in self._ranks]

    def released(self, notes: list[dict[str, list[bytes]]]) -> list[str]:
        """Take in what ``collect_notifications`` returned; the request ids every reader has finished with (of
        every ticket, the last part out): their blocks can be freed now."""
        for rank, rank_notes in enumerate(notes):
            for key in self._trackers[rank].feed(rank_notes):
                rid, host, nonce = notification_parts(key)
                self._waiting.get(rid, set()).discard((rank, host, nonce))
                self._release_span(rid, nonce, rank)
        done = [rid for rid, ranks in self._waiting.items() if not ranks and rid not in self._open]
        for rid in done:
            del self._waiting[rid]
            self._nonces.pop(rid, None)
            self._lease_ends.pop(rid, None)
        return done

    def refused_notifications(self) -> dict[str, int]:
        """Notifications refused so far, by reason, never freeing anything: ``unknown`` (no pending ticket
        has that key: a forged or guessed one, or one that came after its request was released) and
        ``duplicate`` (a reader that had already notified)."""
        stats = [t.stats() for t in self._trackers]
        return {"unknown": sum(s.num_unknown for s in stats), "duplicate": sum(s.num_duplicate for s in stats)}

    def expire(self, lease_s: float) -> list[str]:
        """Request ids whose readers did not all finish within ``lease_s``: freed by the lease."""
        expired: set[str] = set()
        for tracker in self._trackers:
            expired.update(notification_request(k)[0] for k in tracker.expire(lease_s))
        for rid in expired:
            self.abandon(rid)
        return sorted(expired)

    def abandon(self, request_id: str) -> bool:
        """Stop waiting for a request's readers, of all its tickets (it was aborted or a lease ran out); a
        later part of it is refused."""
        for nonce in self._nonces.pop(request_id, []):
            self._unstage(self._staged.pop((request_id, nonce), {}))
            for tracker in self._trackers:
                for host in (False, True):
                    tracker.discard(notification_key(request_id, host, nonce))
        self._open.pop(request_id, None)
        self._lease_ends.pop(request_id, None)
        return self._waiting.pop(request_id, None) is not None

    def _release_span(self, request_id: str, nonce: str, rank: int) -> None:
        """A rank's readers of a ticket have all notified: its staged span (if any) is free again."""
        spans = self._staged.get((request_id, nonce))
        if spans is not None and rank in spans:
            self._ranks[rank].staging.free(spans.pop(rank))
            if not spans:
                del self._staged[request_id, nonce]

    @property
    def num_outstanding(self) -> int:
        return len(self._waiting)


def _num_state_slots(identity: KVIdentity, ranks: Sequence[KVRank]) -> int:
    """The state slots every rank registered (0 for a model without state layers); refuses a model with state
    layers whose ranks registered none or unequal counts."""
    if identity.state is None:
        return 0
    if identity.state.tp_size != len(ranks) or any(r.state_region is None for r in ranks):
        raise ValueError(f"a model with {identity.state.label} of TP {identity.state.tp_size} on {len(ranks)} ranks, "
                         "or a rank without registered state slots")
    counts = {r.state_region.length // identity.state.slot_bytes for r in ranks}
    if len(counts) != 1:
        raise ValueError(f"the ranks registered different numbers of state slots: {sorted(counts)}")
    return counts.pop()


def _describe(engine_id: str, epoch: int, model_name: str, identity: KVIdentity, compat: CompatInfo,
              ranks: Sequence[KVRank], ticket_key: bytes) -> EngineDescription:
    """The engine's description for the handshake: its identity, and per rank its agent, memory and layout."""
    return EngineDescription(
        engine_id=engine_id, epoch=epoch, model_name=model_name, num_layers=identity.num_layers,
        num_kv_heads=identity.num_kv_heads, head_dim=identity.head_dim, compat=compat, groups=ranks[0].layout.groups,
        ranks=tuple(
            RankExport(i, r.name, r.metadata(), r.regions, r.layout, r.host_layout, r.host_regions, r.state_region,
                       _staging_region(r))
            for i, r in enumerate(ranks)
        ),
        kv_sharing=identity.sharing, ticket_key=ticket_key, state=identity.state,
        num_state_slots=_num_state_slots(identity, ranks),
    )


def _staging_region(rank: KVRank) -> MemoryRegion | None:
    return rank.staging.region if rank.staging is not None else None
