"""A ticket's host-tier part, as the decode side plans it: split at ``num_host_tokens`` into a host READ
and a device READ, each from its own owner layout, and refused when forged (no NIXL needed: these are
the planning and checking steps ``KVPuller.pull`` runs before any READ)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from bench.kv_synthetic import identity_for, layout_for
from services.kv.reader.errors import TicketError
from services.kv.reader.puller import KVPuller
from services.kv.reader.ticket_shape import check_ticket
from services.kv.spec.compat import CompatInfo
from services.kv.spec.description import EngineDescription, RankExport
from services.kv.spec.wire import MemoryRegion, notification_key, notification_request
from services.proto_gen.pdserve.v1 import kv_pb2

CFG = dict(kind="cross_layer", order="NHD", num_blocks=24, num_kv_heads=2, head_dim=8, dtype="float16",
           num_layers=2, block_size=4, seed=1)
FACTOR = 2


def _regions(layout, base: int, kind: str) -> tuple[MemoryRegion, ...]:
    return tuple(MemoryRegion(b.index, base + 10**9 * b.index, b.num_bytes, 0, kind) for b in layout.buffers())


def _engine(host: bool) -> tuple[KVPuller, EngineDescription]:
    layout = layout_for(CFG, 1)
    host_layout = dataclasses.replace(layout, num_blocks=10 * FACTOR) if host else None
    owner = RankExport(0, "owner-tp0", b"", _regions(layout, 1 << 40, "DRAM"), layout, host_layout,
                       _regions(host_layout, 1 << 44, "DRAM") if host else ())
    identity = identity_for(CFG, layout)
    remote = EngineDescription("owner", 1, "m", 2, 2, 8, CompatInfo.of_identity(identity), layout.groups, (owner,))
    local = SimpleNamespace(layout=layout, regions=_regions(layout, 1 << 48, "DRAM"))
    return KVPuller(engine_id="reader", identity=identity, ranks=[local]), remote


def _ticket(num_tokens: int, num_host_tokens: int) -> kv_pb2.TransferTicket:
    ticket = kv_pb2.TransferTicket(engine_id="owner", epoch=1, request_id="r", num_tokens=num_tokens,
                                   num_host_tokens=num_host_tokens)
    ticket.groups.add(group_id=0, block_ids=list(range(10, 10 + -(-num_tokens // 4))))
    if num_host_tokens:
        ticket.host_groups.add(group_id=0, block_ids=list(range(4, 4 + num_host_tokens // 4)))
    return ticket


def test_a_host_tier_part_is_read_from_the_host_layout_and_the_rest_from_device_blocks() -> None:
    puller, remote = _engine(host=True)
    ticket = _ticket(num_tokens=22, num_host_tokens=16)
    reads = puller._reads_for(ticket, remote, [list(range(6))], num_cached_tokens=4)
    assert [read.host_tier for read in reads] == [True, False]  # one READ per source, host first
    host_read, device_read = reads
    owner = remote.ranks[0]
    page = owner.layout.block_bytes(0)
    # Host: tokens 4..15 (the reader held 0..3) = host blocks 5, 6, 7 -> local blocks 1, 2, 3, one run.
    assert host_read.remote_rows.tolist() == [[owner.host_regions[0].address + 5 * page, 3 * page, 0]]
    assert (host_read.num_bytes, host_read.num_descriptors) == (3 * page, 1)
    # Device: tokens 16..21 = owner blocks 14, 15 (the last padded) -> local 4, 5.
    assert device_read.remote_rows.tolist() == [[owner.regions[0].address + 14 * page, 2 * page, 0]]
    # Each source notifies under its own key, so the owner counts both of every reader.
    assert {notification_key("r", True), notification_key("r", False)} == {b"r/host", b"r"}
    assert notification_key("r", True, "ab12") == b"r#ab12/host"
    assert notification_request(b"r#ab12/host") == ("r", True) and notification_request(b"r#ab12") == ("r", False)
    # A client's request id may contain the separator itself: the nonce is what follows the last one.
    for request_id in ("cmpl-a#b", "x#y#z", "#"):
        for host in (False, True):
            assert notification_request(notification_key(request_id, host, "ab12")) == (request_id, host)


def test_a_reader_already_holding_the_host_part_still_sends_its_notification() -> None:
    puller, remote = _engine(host=True)
    ticket = _ticket(num_tokens=22, num_host_tokens=16)
    host_read, device_read = puller._reads_for(ticket, remote, [list(range(6))], num_cached_tokens=20)
    assert host_read.host_tier and len(host_read.local_rows) == 0 and host_read.num_bytes == 0  # notification only
    assert device_read.num_bytes > 0


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda t: setattr(t, "num_host_tokens", 30), "host tier of a 22-token prompt"),
    (lambda t: setattr(t, "num_host_tokens", 6), "ends inside a block"),
    (lambda t: t.host_groups[0].block_ids.__setitem__(0, 10**6), "host-tier block ids .* outside"),
    (lambda t: t.host_groups[0].block_ids.pop(), "host-tier blocks of 4 for 16 tokens"),
    (lambda t: t.host_groups.add(group_id=0, block_ids=[1]), "host-tier KV group 0 twice"),
])
def test_a_forged_host_tier_part_is_refused(mutate, message: str) -> None:
    puller, remote = _engine(host=True)
    ticket = _ticket(num_tokens=22, num_host_tokens=16)
    mutate(ticket)
    with pytest.raises(TicketError, match=message):
        check_ticket(ticket, remote, puller._ranks[0].layout, [list(range(6))])


def test_host_tier_part_from_an_owner_without_one_is_refused() -> None:
    puller, remote = _engine(host=False)
    with pytest.raises(TicketError, match="no host tier"):
        check_ticket(_ticket(num_tokens=22, num_host_tokens=16), remote, puller._ranks[0].layout, [list(range(6))])
    device_ids, host_ids, _ = check_ticket(_ticket(num_tokens=22, num_host_tokens=0), remote,
                                           puller._ranks[0].layout, [list(range(6))])
    assert host_ids is None and isinstance(device_ids[0], np.ndarray)
