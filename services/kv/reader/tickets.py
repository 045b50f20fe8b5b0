"""The reader's checks of a ticket's use: bound to its prompt, taken once, read inside its lease.

A READ is one-sided: the owner cannot refuse it, and the blocks a ticket names are freed, then reused, once its
readers notified, its lease ran out or it was released. So the reader refuses a ticket before it posts any READ:

- when the ticket arrives (``TicketChecks.take``, before anything is reserved for it): ``prompt_mismatch``, its
  ``prompt_hash`` is not the hash of the prompt it came with (a genuine ticket of another prompt would be read into
  this one's blocks and continued as if it were its KV); ``replayed``, this reader took it before, whatever came of
  that (pulled, refused, given up for want of room: its blocks are being freed or reused, the router releases
  what a decode worker did not read); ``unbound``, it names no deadline or prompt (an owner that predates them);
  ``expired``, the reader's clock is within ``DEADLINE_MARGIN_S`` of its ``lease_deadline_unix_ms``, when the
  owner may free its blocks;
- and again right before its READs, after its signature (``KVPuller.pull``): ``expired`` (reserving blocks may
  have waited), and it must have been taken, for the prompt the ticket names, and never pulled (``replayed``).

Each is a ``TicketError`` with that ``reason`` (the decode worker counts it in
``pdserve_kv_refused_total{kind="ticket"}``). The prompt check runs before the signature is verified: the
signature, verified before any READ, covers the hash that was compared. What this cannot see: a ticket released
(``Release``) before any reader took it is freed inside its deadline, and one taken by another decode worker is not
in this one's record; with the KV digest on, a pull of blocks that were reused meanwhile fails its digest.
"""

from __future__ import annotations

import heapq
import hmac
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.kv.reader.errors import TicketError
from services.proto_gen.pdserve.v1 import kv_pb2

#: How far the owner's wall clock may be ahead of the reader's (NTP keeps a LAN's hosts within milliseconds).
CLOCK_SKEW_S = 0.5
#: Left, past the skew, for the READs to be posted and land before the owner's lease would free the blocks.
READ_MARGIN_S = 0.5
#: A ticket is refused as expired from this long before its deadline, by the reader's clock.
DEADLINE_MARGIN_S = CLOCK_SKEW_S + READ_MARGIN_S


def names_another_prompt(ticket: kv_pb2.TransferTicket, prompt_hash: bytes) -> bool:
    """Whether the ticket names a prompt, and not the one hashed ``prompt_hash`` (``wire.prompt_hash``)."""
    return bool(ticket.prompt_hash) and not hmac.compare_digest(ticket.prompt_hash, prompt_hash)


@dataclass(eq=False)  # compared by identity: one entry per ticket
class _Taken:
    deadline: float  # wall s
    prompt_hash: bytes
    pulled: bool = False


class ConsumedTickets:
    """The tickets a reader has taken, by (engine id, epoch, nonce), each until its deadline, with its prompt hash
    and whether it was pulled.

    Per owner epoch: a newer epoch of an engine drops the older one's record (its tickets are stale: the peer
    cache refuses them). The record's size is bounded by the tickets taken within one lease: an entry is dropped
    once its deadline passed, when the deadline check refuses the ticket anyway.
    """

    def __init__(self) -> None:
        self._nonces: dict[tuple[str, int], dict[str, _Taken]] = {}  # (engine id, epoch) -> nonce -> entry
        self._epochs: dict[str, int] = {}  # engine id -> its newest epoch recorded
        self._by_deadline: list[tuple[float, str, int, str]] = []  # heap of (deadline, engine id, epoch, nonce)

    def __len__(self) -> int:
        return sum(len(nonces) for nonces in self._nonces.values())

    def entry(self, ticket: kv_pb2.TransferTicket) -> _Taken | None:
        """What was recorded of the ticket; None if it was not taken (or its entry is past its deadline)."""
        return self._nonces.get((ticket.engine_id, ticket.epoch), {}).get(ticket.notify_nonce)

    def consume(self, tickets: Sequence[kv_pb2.TransferTicket]) -> None:
        """Record ``tickets`` as taken, all or none: a ``TicketError`` (``replayed``) when one already was (or two are
        the same ticket). The caller prunes first (``TicketChecks.take`` does), so what is past its deadline is no
        longer recorded."""
        seen: set[tuple[str, int, str]] = set()
        for t in tickets:
            key = (t.engine_id, t.epoch, t.notify_nonce)
            if self.entry(t) is not None or key in seen:
                raise TicketError(f"ticket for request {t.request_id!r} (engine {t.engine_id}, epoch {t.epoch}) was "
                                  "taken before: its blocks may hold another request's KV now", reason="replayed")
            seen.add(key)
        for t in tickets:
            if t.epoch > self._epochs.get(t.engine_id, -1):
                old = self._epochs.get(t.engine_id)
                if old is not None:
                    self._nonces.pop((t.engine_id, old), None)
                self._epochs[t.engine_id] = t.epoch
            deadline = t.lease_deadline_unix_ms / 1000
            self._nonces.setdefault((t.engine_id, t.epoch), {})[t.notify_nonce] = _Taken(deadline, bytes(t.prompt_hash))
            heapq.heappush(self._by_deadline, (deadline, t.engine_id, t.epoch, t.notify_nonce))

    def prune(self, now: float) -> None:
        """Drop every entry whose deadline has passed at ``now`` (and what an epoch's drop left in the heap)."""
        while self._by_deadline and self._by_deadline[0][0] <= now:
            _, engine_id, epoch, nonce = heapq.heappop(self._by_deadline)
            nonces = self._nonces.get((engine_id, epoch))
            if nonces is not None:
                nonces.pop(nonce, None)
                if not nonces:
                    del self._nonces[engine_id, epoch]


