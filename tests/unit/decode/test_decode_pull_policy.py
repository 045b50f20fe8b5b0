"""The decode worker's pull-or-recompute policy, without gRPC or NIXL: a fake engine and puller.

Whatever happens to the pull, the request starts exactly once on the engine, a reservation it made
is never left behind, and a recomputed request carries the ticket's first token with its limits
shifted by that token.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from services.common.metrics import JOIN_STAGES, PULL_STAGES, WorkerMetrics
from services.contract.sampling_params import SamplingParams
from services.decode.pull_policy import PullPolicy, PullRequired, StartedRequest
from services.kv.nixl.errors import TransferError, TransferTimeout
from services.kv.reader.errors import TicketError
from services.kv.reader.puller import PullResult
from services.kv.spec.description import HandshakeError
from services.proto_gen.pdserve.v1 import kv_pb2

PROMPT = [5, 6, 7, 8, 9]
PARAMS = SamplingParams(max_tokens=10, min_tokens=3, temperature=0.0)
FIRST = 42


class FakeEngine:
    """Records what the policy asked for; refuses the first ``refusals`` reservations (no room)."""

    def __init__(self, refusals: int = 0, refuse_first_token: bool = False) -> None:
        self.refusals = refusals
        self.refuse_first_token = refuse_first_token
        self.reservations: list[str] = []
        self.added: list[tuple[str, list[int], SamplingParams, list[int]]] = []
        self.completed: list[tuple[str, int, float | None]] = []
        self.aborted: list[str] = []

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                          hold_kv_on_finish: bool = False, grammar_prefix: Sequence[int] = ()):
        self.added.append((request_id, list(prompt_token_ids), params, list(grammar_prefix)))
        return SimpleNamespace(request_id=request_id)

    async def add_request_with_external_kv(self, request_id: str, prompt_token_ids: Sequence[int],
                                           params: SamplingParams):
        self.reservations.append(request_id)
        if self.refusals > 0:
            self.refusals -= 1
            return None
        return SimpleNamespace(request_id=request_id, block_ids=[[3, 4]], num_cached_tokens=4, state_slot=None)

    def prepare_external_kv(self, request_id: str, num_pulled_tokens: int = 0) -> None:
        self.prepared = [*getattr(self, "prepared", []), (request_id, num_pulled_tokens)]

    async def complete_external_kv(self, request_id: str, first_token_id: int,
                                   first_logprob: float | None = None) -> None:
        if self.refuse_first_token:
            raise ValueError("token 42 does not fit the grammar")
        self.completed.append((request_id, first_token_id, first_logprob))

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    async def quarantine_external_kv(self, request_id: str) -> str:
        self.quarantined = getattr(self, "quarantined", []) + [request_id]
        return f"{request_id}#q"

    async def release_quarantined_kv(self, key: str) -> bool:
        self.released = getattr(self, "released", []) + [key]
        return True


class FakePuller:
    """Pulls successfully, raises ``error``, or (``gate`` set) waits until the gate opens."""

    def __init__(self, error: Exception | None = None, gate: asyncio.Event | None = None) -> None:
        self.error = error
        self.gate = gate
        self.pulls: list[tuple[str, list[list[int]], int]] = []
        self.taken: list[tuple[str, int, bytes]] = []  # (request id, end, prompt hash) of each ticket taken
        self.parts: list[list[tuple[int, int]]] = []  # per pull, the (start, end) of each ticket it read
        self.done = 0  # pulls that returned
        self.entered = asyncio.Event()

    def take(self, tickets: Sequence[kv_pb2.TransferTicket], prompt_hash: bytes) -> None:
        self.taken += [(t.request_id, t.num_tokens, prompt_hash) for t in tickets]

    async def pull(self, ticket: kv_pb2.TransferTicket, local_block_ids, num_cached_tokens: int = 0,
                   local_state_slot: int | None = None, *, earlier: Sequence[kv_pb2.TransferTicket] = ()
                   ) -> PullResult:
        self.pulls.append((ticket.request_id, [list(ids) for ids in local_block_ids], num_cached_tokens))
        self.parts.append([(t.part_start_token, t.num_tokens) for t in (*earlier, ticket)])
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        self.done += 1
        return PullResult(num_bytes=4096, num_descriptors=3, num_reads=1, seconds=0.01, host_bytes=1024,
                          stages={"handshake": 0.001, "read": 0.002})


def _ticket(num_tokens: int = len(PROMPT)) -> kv_pb2.TransferTicket:
    ticket = kv_pb2.TransferTicket(engine_id="prefill@a", epoch=1, request_id="r", num_tokens=num_tokens,
                                   first_token_id=FIRST, first_token_logprob=-0.5)
    ticket.groups.add(group_id=0, block_ids=[10, 11])
    return ticket


def _policy(engine: FakeEngine, puller: FakePuller, reserve_timeout_s: float = 1.0) -> tuple[PullPolicy, WorkerMetrics]:
    metrics = WorkerMetrics("decode")
    return PullPolicy(engine, puller, metrics, reserve_timeout_s=reserve_timeout_s), metrics


def _value(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"role": "decode", **labels})
    assert value is not None, f"no {name} sample with {labels}"  # a missing series is not 0
    return value


def _assert_recomputed(started: StartedRequest, engine: FakeEngine, metrics: WorkerMetrics) -> None:
    """Local prefill of the prompt plus the first token, one token fewer to go (and one fewer minimum)."""
    assert started == StartedRequest((FIRST,), recomputed_locally=True)
    assert engine.added == [("r", [*PROMPT, FIRST], dataclasses.replace(PARAMS, max_tokens=9, min_tokens=2), [FIRST])]
    assert _value(metrics, "pdserve_local_recompute_fallbacks_total") == 1


def test_a_successful_pull_completes_the_reservation_with_the_tickets_first_token() -> None:
    engine, puller = FakeEngine(), FakePuller()
    policy, metrics = _policy(engine, puller)
    started = asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket()))
    assert started == StartedRequest() and not started.recomputed_locally
    assert puller.pulls == [("r", [[3, 4]], 4)]  # into the reserved blocks, past the locally cached prefix
    assert engine.completed == [("r", FIRST, -0.5)] and engine.prepared == [("r", 0)]  # hashed while pulling
    assert engine.added == [] and engine.aborted == []
    assert _value(metrics, "pdserve_kv_transfer_bytes_total") == 4096
    assert _value(metrics, "pdserve_kv_transfer_source_bytes_total", source="host") == 1024
    assert _value(metrics, "pdserve_kv_transfer_source_bytes_total", source="device") == 3072
    assert _value(metrics, "pdserve_kv_transfer_descriptors_total") == 3
    assert _value(metrics, "pdserve_kv_transfer_seconds_count") == 1
    for stage in PULL_STAGES:  # every stage observed once, those the pull did not report as 0
        assert _value(metrics, "pdserve_kv_pull_stage_seconds_count", stage=stage) == 1
    assert _value(metrics, "pdserve_local_recompute_fallbacks_total") == 0
    # the way to the engine, for the stream to count (a probe's pull streams nothing and is not counted)
    join = started.join
    assert join is not None and min(join.last_pull_s, join.resume_s, join.resumed_at) > 0
    for stage in JOIN_STAGES:
        assert _value(metrics, "pdserve_kv_join_stage_seconds_count", stage=stage) == 0


def _parts(*ends: int) -> list[kv_pb2.TransferTicket]:
    """Part tickets of PROMPT ending at ``ends`` (the last one ends at the prompt's end: the first token)."""
    tickets, start = [], 0
    for end in ends:
        ticket = _ticket(end)
        ticket.part_start_token, ticket.num_prompt_tokens = start, len(PROMPT)
        tickets.append(ticket)
        start = end
    return tickets


async def _aiter(items):
    for item in items:
        yield item


async def _paced(items, puller: FakePuller):
    """Each part only once the pulls before it returned: a reader that keeps up with its parts."""
    for i, item in enumerate(items):
        while puller.done < i:
            await asyncio.sleep(0.001)
        yield item


def test_parts_are_pulled_in_order_and_the_join_is_timed_from_the_last_one() -> None:
    engine, puller = FakeEngine(), FakePuller()
    policy, metrics = _policy(engine, puller)
    started = asyncio.run(policy.start_parts("r", PROMPT, PARAMS, _paced(_parts(2, 4, 5), puller)))
    assert started == StartedRequest() and started.join is not None
    # each from the later of its start and the locally cached prefix (4 tokens), clipped to its end
    assert [cached for _, _, cached in puller.pulls] == [2, 4, 4]
    assert puller.parts == [[(0, 2)], [(2, 4)], [(4, 5)]]  # one part per pull: none queued behind another
    assert engine.completed == [("r", FIRST, -0.5)] and engine.aborted == []
    assert engine.prepared == [("r", 0), ("r", 2), ("r", 4)]  # hashed at once, each part published once in
    assert _value(metrics, "pdserve_kv_transfer_seconds_count") == 3  # every part is a pull
    assert _value(metrics, "pdserve_kv_pull_stage_seconds_count", stage="resume") == 3  # 0 for the first two
    assert _value(metrics, "pdserve_kv_parts_coalesced_total") == 0
    assert 0 < started.join.last_pull_s < 1 and 0 < started.join.resume_s < 1  # the last part's, not all three


def test_parts_that_queue_behind_a_slow_pull_are_read_in_one_pull() -> None:
    """The first part's pull is held (a slow link) while the prefill worker sends the other three: they are read
    together in the next pull, which completes the request."""
    engine, puller = FakeEngine(), FakePuller(gate=asyncio.Event())
    policy, metrics = _policy(engine, puller)
    tickets = _parts(1, 2, 3, 5)

    async def run() -> StartedRequest:
        queue: asyncio.Queue = asyncio.Queue()

        async def parts():
            while True:
                yield await queue.get()

        queue.put_nowait(tickets[0])
        task = asyncio.create_task(policy.start_parts("r", PROMPT, PARAMS, parts()))
        await puller.entered.wait()  # the first part is being read
        for ticket in tickets[1:]:
            queue.put_nowait(ticket)
        while not queue.empty():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # the policy has them all
        puller.gate.set()
        return await task

    started = asyncio.run(run())
    assert started == StartedRequest() and started.join is not None
    assert puller.parts == [[(0, 1)], [(1, 2), (2, 3), (3, 5)]]
    # the second pull from the first queued part's start, past the locally cached prefix (4 tokens)
    assert [cached for _, _, cached in puller.pulls] == [1, 4]
    assert engine.prepared == [("r", 0), ("r", 1)] and engine.completed == [("r", FIRST, -0.5)]
    assert _value(metrics, "pdserve_kv_transfer_seconds_count") == 2
    assert _value(metrics, "pdserve_kv_parts_coalesced_total") == 2
    # from the last part's arrival: its wait behind the held pull (the 10 ms above) is part of it
    assert 0.01 <= started.join.last_pull_s < 1


def test_a_part_with_a_host_tier_prefix_is_pulled_on_its_own() -> None:
    """Parts queued at once are read together, but one reading the owner's host tier has a READ of its own."""
    engine, puller = FakeEngine(), FakePuller()
    policy, _ = _policy(engine, puller)
    tickets = _parts(2, 4, 5)
    tickets[0].num_host_tokens = 2
    asyncio.run(policy.start_parts("r", PROMPT, PARAMS, _aiter(tickets)))
    assert puller.parts == [[(0, 2)], [(2, 4), (4, 5)]]
    assert engine.completed == [("r", FIRST, -0.5)]


def test_a_required_pull_that_fails_reads_the_parts_to_the_last_before_it_refuses() -> None:
    """The call's status must follow its input's end (grpc/grpc#36066): the parts after a failed required pull are
    read to the last one (no further) before PullRequired."""
    engine, puller = FakeEngine(), FakePuller(error=TransferError("peer gone"))
    policy, _ = _policy(engine, puller)
    read: list[int] = []

    async def parts():
        for i, ticket in enumerate(_parts(2, 4, 5)):
            if i:
                await asyncio.sleep(0.01)  # the first part's pull has failed by now
            read.append(ticket.num_tokens)
            yield ticket
        read.append(-1)  # past the last part: must not be reached

    with pytest.raises(PullRequired, match="KV pull of tokens 0..2"):
        asyncio.run(policy.start_parts("r", PROMPT, PARAMS, parts(), require_pull=True))
    assert read == [2, 4, 5] and engine.aborted == ["r"] and engine.added == []


def test_a_refused_first_token_after_the_last_part_still_counts_its_bytes() -> None:
    engine, puller = FakeEngine(refuse_first_token=True), FakePuller()
    policy, metrics = _policy(engine, puller)
    started = asyncio.run(policy.start_parts("r", PROMPT, PARAMS, _paced(_parts(2, 5), puller)))
    _assert_recomputed(started, engine, metrics)
    assert _value(metrics, "pdserve_kv_transfer_bytes_total") == 2 * 4096
    assert started.join is None


@pytest.mark.parametrize(("error", "failure_metric"), [
    (TransferError("peer gone"), "pdserve_kv_transfer_failures_total"),
    (HandshakeError("no handshake"), "pdserve_kv_handshake_failures_total"),
    (OSError("connection refused"), "pdserve_kv_transfer_failures_total"),
    (TicketError("bad signature", reason="signature"), "pdserve_kv_transfer_failures_total"),
])
def test_a_failed_pull_aborts_the_reservation_and_prefills_locally_with_shifted_limits(
        error: Exception, failure_metric: str) -> None:
    engine = FakeEngine()
    policy, metrics = _policy(engine, FakePuller(error=error))
    started = asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket()))
    assert engine.aborted == ["r"] and engine.completed == []
    _assert_recomputed(started, engine, metrics)
    assert _value(metrics, failure_metric) == 1
    refused = _value(metrics, "pdserve_kv_refused_total", kind="ticket", reason="signature")
    assert refused == (1 if isinstance(error, TicketError) else 0)
    assert _value(metrics, "pdserve_kv_transfer_bytes_total") == 0


