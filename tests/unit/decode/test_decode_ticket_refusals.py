"""What the decode worker's policy does with a ticket that may not be read (``services.kv.reader.tickets``), without
gRPC or NIXL: each ticket is taken as it arrives, through the real checks. One of another prompt is bad input
before anything is reserved (its first token is that prompt's); one taken before, or one the pull refuses past its
lease, is a failed pull: counted by reason, its reservation dropped, the prompt recomputed with the ticket's first
token, or PullRequired under ``require_pull``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from services.decode.pull_policy import PullRequired, StartedRequest
from services.kv.reader.errors import TicketError
from services.kv.reader.tickets import TicketChecks
from services.kv.spec.wire import prompt_hash
from services.proto_gen.pdserve.v1 import kv_pb2
from tests.unit.decode.test_decode_pull_policy import (
    PARAMS,
    PROMPT,
    FakeEngine,
    FakePuller,
    _assert_recomputed,
    _parts,
    _policy,
    _ticket,
    _value,
)

OTHER = [*PROMPT[:-1], PROMPT[-1] + 1]  # the same length, one token apart


class CheckingPuller(FakePuller):
    """A fake pull behind the real ticket checks: ``take`` is ``TicketChecks.take``."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__(error)
        self.checks = TicketChecks()

    def take(self, tickets: Sequence[kv_pb2.TransferTicket], digest: bytes) -> None:
        self.checks.take(tickets, digest)
        super().take(tickets, digest)


def _bound(ticket: kv_pb2.TransferTicket, prompt: list[int] = PROMPT, lease_s: float = 30.0,
           nonce: str = "n") -> kv_pb2.TransferTicket:
    """The ticket as an owner binds it: a nonce, its lease's end, its prompt's hash."""
    ticket.notify_nonce = nonce
    ticket.lease_deadline_unix_ms = int((time.time() + lease_s) * 1000)
    ticket.prompt_hash = prompt_hash(prompt)
    return ticket


async def _aiter(items):
    for item in items:
        yield item
        await asyncio.sleep(0.005)  # one part at a time


def _bound_parts(prompts: Sequence[list[int]] = (PROMPT, PROMPT, PROMPT)) -> list[kv_pb2.TransferTicket]:
    return [_bound(t, p, nonce=f"part{i}") for i, (t, p) in enumerate(zip(_parts(2, 4, 5), prompts, strict=True))]


def test_each_ticket_is_taken_once_for_its_prompt_and_then_pulled() -> None:
    engine, puller = FakeEngine(), CheckingPuller()
    policy, metrics = _policy(engine, puller)
    assert asyncio.run(policy.start("r", PROMPT, PARAMS, _bound(_ticket()))) == StartedRequest()
    asyncio.run(policy.start_parts("p", PROMPT, PARAMS, _aiter([_rid(t, "p") for t in _bound_parts()])))
    assert puller.taken == [("r", 5, prompt_hash(PROMPT)), ("p", 2, prompt_hash(PROMPT)),
                            ("p", 4, prompt_hash(PROMPT)), ("p", 5, prompt_hash(PROMPT))]
    assert len(puller.pulls) == 4 and engine.added == []
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason="replayed") == 0


def _rid(ticket: kv_pb2.TransferTicket, rid: str) -> kv_pb2.TransferTicket:
    ticket.request_id = rid
    return ticket


@pytest.mark.parametrize("require_pull", [False, True])
def test_a_ticket_of_another_prompt_is_refused_before_anything_is_reserved(require_pull: bool) -> None:
    engine, puller = FakeEngine(), CheckingPuller()
    policy, metrics = _policy(engine, puller)
    with pytest.raises(ValueError, match="issued for another prompt") as refused:
        asyncio.run(policy.start("r", PROMPT, PARAMS, _bound(_ticket(), OTHER), require_pull=require_pull))
    assert isinstance(refused.value, TicketError) and refused.value.reason == "prompt_mismatch"
    assert engine.reservations == [] and puller.pulls == [] and engine.added == []
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason="prompt_mismatch") == 1
    assert _value(metrics, "pdserve_local_recompute_fallbacks_total") == 0
    # Refused, it was not taken: the same ticket with its own prompt is still good.
    assert asyncio.run(policy.start("r", OTHER, PARAMS, _bound(_ticket(), OTHER))) == StartedRequest()


