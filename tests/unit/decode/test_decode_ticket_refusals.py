"""What the decode worker's policy does with a ticket that may not be read (``services.kv.pull_tickets``), without
gRPC or NIXL: one of another prompt is bad input before anything is reserved (its first token is that prompt's);
one the puller refuses (expired, replayed, unbound) is a failed pull: counted by reason, its reservation dropped,
the prompt recomputed with the ticket's first token, or PullRequired under ``require_pull``."""

from __future__ import annotations

import asyncio

import pytest

from services.decode.pull_policy import PullRequired
from services.kv.pull_errors import TicketError
from services.kv.wire import prompt_hash
from tests.unit.decode.test_decode_pull_policy import (
    PARAMS,
    PROMPT,
    FakeEngine,
    FakePuller,
    _aiter,
    _assert_recomputed,
    _parts,
    _policy,
    _ticket,
    _value,
)

OTHER = [*PROMPT[:-1], PROMPT[-1] + 1]  # the same length, one token apart


def test_the_pull_is_given_the_prompts_hash_computed_once() -> None:
    engine, puller = FakeEngine(), FakePuller()
    policy, _ = _policy(engine, puller)
    ticket = _ticket()
    ticket.prompt_hash = prompt_hash(PROMPT)
    asyncio.run(policy.start("r", PROMPT, PARAMS, ticket))
    asyncio.run(policy.start_parts("r", PROMPT, PARAMS, _aiter(_parts(2, 5))))  # "r" finished: its id is free
    assert len(puller.prompt_hashes) >= 2 and set(puller.prompt_hashes) == {prompt_hash(PROMPT)}


@pytest.mark.parametrize("require_pull", [False, True])
def test_a_ticket_of_another_prompt_is_refused_before_anything_is_reserved(require_pull: bool) -> None:
    engine, puller = FakeEngine(), FakePuller()
    policy, metrics = _policy(engine, puller)
    ticket = _ticket()
    ticket.prompt_hash = prompt_hash(OTHER)
    with pytest.raises(ValueError, match="issued for another prompt") as refused:
        asyncio.run(policy.start("r", PROMPT, PARAMS, ticket, require_pull=require_pull))
    assert isinstance(refused.value, TicketError) and refused.value.reason == "prompt_mismatch"
    assert engine.reservations == [] and puller.pulls == [] and engine.added == []
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason="prompt_mismatch") == 1
    assert _value(metrics, "pdserve_local_recompute_fallbacks_total") == 0


@pytest.mark.parametrize("reason", ["expired", "replayed", "unbound"])
def test_a_ticket_the_puller_refuses_is_recomputed_with_its_first_token(reason: str) -> None:
    engine = FakeEngine()
    policy, metrics = _policy(engine, FakePuller(error=TicketError(f"refused: {reason}", reason=reason)))
    started = asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket()))
    assert engine.aborted == ["r"] and engine.completed == []  # the reservation is dropped, nothing was read
    _assert_recomputed(started, engine, metrics)
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason=reason) == 1
    assert _value(metrics, "pdserve_kv_transfer_bytes_total") == 0
    # Strict disaggregation: the same refusal fails the request instead, nothing prefilled here.
    engine = FakeEngine()
    policy, metrics = _policy(engine, FakePuller(error=TicketError(f"refused: {reason}", reason=reason)))
    with pytest.raises(PullRequired, match=reason):
        asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket(), require_pull=True))
    assert engine.aborted == ["r"] and engine.added == []
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason=reason) == 1


def test_a_part_the_puller_refuses_recomputes_from_the_last_parts_first_token() -> None:
    engine = FakeEngine()
    policy, metrics = _policy(engine, FakePuller(error=TicketError("refused: replayed", reason="replayed")))
    started = asyncio.run(policy.start_parts("r", PROMPT, PARAMS, _aiter(_parts(2, 5))))
    _assert_recomputed(started, engine, metrics)
    assert engine.aborted == ["r"]
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason="replayed") == 1


@pytest.mark.parametrize("require_pull", [False, True])
def test_a_part_of_another_prompt_is_bad_input_once_the_parts_are_read(require_pull: bool) -> None:
    """The second part names another prompt: it is not pulled, the reservation is dropped, the parts are read to the
    last (the call's status follows its input), and the request fails as bad input, recomputed from nothing."""
    engine, puller = FakeEngine(), FakePuller()
    policy, metrics = _policy(engine, puller)
    tickets = _parts(2, 4, 5)
    for i, ticket in enumerate(tickets):
        ticket.prompt_hash = prompt_hash(OTHER if i == 1 else PROMPT)
    read: list[int] = []

    async def parts():
        for ticket in tickets:
            read.append(ticket.num_tokens)
            yield ticket
            await asyncio.sleep(0.01)

    with pytest.raises(ValueError, match="of another prompt"):
        asyncio.run(policy.start_parts("r", PROMPT, PARAMS, parts(), require_pull=require_pull))
    assert read == [2, 4, 5]
    assert [p for pull in puller.parts for p in pull] == [(0, 2)]  # the first part only
    assert engine.aborted == ["r"] and engine.added == [] and engine.completed == []
    assert _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason="prompt_mismatch") == 1
    assert _value(metrics, "pdserve_local_recompute_fallbacks_total") == 0
