"""How a decode worker starts a request: pull the prompt's KV from its prefill worker, or recompute it.

With a ticket: reserve local blocks (waiting, with backoff, for room: recomputing a prompt whose KV
is ready on the prefill worker only because this worker is momentarily full would throw the
disaggregation away), pull the rest over NIXL, and complete the request with the ticket's first
token. If there is no room in time, the pull fails, or the engine refuses the first token, the
reservation is aborted and the prompt plus that first token is prefilled here, one token fewer to
go: the request still completes. Cancelled between reserving and streaming, the reservation is
aborted (nobody will read the request). Without a ticket the prompt is prefilled here.

A READ that timed out and that NIXL could not cancel (``TransferTimeout.aborted`` False) may still
write the reserved blocks: they are quarantined, not freed (``quarantine_s``, then freed), so no later
request's KV lands in blocks a late READ overwrites; the prompt is prefilled here under the same id.

Strict disaggregation (``GenerateRequest.require_pull``, the router's ``--enforce-disagg``): the same
failures drop the reservation the same way, then raise :class:`PullRequired` instead of recomputing,
so the router can fail the request rather than serve it from a prompt this worker prefilled.

Every ticket is taken as it arrives, before anything is reserved for it (``KVPuller.take``,
``services.kv.reader.tickets``), and checked again before its READs. A ticket refused there (taken before, past
its lease, or from an owner that binds none) is such a failure: counted by reason, its blocks never read, the
prompt recomputed with the ticket's first token (its own prompt's), or PullRequired. A ticket of another prompt
(its prompt hash differs from this prompt's) is bad input, as a ticket of another length is: its first token is
another prompt's, so no continuation here would be this prompt's; the call fails (INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.metrics import PULL_STAGES, WorkerMetrics
from services.contract.sampling_params import SamplingParams
from services.engine.request import Request
from services.kv.nixl.errors import TransferError, TransferTimeout
from services.kv.reader.errors import KVIntegrityError, TicketError
from services.kv.reader.puller import PullResult
from services.kv.spec.description import HandshakeError
from services.kv.spec.wire import prompt_hash
from services.proto_gen.pdserve.v1 import kv_pb2

log = logging.getLogger(__name__)

#: What a failed pull raises; any of them sends the request to local prefill.
PULL_ERRORS = (TransferError, HandshakeError, ValueError, OSError)
RESERVE_FIRST_DELAY_S = 0.005
RESERVE_MAX_DELAY_S = 0.05


class DecodeEngine(Protocol):
    """The engine calls the policy makes (``AsyncEngine`` has them)."""

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                          hold_kv_on_finish: bool = False, grammar_prefix: Sequence[int] = ()) -> Request: ...

    async def add_request_with_external_kv(self, request_id: str, prompt_token_ids: Sequence[int],
                                           params: SamplingParams) -> Request | None: ...

    async def complete_external_kv(self, request_id: str, first_token_id: int,
                                   first_logprob: float | None = None) -> None: ...

    def prepare_external_kv(self, request_id: str, num_pulled_tokens: int = 0) -> None: ...

    async def abort(self, request_id: str) -> bool: ...

    async def quarantine_external_kv(self, request_id: str) -> str: ...

    async def release_quarantined_kv(self, key: str) -> bool: ...


class Puller(Protocol):
    """Takes tickets as they arrive and reads their KV into local blocks (``KVPuller`` does)."""

    def take(self, tickets: Sequence[kv_pb2.TransferTicket], prompt_hash: bytes) -> None: ...

    async def pull(self, ticket: kv_pb2.TransferTicket, local_block_ids: Sequence[Sequence[int]],
                   num_cached_tokens: int = 0, local_state_slot: int | None = None, *,
                   earlier: Sequence[kv_pb2.TransferTicket] = ()) -> PullResult: ...


class PullRequired(Exception):
    """The request needs pulled KV (``require_pull``) and the pull could not be done; nothing is left
    reserved for it. ``reason`` says why, for the caller's error status."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class JoinTimes:
    """A pulled request's way to the engine (``pdserve_kv_join_stage_seconds``, observed by the stream that serves
    it, so a probe's pull is not counted): the pull of the ticket completing its KV (blocks reserved first for a
    whole ticket), then the engine taking it; ``resumed_at`` (``time.perf_counter()``) starts its first step."""

    last_pull_s: float
    resume_s: float
    resumed_at: float