def test_a_full_worker_backs_off_until_a_reservation_fits() -> None:
    engine, puller = FakeEngine(refusals=3), FakePuller()
    policy, metrics = _policy(engine, puller)
    started = asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket()))
    assert engine.reservations == ["r"] * 4  # refused three times, then reserved
    assert started == StartedRequest() and len(puller.pulls) == 1
    assert _value(metrics, "pdserve_local_recompute_fallbacks_total") == 0


def test_no_room_within_the_reserve_timeout_prefills_locally_without_pulling() -> None:
    engine, puller = FakeEngine(refusals=10**6), FakePuller()
    policy, metrics = _policy(engine, puller, reserve_timeout_s=0.1)
    started = asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket()))
    # Backoff doubles from 5 ms to 50 ms: a handful of tries in 0.1 s, not a busy loop.
    assert 3 <= len(engine.reservations) <= 10
    assert puller.pulls == [] and engine.aborted == []  # nothing was reserved, so nothing to abort
    _assert_recomputed(started, engine, metrics)


def test_cancellation_between_reserving_and_streaming_aborts_the_reservation() -> None:
    engine, puller = FakeEngine(), FakePuller(gate=asyncio.Event())

    async def cancel_during_the_pull() -> None:
        policy, _ = _policy(engine, puller)
        task = asyncio.create_task(policy.start("r", PROMPT, PARAMS, _ticket()))
        await puller.entered.wait()  # reserved, pulling
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_during_the_pull())
    assert engine.reservations == ["r"] and engine.aborted == ["r"]
    assert engine.completed == [] and engine.added == []


