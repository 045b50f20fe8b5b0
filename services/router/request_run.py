"""One request's run over its pair: the prefill leg (with the KV-parts relay), the decode leg, its migrations and
failovers, and the clean-up; the route diagram is ``flow.py``'s, whose ``Dispatcher`` starts a run and accounts for it.

The decode stream of a ticketed ``Generate`` starts with the ticket's first token (the engine's
``complete_external_kv`` reports it as the request's first output); the client already has it,
so the router skips it there.

A decode worker switching roles may give a request back unfinished (its drain ran past the bound; the
stream's last chunk says ``migrated``): the request goes on, in the same client stream, on another decode
worker, as a ``Generate`` without a ticket whose prompt is the prompt plus every token generated so far and
whose ``max_tokens`` is what is left; that worker prefills it (as its own recompute path would) and goes on
exactly where the first stopped under greedy sampling. Counted in ``pdserve_router_migrated_requests_total``.
A decode worker that refuses the call for its role (``ROLE_REFUSED_KEY``: its switch ended while this request's
Generate was on the way, after pairing) is the same case with nothing generated there yet.

A decode worker that breaks mid-request (its stream fails with UNAVAILABLE, a reset or an internal error, ends
before the request finished, or is cut because the worker was marked down and the stream went silent:
``failover.py``) is failed over the same way: the request goes on at another decode worker (or the same one once
it is back, within ``decode_failover_wait_s`` and the request's deadline) from the prompt and the tokens sent so
far, at most ``--max-decode-failovers`` times; non-streamed requests never see it. Counted in
``pdserve_router_decode_failovers_total{reason}`` and logged. Under ``--enforce-disagg`` the request fails as
before (a failover would prefill the prompt on the decode worker).

``clean_up`` tells the workers to drop what the request still holds there (the decode request aborted, the
prefill worker's pinned blocks released), shielded from the cancellation that may have brought it there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import grpc

from services.contract.wire import ROLE_REFUSED_KEY
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2
from services.router.config import RouterConfig
from services.router.errors import (
    FAILOVER_CODES,
    WORKER_FAULT_CODES,
    DisaggregationFailed,
    NoHealthyWorkers,
    WorkerFailure,
    from_rpc_error,
)
from services.router.failover import DecodeWatch, LostDecode, next_decode_worker
from services.router.generation import Alternatives, Delta, GenerationRequest, Outcome, alternatives_of
from services.router.kv_parts import PartRelay
from services.router.metrics import RouterMetrics
from services.router.pairing import Assignment, PairingPolicy, Role
from services.router.routes import Route
from services.router.workers import WorkerPool
from services.text.stream import TextStream
from services.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Dispatch(Protocol):
    """What a run uses of the dispatcher that started it (``flow.Dispatcher``): the app's shared parts."""

    config: RouterConfig
    policy: PairingPolicy
    pool: WorkerPool
    tokenizer: Tokenizer | None
    metrics: RouterMetrics
    watch: DecodeWatch