@dataclass(frozen=True)
class StartedRequest:
    """A request the engine runs now. ``emit_first``: tokens to stream before the engine's own outputs
    (the ticket's first token, when the prompt was recomputed with it); ``recomputed_locally``: the
    prompt was prefilled here, not pulled."""

    emit_first: tuple[int, ...] = ()
    recomputed_locally: bool = False
    join: JoinTimes | None = dataclasses.field(default=None, compare=False)  # its KV was pulled


class PartPulls:
    """How far a request's part tickets came (``start_parts``): each must start where the one before ended and
    name this request and prompt; the last ends at the prompt's end and carries the first token."""

    def __init__(self, num_prompt_tokens: int, prompt_hash: bytes) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.prompt_hash = prompt_hash  # ``wire.prompt_hash`` of the whole prompt, which every part names
        self.end = 0  # tokens covered by the parts so far
        self.last: kv_pb2.TransferTicket | None = None
        self.failure: str | None = None
        self.other_prompt = False  # a part named another prompt: bad input, never recomputed from the last's token
        self.num_pulled = 0
        self.join: JoinTimes | None = None  # once the engine took the request after the last part

    def ends_prompt(self, ticket: kv_pb2.TransferTicket) -> bool:
        """Whether ``ticket`` is the last part: it reaches the prompt's end (and carries the first token)."""
        return ticket.num_tokens >= self.num_prompt_tokens

    def accept(self, ticket: kv_pb2.TransferTicket, rid: str) -> TicketError | None:
        """Take the next part; why it does not fit, if it does not (it is not pulled then): of another request or
        length, or out of order (reason ``part``)."""
        whole = max(ticket.num_prompt_tokens, ticket.num_tokens)
        problem = None
        if ticket.request_id != rid or whole != self.num_prompt_tokens:
            problem = f"a KV part of request {ticket.request_id!r} ({whole} tokens)"
        elif ticket.part_start_token != self.end or not self.end < ticket.num_tokens <= whole:
            problem = f"a KV part of tokens {ticket.part_start_token}..{ticket.num_tokens} after tokens 0..{self.end}"
        self.end = max(self.end, ticket.num_tokens)
        if self.ends_prompt(ticket):
            self.last = ticket
        if problem is None:
            return None
        return TicketError(f"{problem} does not continue the prompt's KV; refused", reason="part")


