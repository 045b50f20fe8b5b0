"""Tickets bound to their lease and prompt: the owner's deadline and prompt hash (``KVExporter.hand_out``), the
reader's checks as a ticket arrives and before its READs (``services.kv.reader.tickets``), and its record of the
tickets it took."""

from __future__ import annotations

import asyncio
import hashlib
import struct

import pytest

from services.kv.owner.exporter import KVExporter
from services.kv.reader.errors import TicketError
from services.kv.reader.tickets import DEADLINE_MARGIN_S, ConsumedTickets, TicketChecks, names_another_prompt
from services.kv.spec.compat import KVIdentity
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, LayoutKind
from services.kv.spec.wire import notification_key, prompt_hash
from services.proto_gen.pdserve.v1 import kv_pb2
from tests.unit.kv.test_kv_digest import TensorRank, make

PROMPT = [5, 6, 7, 8, 9, 300_000, 2**32 - 1]
NOW = 1_700_000_000.0  # the reader's wall clock in these tests


def _ticket(nonce: str = "n1", *, engine: str = "owner", epoch: int = 1, deadline: float = NOW + 30,
            prompt: list[int] = PROMPT) -> kv_pb2.TransferTicket:
    return kv_pb2.TransferTicket(engine_id=engine, epoch=epoch, request_id="r", notify_nonce=nonce,
                                 lease_deadline_unix_ms=int(deadline * 1000), prompt_hash=prompt_hash(prompt))


def _checks(now: float = NOW) -> TicketChecks:
    return TicketChecks(clock=lambda: now)


def _refusal(checks: TicketChecks, tickets, digest: bytes = prompt_hash(PROMPT)) -> str:
    with pytest.raises(TicketError) as refused:
        checks.take(tickets, digest)
    return refused.value.reason


def test_the_prompt_hash_is_sha256_of_little_endian_uint32_ids() -> None:
    assert prompt_hash(PROMPT) == hashlib.sha256(struct.pack(f"<{len(PROMPT)}I", *PROMPT)).digest()
    assert prompt_hash([]) == hashlib.sha256(b"").digest()
    assert prompt_hash([1, 2]) != prompt_hash([2, 1])
    for bad in ([-1], [2**32]):
        with pytest.raises(ValueError, match="uint32"):
            prompt_hash(bad)


def test_a_ticket_is_refused_for_another_prompt_past_its_lease_or_without_either() -> None:
    checks = _checks()
    other = [*PROMPT[:-1], 4]  # the same length, one token apart
    assert names_another_prompt(_ticket(), prompt_hash(other)) and not names_another_prompt(_ticket(),
                                                                                              prompt_hash(PROMPT))
    assert _refusal(checks, [_ticket()], prompt_hash(other)) == "prompt_mismatch"
    assert _refusal(checks, [_ticket(deadline=NOW - 1)]) == "expired"
    # Refused from DEADLINE_MARGIN_S before the deadline (the owner's clock may be ahead, the READ must land).
    assert _refusal(checks, [_ticket(deadline=NOW + DEADLINE_MARGIN_S)]) == "expired"
    unbound = _ticket()
    unbound.ClearField("prompt_hash")
    assert _refusal(checks, [unbound]) == "unbound"
    assert not names_another_prompt(unbound, prompt_hash(other))  # the policy leaves it to the puller
    unbound = _ticket()
    unbound.ClearField("lease_deadline_unix_ms")
    assert _refusal(checks, [unbound]) == "unbound"
    assert len(checks.consumed) == 0  # nothing refused was recorded
    checks.take([_ticket(deadline=NOW + DEADLINE_MARGIN_S + 0.1)], prompt_hash(PROMPT))  # just in time
    assert len(checks.consumed) == 1


def test_a_ticket_is_taken_once_and_parts_all_or_none() -> None:
    checks = _checks()
    checks.take([_ticket("a")], prompt_hash(PROMPT))
    assert _refusal(checks, [_ticket("a")]) == "replayed"
    # The same nonce under another engine or epoch is another ticket.
    checks.take([_ticket("a", engine="other"), _ticket("a", epoch=2)], prompt_hash(PROMPT))
    # A batch of parts with one already pulled records none of the others.
    assert _refusal(checks, [_ticket("b"), _ticket("c"), _ticket("a", epoch=2)]) == "replayed"
    assert checks.consumed.entry(_ticket("b")) is None and checks.consumed.entry(_ticket("c")) is None
    assert _refusal(checks, [_ticket("d"), _ticket("d")]) == "replayed"  # one ticket twice in one pull
    checks.take([_ticket("b"), _ticket("c")], prompt_hash(PROMPT))
    assert all(checks.consumed.entry(_ticket(n)).prompt_hash == prompt_hash(PROMPT) for n in "bc")