@pytest.mark.parametrize("require_pull", [False, True])
def test_a_ticket_taken_before_is_refused_whatever_came_of_it(require_pull: bool) -> None:
    """Taken once, it is never taken again: after its pull, and after a first use that never pulled it (no room:
    the router released its blocks). Refused before anything is reserved; recomputed with its first token."""
    engine, puller = FakeEngine(refusals=10**6), CheckingPuller()
    policy, metrics = _policy(engine, puller, reserve_timeout_s=0.02)
    ticket = _bound(_ticket())
    _assert_recomputed(asyncio.run(policy.start("r", PROMPT, PARAMS, ticket)), engine, metrics)  # no room
    assert puller.pulls == []
    engine = FakeEngine()
    policy.engine = engine
    if require_pull:
        with pytest.raises(PullRequired, match="taken before"):
            asyncio.run(policy.start("r", PROMPT, PARAMS, ticket, require_pull=True))
        assert engine.added == []
    else:
        started = asyncio.run(policy.start("r", PROMPT, PARAMS, ticket))
        assert started.recomputed_locally and engine.added[0][1] == [*PROMPT, ticket.first_token_id]
    assert engine.reservations == [] and puller.pulls == []
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason="replayed") == 1


@pytest.mark.parametrize("reason", ["unbound", "expired"])
def test_a_ticket_without_a_binding_or_past_its_lease_is_recomputed(reason: str) -> None:
    engine, puller = FakeEngine(), CheckingPuller()
    policy, metrics = _policy(engine, puller)
    ticket = _bound(_ticket(), lease_s=0.5)  # within the reader's margin of its deadline already
    if reason == "unbound":
        ticket = _ticket()  # an owner that predates deadlines and prompt hashes
    _assert_recomputed(asyncio.run(policy.start("r", PROMPT, PARAMS, ticket)), engine, metrics)
    assert engine.reservations == [] and puller.pulls == []
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason=reason) == 1


def test_a_ticket_the_pull_refuses_past_its_lease_drops_the_reservation() -> None:
    """Taken in time, it ran out while this worker waited for room: the pull refuses it (after the signature, before
    any READ) and the reservation is dropped, as after any failed pull."""
    engine = FakeEngine()
    policy, metrics = _policy(engine, FakePuller(error=TicketError("past its lease", reason="expired")))
    _assert_recomputed(asyncio.run(policy.start("r", PROMPT, PARAMS, _bound(_ticket()))), engine, metrics)
    assert engine.aborted == ["r"] and engine.completed == []
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason="expired") == 1
    assert _value(metrics, "pdserve_kv_transfer_failures_total") == 1


def test_a_part_taken_before_recomputes_from_the_last_parts_first_token() -> None:
    engine, puller = FakeEngine(), CheckingPuller()
    policy, metrics = _policy(engine, puller)
    tickets = _bound_parts()
    puller.checks.take(tickets[1:2], prompt_hash(PROMPT))  # the second part was taken before
    started = asyncio.run(policy.start_parts("r", PROMPT, PARAMS, _aiter(tickets)))
    _assert_recomputed(started, engine, metrics)
    assert [p for pull in puller.parts for p in pull] == [(0, 2)] and engine.aborted == ["r"]
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason="replayed") == 1
    assert puller.checks.consumed.entry(tickets[2]) is not None  # the parts after the failure are taken too


@pytest.mark.parametrize("require_pull", [False, True])
def test_a_part_of_another_prompt_is_bad_input_once_the_parts_are_read(require_pull: bool) -> None:
    """The second part names another prompt: it is not pulled, the reservation is dropped, the parts are read to the
    last (the call's status follows its input), and the request fails as bad input, recomputed from nothing."""
    engine, puller = FakeEngine(), CheckingPuller()
    policy, metrics = _policy(engine, puller)
    tickets = _bound_parts((PROMPT, OTHER, PROMPT))
    read: list[int] = []

    async def parts():
        for ticket in tickets:
            read.append(ticket.num_tokens)
            yield ticket
            await asyncio.sleep(0.01)

    with pytest.raises(ValueError, match="issued for another prompt"):
        asyncio.run(policy.start_parts("r", PROMPT, PARAMS, parts(), require_pull=require_pull))
    assert read == [2, 4, 5]
    assert [p for pull in puller.parts for p in pull] == [(0, 2)]  # the first part only
    assert engine.aborted == ["r"] and engine.added == [] and engine.completed == []
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason="prompt_mismatch") == 1
    assert _value(metrics, "pdserve_local_recompute_fallbacks_total") == 0
