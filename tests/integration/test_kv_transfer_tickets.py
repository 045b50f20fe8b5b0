"""Tickets that cannot be replayed or mixed up: a real owner process, this (reader) process, real NIXL READs.

The KV digest is off on both sides (``--no-kv-digest``'s case), so nothing but the ticket checks
(``services.kv.reader.tickets``) stands between the reader and blocks that hold another request's KV by now.
Every refusal comes before any READ: the reader's KV still holds its sentinel afterwards.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.kv_synthetic import prompt_of
from services.kv.reader.errors import TicketError
from services.kv.reader.tickets import DEADLINE_MARGIN_S
from services.kv.spec.wire import prompt_hash
from services.proto_gen.pdserve.v1 import kv_pb2
from tests.integration.test_kv_transfer import (
    BASE,
    SENTINEL,
    Reader,
    _request,
    check_received,
    owner_process,
    reader,
)

OFF = {**BASE, "kv_digest": "off"}
LOCAL_IDS = [[5, 6, 7]]  # 12 tokens in blocks of 4


def _owner_cfg(name: str, requests: list[dict], **over) -> dict:
    return {**OFF, "engine_id": f"owner-tickets-{name}", "tp": 1, "reader_tp": 1, "requests": requests, **over}


def _untouched(r: Reader) -> bool:
    return all(bool((b == SENTINEL).all()) for b in r.caches[0].buffers)


def _refusal(call) -> str:
    with pytest.raises(TicketError) as refused:
        call()
    return refused.value.reason


def _reset(r: Reader) -> None:
    for b in r.caches[0].buffers:
        b.fill_(SENTINEL)


def test_a_ticket_is_read_once_and_never_after_its_blocks_are_released() -> None:
    request = _request("a", 12, 4, 0, shuffle=False)
    digest = prompt_hash(prompt_of(request))
    cfg = _owner_cfg("replay", [request])
    with owner_process(cfg) as owner, reader(OFF, 1, check_tickets=True) as r:
        ticket = owner.tickets["a"]
        r.puller.take([ticket], digest)
        asyncio.run(r.puller.pull(ticket, LOCAL_IDS))
        check_received(cfg, r, ticket, LOCAL_IDS, [0])
        owner.wait_released("a")  # every reader notified: the owner freed the blocks, another request may hold them
        _reset(r)
        # Sent again (a replayed Generate): refused as it arrives, before anything is reserved or read ...
        assert _refusal(lambda: r.puller.take([ticket], digest)) == "replayed"
        # ... and a pull of it, taken or not, reads nothing: each ticket is pulled once.
        assert _refusal(lambda: asyncio.run(r.puller.pull(ticket, LOCAL_IDS))) == "replayed"
        assert _untouched(r)


def test_a_genuine_ticket_of_another_prompt_is_refused_before_anything_is_read() -> None:
    """A ticket of prompt Y sent with prompt X of the same length: refused as it arrives, and not taken, so Y's own
    request still reads it. Its prompt hash is signed: a copy of another ticket naming X's hash is refused by its
    signature before any READ."""
    y = [(7 * i + 3) % 300 for i in range(12)]
    x = [*y[:-1], y[-1] + 1]
    requests = [{**_request(rid, 12, 4, first, shuffle=False), "prompt": y} for rid, first in (("y", 0), ("y2", 3))]
    cfg = _owner_cfg("prompt", requests)
    with owner_process(cfg) as owner, reader(OFF, 1, check_tickets=True) as r:
        ticket = owner.tickets["y"]
        assert ticket.prompt_hash == prompt_hash(y) != prompt_hash(x)
        assert _refusal(lambda: r.puller.take([ticket], prompt_hash(x))) == "prompt_mismatch"
        forged = kv_pb2.TransferTicket()
        forged.CopyFrom(owner.tickets["y2"])
        forged.prompt_hash = prompt_hash(x)
        r.puller.take([forged], prompt_hash(x))  # its hash matches X now, but only its owner could sign that
        assert _refusal(lambda: asyncio.run(r.puller.pull(forged, LOCAL_IDS))) == "signature"
        assert _untouched(r)
        r.puller.take([ticket], prompt_hash(y))
        asyncio.run(r.puller.pull(ticket, LOCAL_IDS))
        check_received(cfg, r, ticket, LOCAL_IDS, [0])
        owner.wait_released("y")


def test_a_ticket_past_its_deadline_is_refused() -> None:
    """The owner's lease is 3 s: its tickets name that deadline, signed. A ticket taken in time is refused by its
    pull once the deadline is less than the margin away (reserving blocks may have waited); one that arrives
    later is refused as it arrives; a copy whose deadline was pushed back fails its signature. Nothing is read."""
    lease_s = 3.0
    requests = [_request("late", 12, 4, 0, shuffle=False), _request("later", 12, 4, 3, shuffle=False)]
    with owner_process(_owner_cfg("deadline", requests, lease_s=lease_s)) as owner, \
            reader(OFF, 1, check_tickets=True) as r:
        late, later = owner.tickets["late"], owner.tickets["later"]
        deadline_s = late.lease_deadline_unix_ms / 1000
        assert time.time() < deadline_s <= time.time() + lease_s
        r.puller.take([late], prompt_hash(prompt_of(requests[0])))  # in time
        time.sleep(max(0.0, deadline_s - DEADLINE_MARGIN_S - time.time()) + 0.05)
        assert _refusal(lambda: asyncio.run(r.puller.pull(late, LOCAL_IDS))) == "expired"
        assert _refusal(lambda: r.puller.take([later], prompt_hash(prompt_of(requests[1])))) == "expired"
        pushed = kv_pb2.TransferTicket()
        pushed.CopyFrom(later)
        pushed.lease_deadline_unix_ms += 60_000
        r.puller.take([pushed], prompt_hash(prompt_of(requests[1])))
        assert _refusal(lambda: asyncio.run(r.puller.pull(pushed, LOCAL_IDS))) == "signature"
        assert _untouched(r)
