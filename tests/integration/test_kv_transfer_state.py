"""Granite-4.0-H (Mamba2 state layers beside attention) over real NIXL between processes: a prefill daemon computes
a prompt, this process pulls its KV and its per-request state into an engine of the other layout and block size.

The pulled state slot is byte for byte what a colocated engine of the prefill's configuration holds after the
prompt (the state after ALL prompt tokens, the convention the first token relies on), the attention KV likewise,
the pull moves the KV plus exactly one state slot, and decoding from them gives the colocated greedy tokens. Both
whole tickets (``Prefill``) and part tickets (``PrefillStream``, chunks of 8 tokens: only the last part carries the
state) are pulled; a ticket whose state was altered fails the state digest; nothing stays pinned or held after.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.contract.wire import sampling_to_proto
from services.engine.llm_engine import LLMEngine
from services.kv.nixl.agent import TransferAgent
from services.kv.ranks.kv_rank import LocalKVRank
from services.kv.reader.errors import KVIntegrityError, TicketError
from services.kv.reader.puller import KVPuller
from services.kv.spec.wire import prompt_hash, ticket_signature
from services.launch.spawn import daemons
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from services.worker.kv_ranks import kv_identity
from tests.integration.test_kv_parts import (
    CHUNK,
    GREEDY,
    LAYOUT_PAIRS,
    PREFILL_DEVICE,
    _engine,
    _prefill_args,
    _token_kv,
    _wait_for,
    decode_pulled,
)
from tests.unit.engine.test_granite_hybrid import make_granite_checkpoint


@pytest.fixture(scope="module")
def granite(tmp_path_factory) -> str:
    directory, _ = make_granite_checkpoint("rope", tmp_path_factory.mktemp("granite_rope"))
    return str(directory)


def _prompt(seed: int, n: int) -> list[int]:
    return [(37 * i + 11 * seed) % 300 + 3 for i in range(n)]


def _colocated(checkpoint: str, prompt: list[int], layout, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The prefill's configuration run colocated: the prompt's state slot and attention KV after its prefill, and
    its greedy tokens."""
    engine = _engine(checkpoint, layout, block_size, chunk=CHUNK, device=PREFILL_DEVICE)
    held = engine.add_request("ref", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv_on_finish=True)
    while engine.has_unfinished_requests():
        engine.step()
    state = engine.runtime.state_pool.buffer[held.state_slot].cpu().clone()
    return state, _token_kv(engine, held.block_ids, len(prompt)), engine.generate([prompt], GREEDY)[0].token_ids


def _reader(checkpoint: str, layout, block_size: int) -> tuple[LLMEngine, TransferAgent, KVPuller]:
    reader = _engine(checkpoint, layout, block_size)
    agent = TransferAgent(f"state-reader-{uuid.uuid4().hex[:8]}")
    rank = LocalKVRank(agent, reader.kv_layout, reader.kv_cache.buffers, state_buffer=reader.runtime.state_pool.buffer)
    puller = KVPuller(engine_id="reader", identity=kv_identity(reader), ranks=[rank], handshake_timeout_s=10,
                      transfer_timeout_s=20)
    return reader, agent, puller


async def _tickets(stub: worker_pb2_grpc.PrefillWorkerStub, rid: str, prompt: list[int], reader_bs: int,
                   as_parts: bool) -> tuple[worker_pb2.PrefillResponse, list]:
    request = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(GREEDY),
                                        reader_tp_size=1, reader_block_size=reader_bs)
    if not as_parts:
        final = await stub.Prefill(request)
        return final, [final.ticket]
    messages = [m async for m in stub.PrefillStream(request)]
    final = messages[-1].final
    return final, [m.part for m in messages[:-1]] + [final.ticket]


