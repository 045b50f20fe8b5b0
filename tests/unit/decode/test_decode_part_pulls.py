"""A request's KV parts pulled several at once (``PullPolicy.start_parts`` with ``parts_in_flight``), without
gRPC or NIXL: the fake engine of test_decode_pull_policy.py and a puller whose every part waits on a gate.

Parts are posted while earlier ones still move, never more than the limit; a failed part stops the posting of
later ones, and the reservation is dropped only after every READ in flight ended (one may still be writing the
blocks), once, quarantined when a READ could not be cancelled; the failure names the earliest failed part.
"""

from __future__ import annotations

import asyncio

import pytest

from services.common.metrics import WorkerMetrics
from services.contract.sampling_params import SamplingParams
from services.decode.pull_policy import PullPolicy, PullRequired, StartedRequest
from services.kv.nixl.errors import TransferError, TransferTimeout
from services.kv.puller import PullResult
from services.proto_gen.pdserve.v1 import kv_pb2
from tests.unit.decode.test_decode_pull_policy import FakeEngine

PROMPT = list(range(100, 120))
PART = 5  # four parts: tokens 0..5, 5..10, 10..15, 15..20 (the last with the first token)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0)
FIRST = 7


def part(start: int) -> kv_pb2.TransferTicket:
    end = start + PART
    ticket = kv_pb2.TransferTicket(engine_id="prefill@a", epoch=1, request_id="r", num_tokens=end,
                                   num_prompt_tokens=len(PROMPT), part_start_token=start)
    if end == len(PROMPT):
        ticket.first_token_id = FIRST
    return ticket


class GatedPuller:
    """Each part's pull waits until its gate opens, then succeeds or raises what ``errors`` says for it."""

    def __init__(self, errors: dict[int, Exception] | None = None) -> None:
        self.errors = errors or {}
        self.gates = {start: asyncio.Event() for start in range(0, len(PROMPT), PART)}
        self.entered: list[int] = []
        self.running = 0
        self.most_running = 0

    async def pull(self, ticket: kv_pb2.TransferTicket, local_block_ids, num_cached_tokens: int = 0) -> PullResult:
        start = ticket.part_start_token
        self.entered.append(start)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await self.gates[start].wait()
        finally:
            self.running -= 1
        if start in self.errors:
            raise self.errors[start]
        return PullResult(num_bytes=1024, num_descriptors=1, num_reads=1, seconds=0.01, host_bytes=0, stages={})


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def start(policy: PullPolicy, queue: asyncio.Queue, require_pull: bool = False) -> asyncio.Task:
    async def parts():
        while (ticket := await queue.get()) is not None:
            yield ticket

    task = asyncio.create_task(policy.start_parts("r", PROMPT, PARAMS, parts(), require_pull=require_pull))
    await settle()
    return task


def test_parts_are_pulled_while_earlier_ones_move_up_to_the_limit() -> None:
    engine, puller = FakeEngine(), GatedPuller()
    policy = PullPolicy(engine, puller, WorkerMetrics("decode"), parts_in_flight=2)

    async def run() -> StartedRequest:
        queue: asyncio.Queue = asyncio.Queue()
        task = await start(policy, queue)
        for s in (0, 5, 10):
            queue.put_nowait(part(s))
        await settle()
        assert puller.entered == [0, 5]  # the third waits for a slot
        puller.gates[5].set()  # a later part may finish first
        await settle()
        assert puller.entered == [0, 5, 10]
        queue.put_nowait(part(15))
        for gate in puller.gates.values():
            gate.set()
        return await task

    assert asyncio.run(run()) == StartedRequest()
    assert puller.most_running == 2 and sorted(puller.entered) == [0, 5, 10, 15]
    assert engine.completed == [("r", FIRST, 0.0)] and engine.aborted == [] and engine.added == []


def test_a_failed_part_drops_the_reservation_only_after_the_reads_in_flight() -> None:
    """Part 5..10 fails while 0..5 still moves: nothing later is posted, the reservation is dropped once 0..5
    ended, and (not strict) the prompt plus the last part's first token is prefilled here."""
    engine, puller = FakeEngine(), GatedPuller({5: TransferError("peer went away")})
    policy = PullPolicy(engine, puller, WorkerMetrics("decode"), parts_in_flight=4)

    async def run() -> StartedRequest:
        queue: asyncio.Queue = asyncio.Queue()
        task = await start(policy, queue)
        queue.put_nowait(part(0))
        queue.put_nowait(part(5))
        await settle()
        puller.gates[5].set()
        await settle()
        assert engine.aborted == []  # 0..5 may still be writing the blocks
        queue.put_nowait(part(10))
        await settle()
        assert puller.entered == [0, 5]  # nothing is posted after a failure
        puller.gates[0].set()
        await settle()
        assert engine.aborted == ["r"]
        queue.put_nowait(part(15))
        return await task

    started = asyncio.run(run())
    assert started == StartedRequest((FIRST,), recomputed_locally=True)
    assert engine.aborted == ["r"] and engine.completed == []
    assert engine.added and engine.added[0][1] == [*PROMPT, FIRST]


def test_the_failure_names_the_earliest_failed_part_and_a_stuck_read_quarantines() -> None:
    """Two parts fail, the later one first, one of them a READ NIXL could not cancel: the request fails (strict)
    naming tokens 0..5, and the blocks are quarantined rather than freed. (The failure is acted on when the next
    part comes or the parts end: the router learns of it only after its input ended anyway, server.py.)"""
    engine = FakeEngine()
    puller = GatedPuller({0: TransferTimeout("READ not complete", aborted=False), 5: TransferError("peer went away")})
    policy = PullPolicy(engine, puller, WorkerMetrics("decode"), parts_in_flight=4, quarantine_s=60)

    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        task = await start(policy, queue, require_pull=True)
        queue.put_nowait(part(0))
        queue.put_nowait(part(5))
        await settle()
        puller.gates[5].set()
        await settle()
        puller.gates[0].set()
        await settle()
        queue.put_nowait(part(10))  # a failure is seen when the next part comes (or the parts end)
        with pytest.raises(PullRequired) as failure:
            await task
        assert puller.entered == [0, 5]
        assert "tokens 0..5" in failure.value.reason and "READ not complete" in failure.value.reason
        assert engine.quarantined == ["r"] and engine.aborted == []

    asyncio.run(run())


def test_a_cancelled_request_waits_for_its_reads_then_drops_the_reservation() -> None:
    engine, puller = FakeEngine(), GatedPuller()
    policy = PullPolicy(engine, puller, WorkerMetrics("decode"), parts_in_flight=4)

    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        task = await start(policy, queue)
        queue.put_nowait(part(0))
        queue.put_nowait(part(5))
        await settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert puller.running == 0  # both pulls were cancelled and ended before the abort
        assert engine.aborted == ["r"]

    asyncio.run(run())


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--kv-parts-in-flight must be at least 1"):
        PullPolicy(FakeEngine(), GatedPuller(), WorkerMetrics("decode"), parts_in_flight=0)