class TicketChecks:
    """A reader's checks of the tickets it takes and pulls (the module docstring), with its record of the tickets
    it took. ``clock``: wall time (s), compared with the owner's deadlines."""

    def __init__(self, margin_s: float = DEADLINE_MARGIN_S, clock: Callable[[], float] = time.time) -> None:
        self.margin_s = margin_s
        self.clock = clock
        self.consumed = ConsumedTickets()

    def take(self, tickets: Sequence[kv_pb2.TransferTicket], prompt_hash: bytes) -> None:
        """Take ``tickets`` (as they arrived, not yet verified) for the prompt hashed ``prompt_hash``: a ``TicketError``
        naming the first refusal (and then none is recorded), else they are recorded as taken."""
        now = self.clock()
        self.consumed.prune(now)  # what is left in the record is inside its deadline
        for t in tickets:
            if not (t.prompt_hash and t.lease_deadline_unix_ms):
                raise TicketError(f"ticket for request {t.request_id!r} names no lease deadline or prompt: its owner "
                                  f"{t.engine_id} predates them", reason="unbound")
            if names_another_prompt(t, prompt_hash):
                raise TicketError(f"ticket for request {t.request_id!r} was issued for another prompt",
                                  reason="prompt_mismatch")
            if self.consumed.entry(t) is None:  # a replay is named so, inside its lease or past it
                self._check_lease(t, now)
        self.consumed.consume(tickets)

    def check_pull(self, tickets: Sequence[kv_pb2.TransferTicket]) -> None:
        """Right before the READs of ``tickets`` (signed: ``KVPuller.pull`` verified them): each was taken for the
        prompt it names, never pulled, and is not within the margin of its deadline; then they are recorded as
        pulled. Else a ``TicketError`` (none is recorded), or a ValueError for a ticket the caller never took (a
        bug: every pull takes its tickets first)."""
        now = self.clock()
        entries = []
        for t in tickets:
            entry = self.consumed.entry(t)
            if entry is None:
                self._check_lease(t, now)  # an entry is dropped past its deadline: then it is refused as expired
                raise ValueError(f"ticket for request {t.request_id!r} is pulled without being taken")
            if not hmac.compare_digest(entry.prompt_hash, t.prompt_hash):
                raise TicketError(f"ticket for request {t.request_id!r} was taken for another prompt",
                                  reason="prompt_mismatch")
            if entry.pulled or entry in entries:
                raise TicketError(f"ticket for request {t.request_id!r} was pulled before", reason="replayed")
            self._check_lease(t, now)
            entries.append(entry)
        for entry in entries:
            entry.pulled = True

    def _check_lease(self, ticket: kv_pb2.TransferTicket, now: float) -> None:
        left_s = ticket.lease_deadline_unix_ms / 1000 - now
        if left_s <= self.margin_s:
            raise TicketError(f"ticket for request {ticket.request_id!r} is past its lease ({left_s:.2f} s left, "
                              f"refused under {self.margin_s:g} s): its owner may free its blocks", reason="expired")