def test_a_refused_first_token_falls_back_to_local_prefill() -> None:
    engine = FakeEngine(refuse_first_token=True)
    policy, metrics = _policy(engine, FakePuller())
    started = asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket()))
    assert engine.aborted == ["r"]
    _assert_recomputed(started, engine, metrics)
    assert _value(metrics, "pdserve_kv_transfer_failures_total") == 0  # the pull itself worked


def test_a_ticket_for_another_prompt_length_is_bad_input_and_reserves_nothing() -> None:
    engine, puller = FakeEngine(), FakePuller()
    policy, _ = _policy(engine, puller)
    with pytest.raises(ValueError, match="ticket covers 4 tokens, the prompt has 5"):
        asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket(num_tokens=4)))
    assert engine.reservations == [] and engine.added == [] and engine.aborted == []


def test_without_a_ticket_the_prompt_is_prefilled_here_unshifted() -> None:
    engine, puller = FakeEngine(), FakePuller()
    policy, metrics = _policy(engine, puller)
    started = asyncio.run(policy.start("r", PROMPT, PARAMS, None))
    assert started == StartedRequest()
    assert engine.added == [("r", PROMPT, PARAMS, [])] and engine.reservations == [] and puller.pulls == []
    assert _value(metrics, "pdserve_local_recompute_fallbacks_total") == 0


