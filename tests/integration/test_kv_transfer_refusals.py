"""Tickets that cannot be replayed or mixed up, between a real prefill daemon and a real decode daemon.

Both run ``--no-kv-digest`` (only the ticket checks stand between the decode worker and freed blocks) and
``--no-prefix-caching``: the prefill worker hands a freed block out again at once (the lowest free run, so the next
prompt of the same length lands in the very blocks of the one before), and the decode worker pulls a whole prompt
every time (its own cache would hold a replayed prompt's blocks). Its KV lease is ``LEASE_S``.

- A ticket already pulled, sent again: refused and counted (``replayed``), the prompt recomputed here: the tokens of
  its own prompt, never the continuation of the request whose KV its blocks hold now.
- A ticket never pulled whose lease ran out (the prefill worker freed its blocks, and another prompt reuses them):
  refused as ``expired``, recomputed the same way.
- A genuine ticket of prompt Y sent with prompt X of the same length, whole or in parts (``GenerateParts``):
  INVALID_ARGUMENT (``prompt_mismatch``), nothing pulled; releasing it (as the router does) unpins its blocks.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.contract.sampling_params import SamplingParams
from services.contract.wire import sampling_to_proto
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.launch.spawn import Daemon, daemons
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import metric_total

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LEASE_S = 4.0
CHUNK = 8  # the prefill's chunk: a 24-token prompt goes out in parts through PrefillStream
PREFILL_ARGS = ("--kv-layout", "cross_layer", "--block-size", "4", "--num-kv-blocks", "64", "--dtype", "float32",
                "--no-kv-digest", "--no-prefix-caching", "--kv-lease-s", f"{LEASE_S:g}",
                "--max-num-batched-tokens", str(CHUNK))
DECODE_ARGS = ("--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "64", "--dtype", "float32",
               "--no-kv-digest", "--no-prefix-caching")
PROMPTS = {name: [(31 * i + 7 * k) % 290 + 5 for i in range(24)] for k, name in enumerate("ABCDXY")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("ckpt"))
    return str(directory)


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, colocated."""
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", dtype="float32", num_kv_blocks=64))
    outputs = engine.generate(list(PROMPTS.values()), GREEDY)
    return {name: out.token_ids for name, out in zip(PROMPTS, outputs, strict=True)}


@pytest.fixture(scope="module")
def workers(checkpoint: str):
    with daemons(("prefill", checkpoint, PREFILL_ARGS), ("decode", checkpoint, DECODE_ARGS)) as started:
        yield started


async def _prefill(prefill: Daemon, rid: str, prompt: list[int]) -> worker_pb2.PrefillResponse:
    async with grpc.aio.insecure_channel(prefill.address) as channel:
        response = await worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(GREEDY), reader_tp_size=1,
            reader_block_size=8))
    assert response.HasField("ticket") and not response.finished
    return response


async def _generate(decode: Daemon, rid: str, prompt: list[int], ticket) -> tuple[list[int], bool]:
    """The decode stream's tokens (the ticket's first token first) and whether the prompt was recomputed there."""
    async with grpc.aio.insecure_channel(decode.address) as channel:
        chunks = [c async for c in worker_pb2_grpc.DecodeWorkerStub(channel).Generate(worker_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(GREEDY), ticket=ticket))]
    assert chunks[-1].finished
    return [t for c in chunks for t in c.token_ids], chunks[0].recomputed_locally


async def _pinned(prefill: Daemon) -> int:
    async with grpc.aio.insecure_channel(prefill.address) as channel:
        return (await worker_pb2_grpc.PrefillWorkerStub(channel).Info(worker_pb2.InfoRequest())).kv_blocks_pinned