def test_a_pull_is_of_taken_tickets_inside_their_lease() -> None:
    """Right before the READs (the signature verified): the ticket was taken, for the prompt it names, and its
    deadline is still more than the margin away (taking it and reserving blocks may have taken a while)."""
    now = [NOW]
    checks = TicketChecks(clock=lambda: now[0])
    ticket = _ticket(deadline=NOW + 10)
    with pytest.raises(ValueError, match="without being taken"):
        checks.check_pull([ticket])
    checks.take([ticket], prompt_hash(PROMPT))
    checks.check_pull([ticket])
    with pytest.raises(TicketError) as refused:  # taken once, pulled once
        checks.check_pull([ticket])
    assert refused.value.reason == "replayed"
    ticket = _ticket("fresh", deadline=NOW + 10)
    checks.take([ticket], prompt_hash(PROMPT))
    with pytest.raises(TicketError) as refused:  # one ticket twice in one pull: neither is marked pulled
        checks.check_pull([ticket, ticket])
    assert refused.value.reason == "replayed" and not checks.consumed.entry(ticket).pulled
    altered = kv_pb2.TransferTicket()
    altered.CopyFrom(ticket)
    altered.prompt_hash = prompt_hash([1, 2, 3])  # a copy of its nonce for another prompt, signed by a buggy owner
    with pytest.raises(TicketError) as refused:
        checks.check_pull([altered])
    assert refused.value.reason == "prompt_mismatch"
    now[0] = NOW + 10 - DEADLINE_MARGIN_S
    with pytest.raises(TicketError) as refused:
        checks.check_pull([ticket])
    assert refused.value.reason == "expired"
    now[0] = NOW + 11  # the record dropped it past its deadline: still refused as expired, not as untaken
    checks.consumed.prune(now[0])
    with pytest.raises(TicketError) as refused:
        checks.check_pull([ticket])
    assert refused.value.reason == "expired"


def test_the_record_keeps_each_ticket_until_its_deadline_and_one_epoch_per_engine() -> None:
    record = ConsumedTickets()
    record.consume([_ticket("early", deadline=NOW + 5), _ticket("late", deadline=NOW + 50)])
    record.consume([_ticket("other", engine="e2", deadline=NOW + 50)])
    assert len(record) == 3
    record.prune(NOW + 5)  # past the first deadline, when the deadline check refuses it anyway
    assert len(record) == 2 and not _has(record, _ticket("early")) and _has(record, _ticket("late"))
    # A newer epoch of an engine drops the older epoch's record (the peer cache refuses its tickets as stale).
    record.prune(NOW + 6)
    record.consume([_ticket("new", epoch=2, deadline=NOW + 50)])
    assert not _has(record, _ticket("late")) and _has(record, _ticket("new", epoch=2))
    assert _has(record, _ticket("other", engine="e2")) and len(record) == 2
    # Bounded by the tickets of one lease: a steady stream, pruned before each take as TicketChecks.take does,
    # leaves at most a lease's worth recorded.
    for i in range(1000):
        record.prune(NOW + i / 10)
        record.consume([_ticket(f"s{i}", epoch=2, deadline=NOW + 10 + i / 10)])
    assert len(record) <= 10 * 10 + 2
    record.prune(NOW + 1000)
    assert len(record) == 0 and not record._by_deadline


def _has(record: ConsumedTickets, ticket: kv_pb2.TransferTicket) -> bool:
    return record.entry(ticket) is not None


def _exporter(clock, lease_s: float = 30.0) -> KVExporter:
    groups = (KVCacheGroupSpec(0, AttentionKind.FULL, (0,), 4),)
    layout, buffers = make(LayoutKind.PER_LAYER, BlockOrder.NHD, groups, num_blocks=8)
    identity = KVIdentity.of(architecture="llama", num_layers=1, num_kv_heads=2, head_dim=8, layout=layout,
                             kv_digest="off")
    return KVExporter(engine_id="owner", model_name="m", identity=identity, ranks=[TensorRank(layout, buffers)],
                      lease_s=lease_s, clock=clock)