# ---- strict disaggregation (GenerateRequest.require_pull) -------------------------------------------


@pytest.mark.parametrize(("engine", "error", "failure_metric", "reason"), [
    (FakeEngine(), TransferError("peer gone"), "pdserve_kv_transfer_failures_total", "KV pull from prefill@a failed"),
    (FakeEngine(), HandshakeError("refused"), "pdserve_kv_handshake_failures_total", "KV pull from prefill@a failed"),
    (FakeEngine(), TicketError("bad signature", reason="signature"), "pdserve_kv_transfer_failures_total",
     "bad signature"),
    (FakeEngine(refuse_first_token=True), None, None, "the ticket's first token is refused"),
    (FakeEngine(refusals=10**6), None, None, "no KV blocks or sequence seat free"),
], ids=["transfer", "handshake", "ticket", "first-token", "no-room"])
def test_a_required_pull_that_fails_drops_the_reservation_and_recomputes_nothing(
        engine: FakeEngine, error: Exception | None, failure_metric: str | None, reason: str) -> None:
    policy, metrics = _policy(engine, FakePuller(error=error), reserve_timeout_s=0.05)
    with pytest.raises(PullRequired, match=reason) as refused:
        asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket(), require_pull=True))
    assert reason in refused.value.reason
    assert engine.added == [] and engine.completed == []  # nothing prefilled here, nothing started
    # The reservation is dropped exactly as the fallback drops it: aborted once if one was made.
    assert engine.aborted == ([] if engine.refusals else ["r"])
    assert _value(metrics, "pdserve_local_recompute_fallbacks_total") == 0
    if failure_metric is not None:  # the underlying failure is counted as without require_pull
        assert _value(metrics, failure_metric) == 1
    assert _value(metrics, "pdserve_kv_transfer_bytes_total") == 0


