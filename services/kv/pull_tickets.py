"""The reader's checks of a ticket's use: bound to its prompt, inside its lease, pulled once.

A READ is one-sided: the owner cannot refuse it, and the blocks a ticket names are freed, then reused, once
its readers notified, its lease ran out or it was released. So the reader refuses, after the ticket's signature
(``KVPuller.pull``) and before it posts any READ:

- ``prompt_mismatch``: the ticket's ``prompt_hash`` is not the hash of the prompt it came with (a genuine ticket
  of another prompt would be read into this one's blocks and continued as if it were its KV);
- ``expired``: the reader's clock is within ``DEADLINE_MARGIN_S`` of the ticket's ``lease_deadline_unix_ms``, when
  the owner may free its blocks;
- ``replayed``: this reader pulled the ticket before (``ConsumedTickets``): its blocks are being freed, or are free;
- ``unbound``: the ticket has no deadline or prompt hash (an owner that predates them).

Each is a ``TicketError`` with that ``reason`` (the decode worker counts it in
``pdserve_kv_refused_total{kind="ticket"}``). What this cannot see: a ticket released (``Release``) before it was
ever pulled is freed inside its deadline, and a ticket pulled by another decode worker is not in this one's record;
with the KV digest on, a pull of blocks that were reused meanwhile fails its digest.
"""

from __future__ import annotations

import heapq
import hmac
import time
from collections.abc import Callable, Sequence

from services.kv.pull_errors import TicketError
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


class ConsumedTickets:
    """The tickets a reader has pulled, by (engine id, epoch, nonce), each until its deadline.

    Per owner epoch: a newer epoch of an engine drops the older one's record (its tickets are stale: the peer
    cache refuses them). The record's size is bounded by the tickets pulled within one lease: an entry is dropped
    once its deadline passed, when the deadline check refuses the ticket anyway.
    """

    def __init__(self) -> None:
        self._nonces: dict[tuple[str, int], dict[str, float]] = {}  # (engine id, epoch) -> nonce -> deadline (s)
        self._epochs: dict[str, int] = {}  # engine id -> its newest epoch recorded
        self._by_deadline: list[tuple[float, str, int, str]] = []  # heap of (deadline, engine id, epoch, nonce)

    def __len__(self) -> int:
        return sum(len(nonces) for nonces in self._nonces.values())

    def consumed(self, ticket: kv_pb2.TransferTicket) -> bool:
        return ticket.notify_nonce in self._nonces.get((ticket.engine_id, ticket.epoch), {})

    def consume(self, tickets: Sequence[kv_pb2.TransferTicket], now: float) -> None:
        """Record ``tickets`` as pulled, all or none: a ``TicketError`` (``replayed``) when one already was (or
        two are the same ticket). ``now``: the reader's clock (s), to drop what is past its deadline first."""
        self.prune(now)
        seen: set[tuple[str, int, str]] = set()
        for t in tickets:
            key = (t.engine_id, t.epoch, t.notify_nonce)
            if self.consumed(t) or key in seen:
                raise TicketError(f"ticket for request {t.request_id!r} (engine {t.engine_id}, epoch {t.epoch}) was "
                                  "pulled before: its blocks may hold another request's KV now", reason="replayed")
            seen.add(key)
        for t in tickets:
            if t.epoch > self._epochs.get(t.engine_id, -1):
                old = self._epochs.get(t.engine_id)
                if old is not None:
                    self._nonces.pop((t.engine_id, old), None)
                self._epochs[t.engine_id] = t.epoch
            deadline = t.lease_deadline_unix_ms / 1000
            self._nonces.setdefault((t.engine_id, t.epoch), {})[t.notify_nonce] = deadline
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
    """A reader's checks of each ticket it is about to pull (the module docstring), with its record of the tickets
    it pulled. ``clock``: wall time (s), compared with the owner's deadlines."""

    def __init__(self, margin_s: float = DEADLINE_MARGIN_S, clock: Callable[[], float] = time.time) -> None:
        self.margin_s = margin_s
        self.clock = clock
        self.consumed = ConsumedTickets()

    def admit(self, tickets: Sequence[kv_pb2.TransferTicket], prompt_hash: bytes) -> None:
        """Check ``tickets`` (signed: ``KVPuller.pull`` verified them) for the prompt hashed ``prompt_hash`` and
        record them as pulled; a ``TicketError`` naming the first refusal, and then none is recorded."""
        now = self.clock()
        for t in tickets:
            if not (t.prompt_hash and t.lease_deadline_unix_ms):
                raise TicketError(f"ticket for request {t.request_id!r} names no lease deadline or prompt: its owner "
                                  f"{t.engine_id} predates them", reason="unbound")
            if names_another_prompt(t, prompt_hash):
                raise TicketError(f"ticket for request {t.request_id!r} was issued for another prompt",
                                  reason="prompt_mismatch")
            left_s = t.lease_deadline_unix_ms / 1000 - now
            if left_s <= self.margin_s:
                raise TicketError(f"ticket for request {t.request_id!r} is past its lease ({left_s:.2f} s left, "
                                  f"refused under {self.margin_s:g} s): its owner may free its blocks",
                                  reason="expired")
        self.consumed.consume(tickets, now)