@pytest.mark.parametrize("pair", list(LAYOUT_PAIRS), ids=list(LAYOUT_PAIRS))
def test_state_and_kv_pulled_between_processes_are_byte_exact(granite: str, pair: str) -> None:
    prefill_layout, prefill_bs, reader_layout, reader_bs = LAYOUT_PAIRS[pair]
    reader, agent, puller = _reader(granite, reader_layout, reader_bs)
    slot_bytes = reader.runtime.state_pool.spec.slot_bytes
    kv_per_token = sum(reader.kv_layout.block_bytes(g.group_id) // g.block_size for g in reader.kv_layout.groups)
    try:
        # 32 tokens end on every block; 37 leave a partial last block; 29 in parts of 8 (8, 16, 24, then 24..28).
        cases = [("whole-32", _prompt(1, 32), False), ("whole-37", _prompt(2, 37), False),
                 ("parts-29", _prompt(3, 29), True)]
        with daemons(("prefill", granite, _prefill_args(prefill_layout, prefill_bs))) as (p,):
            async def run_all() -> None:
                async with grpc.aio.insecure_channel(p.address) as channel:
                    stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                    for rid, prompt, as_parts in cases:
                        final, tickets = await _tickets(stub, rid, prompt, reader_bs, as_parts)
                        assert [t.has_state for t in tickets] == [False] * (len(tickets) - 1) + [True], rid
                        assert len(tickets) == (4 if as_parts else 1)
                        local = reader.add_request_with_external_kv(rid, prompt, GREEDY)
                        assert local.num_cached_tokens == 0 and local.state_slot is not None
                        puller.take(tickets, prompt_hash(prompt))
                        pulled = 0
                        for ticket in tickets:
                            result = await puller.pull(ticket, local.block_ids, ticket.part_start_token,
                                                       local.state_slot)
                            pulled += result.num_bytes
                        exact = len(prompt) * kv_per_token + slot_bytes  # the KV of every token, the state once
                        padded = -(-len(prompt) // 8) * 8 * kv_per_token + slot_bytes
                        assert exact <= pulled <= padded, (rid, pulled, exact)
                        if len(prompt) % 8 == 0:
                            assert pulled == exact, (rid, pulled, exact)
                        state, kv, tokens = _colocated(granite, prompt, prefill_layout, prefill_bs)
                        assert torch.equal(reader.runtime.state_pool.buffer[local.state_slot], state), rid
                        assert torch.equal(_token_kv(reader, local.block_ids, len(prompt)), kv.cpu()), rid
                        assert decode_pulled(reader, rid, final) == tokens, rid

            asyncio.run(run_all())
            info = _wait_for(p.address, "prefill", lambda i: i.kv_blocks_pinned == 0)
            assert info.kv_blocks_pinned == 0 and info.num_running == 0
        assert reader.kv_manager.state_slots.num_free == reader.kv_manager.state_slots.num_slots
    finally:
        agent.close()


def test_state_ticket_checks_and_digest(granite: str) -> None:
    """A ticket without its state, with a slot outside the owner's, or whose state was altered by its owner
    after the digest (re-signed, so only the digest can tell) is refused; none of them leaves a block pinned."""
    reader, agent, puller = _reader(granite, *LAYOUT_PAIRS["P-cross4-R-per8"][2:])
    prompt = _prompt(5, 24)
    try:
        with daemons(("prefill", granite, _prefill_args(*LAYOUT_PAIRS["P-cross4-R-per8"][:2]))) as (p,):
            async def run() -> None:
                async with grpc.aio.insecure_channel(p.address) as channel:
                    stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                    final, (ticket,) = await _tickets(stub, "s", prompt, 8, as_parts=False)
                    local = reader.add_request_with_external_kv("s", prompt, GREEDY)
                    remote = await puller.peers.get(ticket.handshake_address, ticket.engine_id, ticket.epoch)

                    def altered(**fields) -> kv_pb2.TransferTicket:
                        forged = kv_pb2.TransferTicket()
                        forged.CopyFrom(ticket)
                        for name, value in fields.items():
                            if isinstance(value, list):
                                getattr(forged, name)[:] = value
                            else:
                                setattr(forged, name, value)
                        forged.signature = ticket_signature(forged, remote.ticket_key)
                        return forged

                    puller.take([ticket], prompt_hash(prompt))  # the altered copies share its nonce: taken too
                    with pytest.raises(TicketError, match="carries no state"):
                        await puller.pull(altered(has_state=False), local.block_ids, 0, local.state_slot)
                    with pytest.raises(TicketError, match="outside the owner's"):
                        await puller.pull(altered(state_slot=remote.num_state_slots), local.block_ids, 0,
                                          local.state_slot)
                    with pytest.raises(TicketError, match="local state slot"):
                        await puller.pull(ticket, local.block_ids, 0, None)
                    with pytest.raises(KVIntegrityError, match="state digest"):
                        await puller.pull(altered(state_digests=[ticket.state_digests[0] ^ 1]), local.block_ids, 0,
                                          local.state_slot)

            asyncio.run(run())
            info = _wait_for(p.address, "prefill", lambda i: i.kv_blocks_pinned == 0)
            assert info.kv_blocks_pinned == 0
    finally:
        agent.close()