def test_a_required_pull_that_succeeds_starts_as_usual() -> None:
    engine, puller = FakeEngine(), FakePuller()
    policy, metrics = _policy(engine, puller)
    started = asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket(), require_pull=True))
    assert started == StartedRequest() and engine.completed == [("r", FIRST, -0.5)] and engine.aborted == []
    assert _value(metrics, "pdserve_kv_transfer_seconds_count") == 1


def test_require_pull_without_a_ticket_is_ignored() -> None:
    engine = FakeEngine()
    policy, _ = _policy(engine, FakePuller())
    assert asyncio.run(policy.start("r", PROMPT, PARAMS, None, require_pull=True)) == StartedRequest()
    assert engine.added == [("r", PROMPT, PARAMS, [])]


def test_a_read_nixl_could_not_cancel_keeps_its_blocks_out_of_the_pool_for_a_while() -> None:
    """TransferTimeout(aborted=False): the remote may still write the reserved blocks, so they are not
    handed back at once (a later request's KV would be overwritten): quarantined, freed after the wait,
    and the prompt is prefilled here meanwhile."""
    engine, puller = FakeEngine(), FakePuller(TransferTimeout("READ not complete after 0.1s", aborted=False))
    metrics = WorkerMetrics("decode")
    policy = PullPolicy(engine, puller, metrics, reserve_timeout_s=1.0, quarantine_s=0.05)

    async def run() -> StartedRequest:
        started = await policy.start("r", PROMPT, PARAMS, _ticket())
        assert engine.quarantined == ["r"] and engine.aborted == [] and not hasattr(engine, "released")
        await asyncio.sleep(0.2)
        return started

    started = asyncio.run(run())
    assert engine.released == ["r#q"]
    _assert_recomputed(started, engine, metrics)
    # A READ NIXL did cancel frees its blocks at once, as before.
    engine, puller = FakeEngine(), FakePuller(TransferTimeout("READ not complete after 0.1s", aborted=True))
    policy, metrics = _policy(engine, puller)
    asyncio.run(policy.start("r", PROMPT, PARAMS, _ticket()))
    assert engine.aborted == ["r"] and not hasattr(engine, "quarantined")