class PullPolicy:
    """Starts decode requests: pulled KV when it can, local prefill when it must (metrics say which)."""

    def __init__(self, engine: DecodeEngine, puller: Puller, metrics: WorkerMetrics,
                 reserve_timeout_s: float = 10.0, quarantine_s: float = 30.0) -> None:
        self.engine = engine
        self.puller = puller
        self.metrics = metrics
        self.reserve_timeout_s = reserve_timeout_s
        self.quarantine_s = quarantine_s  # how long blocks a READ may still write stay out of the pool
        self._releases: set[asyncio.Task] = set()  # quarantined blocks waiting to be freed

    async def start(self, rid: str, prompt: list[int], params: SamplingParams,
                    ticket: kv_pb2.TransferTicket | None, *, require_pull: bool = False,
                    num_output_tokens: int = 0) -> StartedRequest:
        """Start ``rid`` on the engine; ValueError for bad input (then nothing is left reserved).

        ``require_pull`` (with a ticket): :class:`PullRequired` when the pull cannot be done, instead of
        prefilling the prompt here. ``num_output_tokens`` (without a ticket): the prompt ends with that many
        tokens of the request's own output (a request migrated from another decode worker, replayed as in
        ``_recompute``): a structured output's grammar starts past them.
        """
        if ticket is None:
            prefix = prompt[len(prompt) - num_output_tokens:] if num_output_tokens else ()
            await self.engine.add_request(rid, prompt, params, grammar_prefix=prefix)
            return StartedRequest()
        return await self._start_from_ticket(rid, prompt, params, ticket, require_pull)

    async def _start_from_ticket(self, rid: str, prompt: list[int], params: SamplingParams,
                                 ticket: kv_pb2.TransferTicket, require_pull: bool) -> StartedRequest:
        """Reserve, pull, and start decoding; on any pull failure prefill here instead (or, when the
        pull is required, raise PullRequired)."""
        if list(ticket.groups) and ticket.num_tokens != len(prompt):
            raise ValueError(f"ticket covers {ticket.num_tokens} tokens, the prompt has {len(prompt)}")
        refused = self._take([ticket], prompt_hash(prompt))
        if refused is not None and refused.reason == "prompt_mismatch":
            log.warning("request %s: %s", rid, refused)
            raise refused  # bad input: nothing was reserved
        started = time.perf_counter()
        if refused is not None:
            outcome = f"its ticket is refused ({refused})"
        else:
            try:
                outcome = await self._reserve_and_pull(rid, prompt, params, ticket, started)
            except ValueError:
                raise  # bad input (a duplicate id among them): nothing was reserved under this call
            except BaseException:
                # Cancelled (the router gave up, or its deadline passed while this worker was stalled) between
                # reserving blocks and streaming: nobody will read this request, so it must not keep them.
                await asyncio.shield(self.engine.abort(rid))
                raise
            if isinstance(outcome, StartedRequest):
                return outcome
        if require_pull:
            log.warning("request %s: %s; failing it (the router requires pulled KV)", rid, outcome)
            raise PullRequired(outcome)
        log.warning("request %s: %s; prefilling locally", rid, outcome)
        return await self._recompute(rid, prompt, params, ticket.first_token_id)

    async def start_parts(self, rid: str, prompt: list[int], params: SamplingParams,
                          parts: AsyncIterator[kv_pb2.TransferTicket], *, require_pull: bool = False) -> StartedRequest:
        """Start ``rid`` from its KV in parts (``GenerateParts``): reserve the whole prompt's blocks now, pull
        the part tickets into them as they arrive (``PartPulls`` checks they follow each other; those that queued
        behind a pull are read together), then run with the last part's first token. ValueError for bad input
        (nothing is left reserved).

        On a failed part the reservation is dropped, the later parts are only read to their end, and the prompt
        plus the last part's first token is prefilled here (``require_pull``: :class:`PullRequired` once the
        parts are read to the last, which the call's status must follow).
        Parts that end before the last one (the prefill worker failed: the router has no first token either)
        leave the prompt to be prefilled here from scratch, as without a ticket. A part of another prompt is a
        ValueError once the parts are read to the last (its first token is that prompt's)."""
        started = time.perf_counter()
        request = await self._reserve(rid, prompt, params)  # ValueError here: nothing reserved under this call
        pulled = PartPulls(len(prompt), prompt_hash(prompt))
        if request is None:
            pulled.failure = f"no KV blocks or sequence seat free for {self.reserve_timeout_s:.0f} s"
        try:
            if pulled.failure is None or not require_pull:
                await self._pull_parts(rid, request, parts, pulled, require_pull, time.perf_counter() - started)
        except BaseException:
            # Cancelled (the router gave up), the parts' stream broke, or a bad part: nobody will read this
            # request, so it must not keep its blocks.
            await asyncio.shield(self.engine.abort(rid))
            raise
        if pulled.failure is None:
            return StartedRequest(join=pulled.join)
        if pulled.other_prompt:  # bad input (as in ``start``): nothing here would continue this prompt
            log.warning("request %s: %s", rid, pulled.failure)
            raise ValueError(pulled.failure)
        if require_pull:
            log.warning("request %s: %s; failing it (the router requires pulled KV)", rid, pulled.failure)
            raise PullRequired(pulled.failure)
        log.warning("request %s: %s; prefilling locally", rid, pulled.failure)
        if pulled.last is None:  # no first token came: the prompt is prefilled here from scratch, as without a ticket
            self.metrics.local_recomputes.labels("decode").inc()
            await self.engine.add_request(rid, prompt, params)
            return StartedRequest()
        return await self._recompute(rid, prompt, params, pulled.last.first_token_id)

    async def _pull_parts(self, rid: str, request: Request | None, parts: AsyncIterator[kv_pb2.TransferTicket],
                          pulled: PartPulls, require_pull: bool, reserve_s: float) -> None:
        """Pull the parts into the reserved blocks as they come; after the last, complete the request with its first
        token. The parts are read off their stream while a pull runs: the ones that queued meanwhile (a link slower
        than the prefill) are read together in the next pull, one READ per pair for all of them, so a slow READ's
        fixed cost is paid once. On any failure the reservation is dropped (or quarantined) at once; the parts are
        then read to their end (the last one has the first token a local prefill continues from) unless the pull is
        required."""
        queue: asyncio.Queue = asyncio.Queue()
        feeder = asyncio.create_task(_feed(parts, queue, pulled.ends_prompt))
        try:
            result, arrived, first_reserve_s, ended = None, 0.0, 0.0, False
            while not ended and pulled.last is None and not (pulled.failure is not None and require_pull):
                todo: list[kv_pb2.TransferTicket] = []
                for item in await _take_queued(queue):
                    if isinstance(item, BaseException):
                        raise item  # the stream broke or carried something else than a part
                    if item is _END or pulled.last is not None:
                        ended = item is _END
                        break
                    ticket, arrived = item
                    # A part that fits is taken after a failure too, so a replay of it is refused (the router
                    # released it unread); one ``accept`` refuses is neither taken nor ever read.
                    problem = pulled.accept(ticket, rid) or self._take([ticket], pulled.prompt_hash)
                    if problem is not None:
                        pulled.other_prompt |= problem.reason == "prompt_mismatch"
                        if problem.reason == "part":  # _take counted the others
                            self.metrics.kv_refused.labels("decode", "ticket", "part").inc()
                    if pulled.failure is None and problem is not None:
                        pulled.failure = str(problem)
                        await self.engine.abort(rid)
                    if pulled.failure is None:
                        todo.append(ticket)
                for batch in _pull_batches(todo):
                    result = await self._pull_part(request, batch, pulled)
                    if result is None:
                        break
                    first_reserve_s = reserve_s if pulled.num_pulled == 1 else 0.0
                    if pulled.last is None or batch[-1] is not pulled.last:
                        self._count_pull(rid, result, first_reserve_s, 0.0)
                        self.engine.prepare_external_kv(rid, batch[-1].num_tokens)  # publish what is in
            # The feeder stops after the last part, so this waits only when a required pull failed before it: the
            # rest of the parts, as a refusal's status does (InputFirstContext); the stream has one reader at a time.
            await feeder
        except BaseException:
            feeder.cancel()
            raise
        if pulled.failure is None:
            await self._complete_parts(rid, pulled, result, first_reserve_s, arrived)

    async def _complete_parts(self, rid: str, pulled: PartPulls, result: PullResult | None, first_reserve_s: float,
                              arrived: float) -> None:
        """The parts are in: run the request with the last part's first token and count the last pull (``result``,
        arrived at ``arrived``), or, when they ended before the last part or the token is refused, drop the
        reservation (``pulled.failure`` says why)."""
        if pulled.last is None:
            await self.engine.abort(rid)
            pulled.failure = f"the prompt's KV parts ended at token {pulled.end} of {pulled.num_prompt_tokens}, " \
                             "before its last part (the prefill worker failed)"
            return
        pulled_at = time.perf_counter()
        try:
            await self.engine.complete_external_kv(rid, pulled.last.first_token_id, pulled.last.first_token_logprob)
        except ValueError as e:  # the last part's first token does not fit (e.g. not in the grammar)
            self._count_pull(rid, result, first_reserve_s, 0.0)  # its bytes did move
            await self.engine.abort(rid)
            pulled.failure = f"the ticket's first token is refused ({e})"
            return
        resumed = time.perf_counter()
        self._count_pull(rid, result, first_reserve_s, resumed - pulled_at)
        pulled.join = JoinTimes(pulled_at - arrived, resumed - pulled_at, resumed)

    async def _pull_part(self, request: Request, tickets: list[kv_pb2.TransferTicket], pulled: PartPulls
                         ) -> PullResult | None:
        """Consecutive parts into the request's blocks in one pull (what its own prefix cache holds is not read
        again); None when it failed (``pulled.failure`` says why, the reservation is dropped)."""
        rid, first, last = request.request_id, tickets[0], tickets[-1]
        cached = min(max(request.num_cached_tokens, first.part_start_token), last.num_tokens)
        try:
            result = await self.puller.pull(last, request.block_ids, cached, request.state_slot, earlier=tickets[:-1])
        except PULL_ERRORS as e:
            await self._drop_failed_pull(rid, e)
            pulled.failure = f"KV pull of tokens {first.part_start_token}..{last.num_tokens} from " \
                             f"{last.engine_id} failed ({e})"
            return None
        pulled.num_pulled += 1
        self.metrics.kv_parts_coalesced.labels("decode").inc(len(tickets) - 1)
        return result

    async def _recompute(self, rid: str, prompt: list[int], params: SamplingParams,
                         first_token_id: int) -> StartedRequest:
        """Prefill the prompt plus the first token the client already has, one token fewer to go."""
        self.metrics.local_recomputes.labels("decode").inc()
        rest = dataclasses.replace(params, max_tokens=params.max_tokens - 1, min_tokens=max(params.min_tokens - 1, 0))
        await self.engine.add_request(rid, [*prompt, first_token_id], rest, grammar_prefix=[first_token_id])
        return StartedRequest((first_token_id,), recomputed_locally=True)

    async def _reserve_and_pull(self, rid: str, prompt: list[int], params: SamplingParams,
                                ticket: kv_pb2.TransferTicket, started: float) -> StartedRequest | str:
        """Reserve local blocks and pull the ticket's KV into them: the request running on the pulled KV,
        else why it cannot (no room in time, the pull failed, the first token was refused: any reservation
        is dropped by then)."""
        request = await self._reserve(rid, prompt, params)
        reserved = time.perf_counter()
        if request is None:
            return f"no KV blocks or sequence seat free for {self.reserve_timeout_s:.0f} s"
        try:
            result = await self.puller.pull(ticket, request.block_ids, request.num_cached_tokens, request.state_slot)
        except PULL_ERRORS as e:
            await self._drop_failed_pull(rid, e)
            return f"KV pull from {ticket.engine_id} failed ({e})"
        pulled = time.perf_counter()
        try:
            await self.engine.complete_external_kv(rid, ticket.first_token_id, ticket.first_token_logprob)
        except ValueError as e:  # the ticket's first token does not fit (e.g. not in the grammar)
            await self.engine.abort(rid)
            return f"the ticket's first token is refused ({e})"
        resumed = time.perf_counter()
        self._count_pull(rid, result, reserved - started, resumed - pulled)
        return StartedRequest(join=JoinTimes(pulled - started, resumed - pulled, resumed))

    def _take(self, tickets: Sequence[kv_pb2.TransferTicket], prompt_hash: bytes) -> TicketError | None:
        """Take tickets as they arrive (``KVPuller.take``, for the prompt hashed ``prompt_hash``); the refusal,
        counted by its reason, if one is refused."""
        try:
            self.puller.take(tickets, prompt_hash)
        except TicketError as e:
            self.metrics.kv_refused.labels("decode", "ticket", e.reason).inc()
            return e
        return None

    async def _reserve(self, rid: str, prompt: list[int], params: SamplingParams) -> Request | None:
        """Reserve local blocks for the pull, waiting (bounded, with backoff) for a seat or blocks to free up;
        None when none came free in time. The prefill worker holds the blocks under its lease meanwhile."""
        deadline = time.monotonic() + self.reserve_timeout_s
        delay_s = RESERVE_FIRST_DELAY_S
        while True:
            request = await self.engine.add_request_with_external_kv(rid, prompt, params)
            if request is not None:
                self.engine.prepare_external_kv(rid)  # while the KV is on the way
                return request
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, RESERVE_MAX_DELAY_S)

    async def _drop_failed_pull(self, rid: str, error: Exception) -> None:
        """Count a failed pull and drop its reservation: quarantined when a READ may still be writing it."""
        self._count_failure(error)
        if isinstance(error, TransferTimeout) and not error.aborted:
            await self._quarantine(rid)
        else:
            await self.engine.abort(rid)

    async def _quarantine(self, rid: str) -> None:
        """A READ NIXL could not cancel may still write the reserved blocks: keep them out of the pool for
        ``quarantine_s`` (a later request's KV would be overwritten), then free them. The request id is
        free at once, so the prompt can be prefilled here under it."""
        key = await self.engine.quarantine_external_kv(rid)
        log.warning("request %s: its KV READ could not be cancelled; its blocks stay out of the pool for %.0f s",
                    rid, self.quarantine_s)
        release = asyncio.create_task(self._release_later(key))
        self._releases.add(release)  # the loop holds tasks weakly
        release.add_done_callback(self._releases.discard)

    async def _release_later(self, key: str) -> None:
        await asyncio.sleep(self.quarantine_s)
        await self.engine.release_quarantined_kv(key)

    def _count_failure(self, error: Exception) -> None:
        failures = self.metrics.handshake_failures if isinstance(error, HandshakeError) else \
            self.metrics.transfer_failures
        failures.labels("decode").inc()
        if isinstance(error, TicketError):
            self.metrics.kv_refused.labels("decode", "ticket", error.reason).inc()
        if isinstance(error, KVIntegrityError):  # the blocks are dropped with the reservation
            for group in error.groups:
                self.metrics.kv_integrity_failures.labels("decode", str(group)).inc()

    def _count_pull(self, rid: str, result: PullResult, reserve_s: float, resume_s: float) -> None:
        """The transfer counters, pdserve_kv_pull_stage_seconds, and one debug line with every stage (the
        READ's own included)."""
        m = self.metrics
        m.transfer_bytes.labels("decode").inc(result.num_bytes)
        m.transfer_source_bytes.labels("decode", "host").inc(result.host_bytes)
        m.transfer_source_bytes.labels("decode", "device").inc(result.num_bytes - result.host_bytes)
        m.transfer_descriptors.labels("decode").inc(result.num_descriptors)
        if result.staged:
            m.kv_staged.labels("decode", "read").inc()
        m.transfer_seconds.labels("decode").observe(result.seconds)
        stages = {"reserve": reserve_s, **result.stages, "resume": resume_s}
        for stage in PULL_STAGES:
            m.pull_stage_seconds.labels("decode", stage).observe(stages.get(stage, 0.0))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: pulled %d bytes in %d descriptors; stages (ms): %s", rid, result.num_bytes,
                      result.num_descriptors, " ".join(f"{k}={v * 1e3:.3f}" for k, v in stages.items()))


