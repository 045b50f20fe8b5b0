"""A ticket's signature: over everything but itself, and checking it leaves the ticket as it was."""

from __future__ import annotations

from services.kv.spec.wire import ticket_is_signed_by, ticket_signature
from services.proto_gen.pdserve.v1 import kv_pb2

KEY = b"k" * 32


def signed_ticket() -> kv_pb2.TransferTicket:
    ticket = kv_pb2.TransferTicket(
        engine_id="e", epoch=3, request_id="r", num_tokens=64, notify_nonce="0123456789abcdef",
        groups=[kv_pb2.GroupBlocks(group_id=0, block_ids=[7, 8, 9, 10])],
        digests=[kv_pb2.GroupDigests(group_id=0, reader_rank=0, unit=16, digests=[1, 2, 3, 4])])
    ticket.signature = ticket_signature(ticket, KEY)
    return ticket


def test_checking_a_signature_leaves_the_ticket_unchanged() -> None:
    ticket = signed_ticket()
    before = ticket.SerializeToString(deterministic=True)
    assert ticket_is_signed_by(ticket, KEY)
    assert ticket.SerializeToString(deterministic=True) == before and len(ticket.signature) == 32
    # The signature does not cover itself: signing the signed ticket again gives the same bytes.
    assert ticket_signature(ticket, KEY) == ticket.signature


def test_any_change_or_another_key_fails_the_check() -> None:
    for change in (lambda t: t.groups[0].block_ids.__setitem__(2, 99), lambda t: t.digests[0].digests.append(5),
                   lambda t: setattr(t, "num_tokens", 65), lambda t: setattr(t, "signature", b"x" * 32)):
        ticket = signed_ticket()
        change(ticket)
        assert not ticket_is_signed_by(ticket, KEY)
    assert not ticket_is_signed_by(signed_ticket(), b"j" * 32)
    assert not ticket_is_signed_by(signed_ticket(), b"")