def test_the_owner_signs_each_ticket_with_its_lease_end_and_the_whole_prompts_hash() -> None:
    now = [NOW]
    exporter = _exporter(lambda: now[0], lease_s=30.0)
    digest = prompt_hash(list(range(12)))

    def part(start: int, end: int) -> kv_pb2.TransferTicket:
        return asyncio.run(exporter.hand_out("p", [[0, 1, 2]], num_tokens=end, first_token_id=1, handshake_address="x",
                                             reader_tp_size=1, prompt_hash=digest, part_start_token=start,
                                             num_prompt_tokens=12))

    whole = asyncio.run(exporter.hand_out("w", [[0, 1]], num_tokens=7, first_token_id=1, handshake_address="x",
                                          reader_tp_size=1, prompt_hash=digest))
    assert (whole.lease_deadline_unix_ms, whole.prompt_hash) == ((NOW + 30) * 1000, digest)
    first = part(0, 4)
    now[0] += 10
    # The first part is unread: its lease, when it runs out, frees the whole request, so it bounds the second's.
    second = part(4, 8)
    assert first.lease_deadline_unix_ms == second.lease_deadline_unix_ms == (NOW + 30) * 1000
    assert first.notify_nonce != second.notify_nonce and first.prompt_hash == second.prompt_hash == digest
    # Once the first part was read, the second's own lease (from NOW + 10) is the earliest left to run out.
    exporter.released([{"reader": [notification_key("p", False, first.notify_nonce)]}])
    now[0] += 5
    third = part(8, 12)
    assert third.lease_deadline_unix_ms == (NOW + 40) * 1000
    exporter.released([{"reader": [notification_key("p", False, second.notify_nonce)]}])
    assert exporter.released([{"reader": [notification_key("p", False, third.notify_nonce)]}]) == ["p"]
    assert "p" not in exporter._lease_ends  # nothing kept once released
    with pytest.raises(ValueError, match="32 bytes"):
        asyncio.run(exporter.hand_out("x", [[0]], num_tokens=3, first_token_id=1, handshake_address="x",
                                      reader_tp_size=1, prompt_hash=b"short"))
    with pytest.raises(ValueError, match="lease_s"):
        _exporter(lambda: NOW, lease_s=0)


def test_a_parts_deadline_is_the_earliest_lease_end_among_the_unread_parts_read_in_any_order() -> None:
    """Parts read out of order: one read after the first stays in the request's record until it is the first (a
    read part's lease frees nothing), and the record keeps only what is unread from the front on."""
    now = [NOW]
    exporter = _exporter(lambda: now[0], lease_s=30.0)
    digest = prompt_hash(list(range(20)))

    def part(start: int, end: int) -> kv_pb2.TransferTicket:
        ticket = asyncio.run(exporter.hand_out("p", [[0, 1, 2, 3, 4]], num_tokens=end, first_token_id=1,
                                               handshake_address="x", reader_tp_size=1, prompt_hash=digest,
                                               part_start_token=start, num_prompt_tokens=20))
        now[0] += 10
        return ticket

    def read(ticket: kv_pb2.TransferTicket) -> list[str]:
        return exporter.released([{"reader": [notification_key("p", False, ticket.notify_nonce)]}])

    first, second, third = part(0, 4), part(4, 8), part(8, 12)
    read(second)
    fourth = part(12, 16)  # the first is unread: its lease bounds every later part's
    assert fourth.lease_deadline_unix_ms == third.lease_deadline_unix_ms == first.lease_deadline_unix_ms
    assert first.lease_deadline_unix_ms == (NOW + 30) * 1000
    read(first)  # the earliest unread is now the third (issued at NOW + 20): the second was read before
    fifth = part(16, 20)
    assert fifth.lease_deadline_unix_ms == (NOW + 20 + 30) * 1000
    assert list(exporter._lease_ends["p"]) == [third.notify_nonce, fourth.notify_nonce, fifth.notify_nonce]
    for ticket in (fourth, third):
        assert read(ticket) == []
    assert read(fifth) == ["p"] and "p" not in exporter._lease_ends