_END = object()  # the parts' stream ended


async def _feed(parts: AsyncIterator[kv_pb2.TransferTicket], queue: asyncio.Queue,
                ends_prompt: Callable[[kv_pb2.TransferTicket], bool]) -> None:
    """Move the parts onto ``queue`` as they arrive, each with its arrival time, up to the one that ends the prompt;
    then ``_END`` if the stream ended first, or what broke it (the reader raises it). Nothing past the last part is
    read: the stream is left to whoever reads it next."""
    try:
        async for ticket in parts:
            queue.put_nowait((ticket, time.perf_counter()))
            if ends_prompt(ticket):
                return
    except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
        queue.put_nowait(e)
    else:
        queue.put_nowait(_END)


async def _take_queued(queue: asyncio.Queue) -> list:
    """The next item of ``queue`` (waiting for it) and every one queued behind it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _pull_batches(tickets: list[kv_pb2.TransferTicket]) -> list[list[kv_pb2.TransferTicket]]:
    """Consecutive parts read in one pull each: all of them, but a part with a host-tier prefix on its own."""
    batches: list[list[kv_pb2.TransferTicket]] = []
    for ticket in tickets:
        if ticket.num_host_tokens or not batches or batches[-1][-1].num_host_tokens:
            batches.append([ticket])
        else:
            batches[-1].append(ticket)
    return batches
