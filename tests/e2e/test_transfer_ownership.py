"""Tickets and notifications that name blocks their sender does not own are refused and counted, with real
daemons: a decode worker refuses a ticket the prefill worker did not sign (and prefills the prompt itself);
a prefill worker ignores NIXL notifications from a real agent that name its pending request without the
ticket's nonce, and frees the blocks only on the real one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from services.kv.nixl.agent import TransferAgent
from services.kv.spec.description import PROTOCOL_VERSION
from services.kv.spec.wire import notification_key
from services.proto_gen.pdserve.v1 import kv_pb2, kv_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import Stack, info, metric_total, stack

pytestmark = pytest.mark.slow

PROMPT = list(range(20, 57))
GREEDY = worker_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return str(directory)


@pytest.fixture(scope="module")
def served(model: str) -> Iterator[Stack]:
    """One 1P1D stack for both tests: each checks what it adds to the counters and leaves nothing pinned."""
    with stack(model) as s:
        yield s


def _prefill(address: str, request_id: str) -> worker_pb2.PrefillResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(
            worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=PROMPT, params=GREEDY,
                                      reader_tp_size=1), timeout=60)


def _refused(daemon, kind: str) -> float:
    return metric_total(daemon, "pdserve_kv_refused_total", f'kind="{kind}"')


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_unsigned_ticket_is_refused_counted_and_recomputed(served: Stack) -> None:
    s = served
    prefill, decode = s.prefill[0], s.decode[0]
    refused = _refused(decode, "ticket")
    signature = metric_total(decode, "pdserve_kv_refused_total", 'reason="signature"')
    genuine = _prefill(prefill.address, "genuine")
    with grpc.insecure_channel(decode.address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        reference = [t for c in stub.Generate(worker_pb2.GenerateRequest(
            request_id="genuine", prompt_token_ids=PROMPT, params=GREEDY, ticket=genuine.ticket)) for t in
            c.token_ids]
        assert _refused(decode, "ticket") == refused
        held = _prefill(prefill.address, "victim")  # another request's blocks, pinned on the prefill worker
        forged = worker_pb2.GenerateRequest(request_id="forger", prompt_token_ids=PROMPT, params=GREEDY,
                                            ticket=held.ticket)
        forged.ticket.request_id = "forger"  # claims the victim's blocks as its own: the signature breaks
        chunks = list(stub.Generate(forged))
    assert chunks[0].recomputed_locally  # served, but nothing of the victim's was read
    assert [t for c in chunks for t in c.token_ids] == reference
    assert metric_total(decode, "pdserve_kv_refused_total", 'reason="signature"') == signature + 1
    assert info(prefill).kv_blocks_pinned > 0  # the victim's blocks are still held for their real reader
    with grpc.insecure_channel(prefill.address) as channel:
        worker_pb2_grpc.PrefillWorkerStub(channel).Release(worker_pb2.ReleaseRequest(request_id="victim"))
    assert _wait(lambda: info(prefill).kv_blocks_pinned == 0)


def test_notifications_without_the_ticket_nonce_free_nothing(served: Stack) -> None:
    prefill = served.prefill[0]
    refused = _refused(prefill, "notification")
    ticket = _prefill(prefill.address, "held").ticket
    pinned = info(prefill).kv_blocks_pinned
    assert pinned > 0 and ticket.notify_nonce
    with grpc.insecure_channel(prefill.address) as channel:
        description = kv_pb2_grpc.KVHandshakeStub(channel).Handshake(
            kv_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, reader_engine_id="rogue"), timeout=10)
    with TransferAgent(f"rogue-{time.time_ns()}") as rogue:
        (local,) = rogue.register([torch.zeros(64, dtype=torch.uint8)])
        peer = rogue.add_peer(description.ranks[0].agent_metadata)
        # A real READ of the owner's memory first (any agent with the handshake may read: the blocks are
        # registered), then the notifications a reader would send when it is done.
        remote = description.ranks[0].regions[0]
        asyncio.run(rogue.read(peer, [(local.addr, 64, 0)], [(remote.address, 64, remote.device_id)],
                               timeout_s=10))
        for forged in (notification_key("held", False), notification_key("held", False, "0" * 16),
                       notification_key("other", False, ticket.notify_nonce)):
            rogue.send_notification(peer, forged)
        assert _wait(lambda: _refused(prefill, "notification") == refused + 3)
        assert info(prefill).kv_blocks_pinned == pinned  # nothing was freed
        # The ticket's own key (what its reader sends after the READ) frees the blocks.
        rogue.send_notification(peer, notification_key("held", False, ticket.notify_nonce))
        assert _wait(lambda: info(prefill).kv_blocks_pinned == 0)