def _wait_unpinned(prefill: Daemon, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while asyncio.run(_pinned(prefill)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert asyncio.run(_pinned(prefill)) == 0


def _refused(decode: Daemon, reason: str) -> float:
    return metric_total(decode, "pdserve_kv_refused_total", f'reason="{reason}"')


def _block_ids(response: worker_pb2.PrefillResponse) -> list[int]:
    return list(response.ticket.groups[0].block_ids)


def test_a_replayed_ticket_is_refused_and_never_answers_with_another_requests_kv(workers, reference) -> None:
    prefill, decode = workers
    replayed_before = _refused(decode, "replayed")
    a = asyncio.run(_prefill(prefill, "a", PROMPTS["A"]))
    assert asyncio.run(_generate(decode, "a", PROMPTS["A"], a.ticket)) == (reference["A"], False)  # pulled
    _wait_unpinned(prefill)  # read: the prefill worker freed A's blocks
    b = asyncio.run(_prefill(prefill, "b", PROMPTS["B"]))
    assert _block_ids(b) == _block_ids(a)  # B's KV now sits where A's ticket points
    assert asyncio.run(_generate(decode, "b", PROMPTS["B"], b.ticket)) == (reference["B"], False)
    _wait_unpinned(prefill)
    # A's Generate again, as a replayed call: refused, A recomputed here from its prompt and first token.
    tokens, recomputed = asyncio.run(_generate(decode, "a", PROMPTS["A"], a.ticket))
    assert (tokens, recomputed) == (reference["A"], True)
    assert _refused(decode, "replayed") == replayed_before + 1


def test_a_ticket_whose_lease_freed_its_blocks_is_refused(workers, reference) -> None:
    prefill, decode = workers
    expired_before = _refused(decode, "expired")
    c = asyncio.run(_prefill(prefill, "c", PROMPTS["C"]))  # nobody pulls it: its lease frees its blocks
    _wait_unpinned(prefill, timeout_s=LEASE_S + 5)
    assert metric_total(prefill, "pdserve_kv_lease_expiries_total") >= 1
    d = asyncio.run(_prefill(prefill, "d", PROMPTS["D"]))
    assert _block_ids(d) == _block_ids(c)
    assert asyncio.run(_generate(decode, "d", PROMPTS["D"], d.ticket)) == (reference["D"], False)
    tokens, recomputed = asyncio.run(_generate(decode, "c", PROMPTS["C"], c.ticket))
    assert (tokens, recomputed) == (reference["C"], True)
    assert _refused(decode, "expired") == expired_before + 1


async def _generate_parts(decode: Daemon, rid: str, prompt: list[int], tickets: list) -> list[int]:
    """GenerateParts relaying ``tickets`` as the router does: the request first, then each part."""
    async def inputs():
        yield worker_pb2.GenerateInput(start=worker_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(GREEDY)))
        for ticket in tickets:
            yield worker_pb2.GenerateInput(part=ticket)

    async with grpc.aio.insecure_channel(decode.address) as channel:
        return [t async for c in worker_pb2_grpc.DecodeWorkerStub(channel).GenerateParts(inputs())
                for t in c.token_ids]


async def _release(prefill: Daemon, rid: str) -> None:
    async with grpc.aio.insecure_channel(prefill.address) as channel:
        await worker_pb2_grpc.PrefillWorkerStub(channel).Release(worker_pb2.ReleaseRequest(request_id=rid))


@pytest.mark.parametrize("as_parts", [False, True], ids=["whole", "parts"])
def test_a_ticket_of_another_prompt_is_refused_as_bad_input(workers, reference, as_parts: bool) -> None:
    prefill, decode = workers
    mismatched_before = _refused(decode, "prompt_mismatch")
    bytes_before = metric_total(decode, "pdserve_kv_transfer_bytes_total")
    rid = f"y-{'parts' if as_parts else 'whole'}"
    x, y = PROMPTS["X"], PROMPTS["Y"]

    async def refused() -> tuple[grpc.aio.AioRpcError, int]:
        tickets = []
        with pytest.raises(grpc.aio.AioRpcError) as refusal:
            if as_parts:
                async with grpc.aio.insecure_channel(prefill.address) as channel:
                    messages = [m async for m in worker_pb2_grpc.PrefillWorkerStub(channel).PrefillStream(
                        worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=y,
                                                  params=sampling_to_proto(GREEDY), reader_tp_size=1,
                                                  reader_block_size=8))]
                tickets = [m.part for m in messages[:-1]] + [messages[-1].final.ticket]
                assert len(tickets) > 1 and all(t.prompt_hash == tickets[0].prompt_hash for t in tickets)
                await _generate_parts(decode, rid, x, tickets)
            else:
                tickets = [(await _prefill(prefill, rid, y)).ticket]
                await _generate(decode, rid, x, tickets[0])
        return refusal.value, len(tickets)

    error, num_tickets = asyncio.run(refused())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "another prompt" in error.details(), error
    assert _refused(decode, "prompt_mismatch") == mismatched_before + num_tickets  # every part is refused
    assert metric_total(decode, "pdserve_kv_transfer_bytes_total") == bytes_before  # nothing pulled
    assert asyncio.run(_pinned(prefill)) > 0  # unread: the router's clean-up releases it
    asyncio.run(_release(prefill, rid))
    _wait_unpinned(prefill)