@dataclass(eq=False)  # hashed by identity: the decode watch keeps runs in sets
class RequestRun:
    """The per-request state the clean-up needs: what was started and what finished."""

    owner: Dispatch
    request: GenerationRequest
    assignment: Assignment
    outcome: Outcome
    prefill_sent: bool = False
    prefill_answered: bool = False
    prefill_holds_blocks: bool = False
    ticket_refused: bool = False  # its decode worker refused the call for its role: the ticket was never read
    prefill_call: grpc.aio.UnaryStreamCall | None = None  # PrefillStream (kv_parts), until it answered
    parts: PartRelay | None = None  # the part tickets relayed into the decode call, once the first came
    decode_call: grpc.aio.UnaryStreamCall | grpc.aio.StreamStreamCall | None = None
    decode_finished: bool = False
    require_pull: bool = False  # the Generate call carries require_pull (--enforce-disagg, with a ticket)
    output_token_ids: list[int] = field(default_factory=list)  # every token sent on so far (a migration replays them)
    migrated: bool = False  # the last decode stream ended with the worker giving the request back
    lost: LostDecode | None = None  # the last decode stream broke: deltas() continues elsewhere
    cut: LostDecode | None = None  # the decode watch cut the stream (lose_decode); its reader takes it
    last_chunk_s: float = 0.0  # when the decode stream last delivered (or started): the decode watch reads it
    num_failovers: int = 0
    failed_over: bool = False  # a decode worker broke: the ticket's blocks are released at the end in any case
    # Workers that failed this request: broken or gone, they are not asked to clean up.
    failed: set[Role] = field(default_factory=set)
    text: TextStream = field(init=False)

    def __post_init__(self) -> None:
        self.text = TextStream(self.owner.tokenizer, self.request.prompt_token_ids, tuple(self.request.params.stop),
                               self.request.keep_special_tokens)

    def _deadline_s(self) -> float:
        """When the request's time is up (monotonic)."""
        return self.request.arrival_s + self.owner.config.request_timeout_s

    def _remaining_s(self) -> float:
        return max(self._deadline_s() - time.monotonic(), 0.001)

    async def deltas(self) -> AsyncIterator[Delta]:
        ticket: kv_pb2.TransferTicket | None = None
        first: Delta | None = None
        self.owner.metrics.added_latency.observe(time.monotonic() - self.request.arrival_s)
        if self.assignment.prefill is None:
            self.outcome.route = Route.DIRECT
        else:
            response = await self._prefill(self.assignment.prefill)
            self.outcome.route = Route.FALLBACK if response is None else Route.DISAGGREGATED
            if response is not None:
                first, ticket = self._first_delta(response), response.ticket
        if first is not None:
            yield first
            if first.finish_reason is not None:
                return  # done at the first token; clean_up releases blocks if a stop string ended it
        while True:
            async with aclosing(self._decode(self.assignment.decode, ticket)) as deltas:
                async for delta in deltas:
                    yield delta
            if not self.migrated and self.lost is None:
                return
            ticket = None  # the next decode worker replays prompt + output instead
            if len(self.output_token_ids) >= self.request.params.max_tokens:  # all out before it moved or broke
                self.decode_finished = True
                yield Delta(self.text.feed([], final=True), (), (), "length")
                return
            await self._move_on()

    async def _move_on(self) -> None:
        """Its decode worker gave the request back (``migrated``: a role switch) or broke (``lost``, failover.py):
        the request goes on at another decode worker, counted there from now on."""
        lost, self.lost, self.migrated = self.lost, None, False
        old, rid, done = self.assignment.decode, self.request.request_id, len(self.output_token_ids)
        self.decode_call = None
        if lost is None:
            new = self.owner.policy.move_decode(self.assignment)
            if new is None:
                raise NoHealthyWorkers(f"decode worker {old} gave request {rid} back (a role switch) and no other "
                                       "decode worker is available", retry_after_s=self.owner.config.retry_after_s)
            self.owner.metrics.migrated_requests.inc()
            log.info("request %s: decode worker %s gave it back (role switch) after %d tokens; continuing on %s",
                     rid, old, done, new)
            return
        self.num_failovers += 1
        self.failed_over = True
        new = await next_decode_worker(self.owner.policy, self.assignment,
                                       min(self.owner.config.decode_failover_wait_s, self._remaining_s()))
        if new is None:
            log.warning("request %s: decode worker %s broke (%s) and no decode worker took the request on",
                        rid, old, lost.detail)
            raise lost.error
        self.failed.discard(Role.DECODE)  # the new worker is asked to clean up, if it comes to that
        self.owner.metrics.decode_failovers.labels(lost.reason).inc()
        log.warning("request %s: decode worker %s broke (%s) after %d tokens; continuing on %s", rid, old,
                    lost.detail, done, new)

    def _broke(self, address: str, lost: LostDecode) -> None:
        """The decode stream on ``address`` broke: ``lost`` is kept for ``_move_on`` when the request may fail
        over (not strict, failovers left, time left), else its error is raised. The worker is marked failed
        either way (a watch's cut: it is marked down already, so it is only not asked to clean up)."""
        if lost.reason == "marked_down":
            self.failed.add(Role.DECODE)
        else:
            self._worker_failed(Role.DECODE, address, lost.detail)
        config = self.owner.config
        if (not config.enforce_disagg and self.num_failovers < config.max_decode_failovers
                and time.monotonic() < self._deadline_s()):
            self.lost = lost
            return
        log.warning("request %s: decode worker %s broke (%s)", self.request.request_id, address, lost.detail)
        raise lost.error

    def lose_decode(self, reason: str) -> None:
        """The decode watch's cut (failover.py): the worker is marked down and this stream went silent."""
        if self.decode_finished or self.decode_call is None:
            return
        self.cut = LostDecode("marked_down", f"worker marked down: {reason}",
                              WorkerFailure(f"decode worker {self.assignment.decode} was lost mid-request "
                                            f"({reason})", role=Role.DECODE))
        self.decode_call.cancel()  # the stream's reader gets CancelledError and fails over

    # ---- prefill ---------------------------------------------------------------------------------

    async def _prefill(self, address: str) -> worker_pb2.PrefillResponse | None:
        """The prefill worker's answer, or None when it failed (the request falls back to decode; under
        --enforce-disagg it fails with DisaggregationFailed instead)."""
        self.prefill_sent = True
        try:
            response = await self._prefill_parts(address) if self.owner.config.kv_parts else None
            if response is None:  # per-chunk KV off, or a prefill worker that predates PrefillStream
                response = await self.owner.pool.prefill(
                    address, self.request.request_id, self.request.prompt_token_ids, self.request.params,
                    self.assignment.reader_tp_size, timeout_s=self._remaining_s(),
                    reader_block_size=self.assignment.reader_block_size,
            reader_compat_hash=self.assignment.reader_compat_hash)
        except grpc.aio.AioRpcError as exc:
            if self.parts is not None:
                self.parts.close()  # no last part: the decode worker prefills the prompt (or is cancelled)
            if exc.code() not in WORKER_FAULT_CODES:
                raise from_rpc_error(exc, Role.PREFILL, address) from None
            self._worker_failed(Role.PREFILL, address, f"{exc.code().name}: {exc.details()}")
            if self.owner.config.enforce_disagg:
                raise DisaggregationFailed(f"prefill worker {address} failed ({exc.code().name}: {exc.details()}) "
                                           "and --enforce-disagg forbids prefilling the prompt on a decode "
                                           "worker") from None
            log.warning("request %s: prefill worker %s failed; decoding without it",
                        self.request.request_id, address)
            return None
        finally:
            self.owner.policy.finish_prefill(self.assignment)
        self.prefill_answered = True
        self.prefill_holds_blocks = response.HasField("ticket")
        return response

    async def _prefill_parts(self, address: str) -> worker_pb2.PrefillResponse | None:
        """``PrefillStream``: relay each part ticket to the decode worker (``GenerateParts``, opened at the
        first), then the final answer's ticket as the last part (kv_parts.py). None when the worker predates
        the RPC (UNIMPLEMENTED before any part: the caller prefills with ``Prefill``)."""
        call = self.owner.pool.prefill_stream(
            address, self.request.request_id, self.request.prompt_token_ids, self.request.params,
            self.assignment.reader_tp_size, timeout_s=self._remaining_s(),
            reader_block_size=self.assignment.reader_block_size,
            reader_compat_hash=self.assignment.reader_compat_hash)
        self.prefill_call = call
        try:
            async for message in call:
                if not message.HasField("final"):
                    self._relay(message.part)
                    continue
                response = message.final
                if self.parts is not None:
                    if response.HasField("ticket"):
                        self.parts.put(response.ticket)
                    elif self.decode_call is not None:
                        self.decode_call.cancel()  # done at the first token: nothing to decode
                    self.parts.close()
                return response
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED and self.parts is None:
                return None
            raise
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "PrefillStream ended without its final answer")

    def _relay(self, part: kv_pb2.TransferTicket) -> None:
        """Pass a part ticket on; the first opens the decode worker's ``GenerateParts``."""
        if self.parts is None:
            self.parts = PartRelay()
            prompt, params = self._decode_input(part)
            self.require_pull = self.owner.config.enforce_disagg
            self.owner.policy.generate_sent(self.assignment)
            self.decode_call = self.owner.pool.generate_parts(
                self.assignment.decode, self.request.request_id, prompt, params, self.parts,
                timeout_s=self._remaining_s(), require_pull=self.require_pull)
            self._watch(self.assignment.decode)
        self.parts.put(part)

    def _first_delta(self, response: worker_pb2.PrefillResponse) -> Delta:
        self.outcome.num_cached_tokens = response.num_cached_tokens
        self.outcome.num_generated_tokens = 1
        self.output_token_ids.append(response.first_token_id)
        finished = response.finished
        text = self.text.feed([response.first_token_id], final=finished)
        finish_reason = (response.finish_reason or "stop") if finished else None
        if self.text.stopped:
            finish_reason = "stop"
        if not finished and finish_reason is None and not response.HasField("ticket"):
            raise WorkerFailure(f"prefill worker {self.assignment.prefill} answered an unfinished request "
                                "without a transfer ticket")
        params = self.request.params
        logprobs = (response.first_logprob,) if params.logprobs else ()
        top = (alternatives_of(response.first_top_logprobs),) if params.top_logprobs else ()
        prompt = tuple(alternatives_of(e) or None for e in response.prompt_logprobs) \
            if params.HasField("prompt_logprobs") else None
        return Delta(text, (response.first_token_id,), logprobs, finish_reason, top, prompt)

    # ---- decode ----------------------------------------------------------------------------------

    def _decode_input(self, ticket: kv_pb2.TransferTicket | None) -> tuple[list[int], worker_pb2.SamplingParams]:
        """The prompt and params of the next ``Generate``: the request's own, or after a migration the prompt
        plus the output so far with only what is left to generate (as a decode worker's local recompute)."""
        params = self.request.params
        done = len(self.output_token_ids)
        if (ticket is not None or done) and params.HasField("prompt_logprobs"):
            # The prefill worker (or the first decode worker) reported them; they are not asked again.
            params = worker_pb2.SamplingParams()
            params.CopyFrom(self.request.params)
            params.ClearField("prompt_logprobs")
        if not done or ticket is not None:
            return self.request.prompt_token_ids, params
        rest = worker_pb2.SamplingParams()
        rest.CopyFrom(params)
        rest.max_tokens = max(params.max_tokens - done, 1)
        rest.min_tokens = max(params.min_tokens - done, 0)
        return [*self.request.prompt_token_ids, *self.output_token_ids], rest

    async def _decode(self, address: str, ticket: kv_pb2.TransferTicket | None) -> AsyncIterator[Delta]:
        call = self._open_decode(address, ticket)
        skip_first, answered = ticket is not None, False
        try:
            async for chunk in call:
                self.last_chunk_s = time.monotonic()
                if chunk.migrated:  # the worker gave the request back (its role switch): go on elsewhere
                    self.migrated = True
                    return
                answered = True
                token_ids, logprobs = list(chunk.token_ids), list(chunk.logprobs)
                top = [alternatives_of(e) for e in chunk.top_logprobs]
                if skip_first and token_ids:
                    skip_first = False
                    if token_ids[0] != ticket.first_token_id:
                        log.warning("request %s: decode stream starts with token %d, not the ticket's %d",
                                    self.request.request_id, token_ids[0], ticket.first_token_id)
                    token_ids, logprobs, top = token_ids[1:], logprobs[1:], top[1:]
                delta = self._decode_delta(chunk, token_ids, logprobs, top)
                if delta.token_ids or delta.finish_reason is not None:
                    yield delta
                if delta.finish_reason is not None:
                    return
        except asyncio.CancelledError:
            cut, self.cut = self.cut, None
            if cut is None or _being_cancelled():
                raise
            self._broke(address, cut)  # the decode watch cut it: deltas() fails over, or the error is raised
            return
        except grpc.aio.AioRpcError as exc:
            self._decode_failed(address, ticket, exc, answered)  # raises unless it migrates or fails over
            return
        finally:
            self.owner.watch.untrack(self)
        self._broke(address, LostDecode("ended", "stream ended before the request finished", WorkerFailure(
            f"decode worker {address} ended the stream before the request finished", role=Role.DECODE)))

    def _open_decode(self, address: str, ticket: kv_pb2.TransferTicket | None
                     ) -> grpc.aio.UnaryStreamCall | grpc.aio.StreamStreamCall | None:
        """The decode call to read: the ``GenerateParts`` open since the first part ticket (it has every part),
        else a ``Generate`` of its own on ``address``, watched from now on."""
        if self.parts is not None:
            self.parts = None  # a migration's next decode worker gets a Generate of its own
            return self.decode_call
        prompt, params = self._decode_input(ticket)
        num_output_tokens = len(prompt) - len(self.request.prompt_token_ids)
        self.require_pull = ticket is not None and self.owner.config.enforce_disagg
        self.owner.policy.generate_sent(self.assignment)
        call = self.owner.pool.generate(address, self.request.request_id, prompt, params, ticket,
                                        timeout_s=self._remaining_s(), require_pull=self.require_pull,
                                        num_output_tokens=num_output_tokens)
        self.decode_call = call
        self._watch(address)
        return call

    def _decode_failed(self, address: str, ticket: kv_pb2.TransferTicket | None, exc: grpc.aio.AioRpcError,
                       answered: bool) -> None:
        """The decode call failed: a refusal for its role before any answer goes on elsewhere (as a migration),
        a broken stream fails over (``_broke``); anything else is raised as the client's error."""
        if not answered and _refused_for_its_role(exc):
            # It switched roles after this request was paired with it (its Generate was on the way when
            # the drain ended): nothing was done there, so go on elsewhere, as a migration.
            self.migrated = True
            if ticket is not None:
                self.ticket_refused = True
            return
        error = from_rpc_error(exc, Role.DECODE, address, pull_required=self.require_pull)
        if exc.code() in FAILOVER_CODES:
            self._broke(address, LostDecode("broken", f"{exc.code().name}: {exc.details()}", error))
            return
        if exc.code() in WORKER_FAULT_CODES:
            self._worker_failed(Role.DECODE, address, f"{exc.code().name}: {exc.details()}")
            log.warning("request %s: decode worker %s failed (%s: %s)", self.request.request_id, address,
                        exc.code().name, exc.details())
        if isinstance(error, DisaggregationFailed):  # refused, not served: no route to count
            self.outcome.route = ""
            log.warning("request %s: %s", self.request.request_id, error.message)
        raise error from None

    def _watch(self, address: str) -> None:
        """The decode stream on ``address`` starts: the decode watch may cut it if the worker is lost."""
        self.last_chunk_s = time.monotonic()
        self.owner.watch.track(self, address)

    def _decode_delta(self, chunk: worker_pb2.TokenChunk, token_ids: list[int], logprobs: list[float],
                      top: list[Alternatives]) -> Delta:
        outcome = self.outcome
        if chunk.recomputed_locally:
            if self.require_pull:  # a decode worker that predates require_pull recomputed anyway
                outcome.route = ""
                raise DisaggregationFailed(f"decode worker {self.assignment.decode} recomputed the prompt instead "
                                           "of pulling its KV (it ignores require_pull: an older worker?), and "
                                           "--enforce-disagg forbids that")
            outcome.recomputed_locally = True
            outcome.route = Route.FALLBACK
        outcome.num_generated_tokens += len(token_ids)
        self.output_token_ids += token_ids
        if outcome.num_cached_tokens is None and chunk.num_prompt_tokens:
            outcome.num_cached_tokens = chunk.num_cached_tokens
        text = self.text.feed(token_ids, final=chunk.finished)
        finish_reason = (chunk.finish_reason or "stop") if chunk.finished else None
        if self.text.stopped:
            finish_reason = "stop"
        self.decode_finished = chunk.finished
        params = self.request.params
        logprobs_out = tuple(logprobs) if params.logprobs else ()
        top_out = tuple(top) if params.top_logprobs else ()
        prompt = None
        if params.HasField("prompt_logprobs") and chunk.prompt_logprobs:
            prompt = tuple(alternatives_of(e) or None for e in chunk.prompt_logprobs)
        return Delta(text, tuple(token_ids), logprobs_out, finish_reason, top_out, prompt)

    def _worker_failed(self, role: Role, address: str, reason: str) -> None:
        self.failed.add(role)
        self.owner.policy.mark_unhealthy(role, address, reason)
        self.owner.metrics.worker_failures.labels(role.value).inc()

    # ---- clean-up --------------------------------------------------------------------------------

    async def clean_up(self) -> None:
        """Tell the workers to drop whatever this request still holds there; never raises."""
        calls = []
        self.owner.watch.untrack(self)  # a GenerateParts opened during a prefill that never got to _decode
        rid, timeout_s = self.request.request_id, self.owner.config.cleanup_timeout_s
        pool, prefill, decode = self.owner.pool, self.assignment.prefill, self.assignment.decode
        if self.decode_call is not None and not self.decode_finished:
            self.decode_call.cancel()
            if Role.DECODE not in self.failed:
                calls.append(pool.abort(Role.DECODE, decode, rid, timeout_s))
        if self.prefill_call is not None and not self.prefill_answered:
            self.prefill_call.cancel()  # its handler releases what its part tickets pinned
        if prefill is None or Role.PREFILL in self.failed:
            pass
        elif self.prefill_sent and not self.prefill_answered:
            calls += [pool.abort(Role.PREFILL, prefill, rid, timeout_s), pool.release(prefill, rid, timeout_s)]
        elif self.prefill_holds_blocks and (not self.decode_finished or self.ticket_refused or self.failed_over
                                            or self.outcome.recomputed_locally):
            # A finished decode pulled the blocks; otherwise (it recomputed the prompt after a failed pull, never
            # read the ticket, or did not finish) nobody will: the parts it did not read would wait for the lease.
            calls.append(pool.release(prefill, rid, timeout_s))
        if not calls:
            return
        tasks = [asyncio.ensure_future(call) for call in calls]
        # Shielded from the cancellation that may have brought us here; bounded by asyncio.wait's own
        # timeout, not by cancelling (a cancel scope's deadline cancelling a gather here escaped as a
        # CancelledError and cut the client's stream before its error event).
        with anyio.CancelScope(shield=True):
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
            log.info("request %s: clean-up call got no answer within %.1f s", rid, timeout_s)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.info("request %s: clean-up call failed: %s", rid, task.exception())


def _being_cancelled() -> bool:
    """This task is being cancelled (the client went away): a CancelledError is not a decode watch's cut."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _refused_for_its_role(exc: grpc.aio.AioRpcError) -> bool:
    """A worker's UNAVAILABLE for a call of a role it does not serve now (``ROLE_REFUSED_KEY``): not a fault."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and any(
        key == ROLE_REFUSED_KEY for key, _ in exc.trailing_metadata() or ())

