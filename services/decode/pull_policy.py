"""How a decode worker starts a request: pull the prompt's KV from its prefill worker, or recompute it.

With a ticket: reserve local blocks (waiting, with backoff, for room: recomputing a prompt whose KV
is ready on the prefill worker only because this worker is momentarily full would throw the
disaggregation away), pull the rest over NIXL, and complete the request with the ticket's first
token. If there is no room in time, the pull fails, or the engine refuses the first token, the
reservation is aborted and the prompt plus that first token is prefilled here, one token fewer to
go: the request still completes. Cancelled between reserving and streaming, the reservation is
aborted (nobody will read the request). Without a ticket the prompt is prefilled here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.metrics import PULL_STAGES, WorkerMetrics
from services.contract.sampling_params import SamplingParams
from services.engine.sched.request import Request
from services.kv.handshake import HandshakeError
from services.kv.nixl.errors import TransferError
from services.kv.puller import PullResult, TicketError
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

    async def abort(self, request_id: str) -> bool: ...


class Puller(Protocol):
    """Reads a ticket's KV into local blocks (``KVPuller`` does)."""

    async def pull(self, ticket: kv_pb2.TransferTicket, local_block_ids: Sequence[Sequence[int]],
                   num_cached_tokens: int = 0) -> PullResult: ...


@dataclass(frozen=True)
class StartedRequest:
    """A request the engine runs now. ``emit_first``: tokens to stream before the engine's own outputs
    (the ticket's first token, when the prompt was recomputed with it); ``recomputed_locally``: the
    prompt was prefilled here, not pulled."""

    emit_first: tuple[int, ...] = ()
    recomputed_locally: bool = False


class PullPolicy:
    """Starts decode requests: pulled KV when it can, local prefill when it must (metrics say which)."""

    def __init__(self, engine: DecodeEngine, puller: Puller, metrics: WorkerMetrics,
                 reserve_timeout_s: float = 10.0) -> None:
        self.engine = engine
        self.puller = puller
        self.metrics = metrics
        self.reserve_timeout_s = reserve_timeout_s

    async def start(self, rid: str, prompt: list[int], params: SamplingParams,
                    ticket: kv_pb2.TransferTicket | None) -> StartedRequest:
        """Start ``rid`` on the engine; ValueError for bad input (then nothing is left reserved)."""
        if ticket is None:
            await self.engine.add_request(rid, prompt, params)
            return StartedRequest()
        return await self._start_from_ticket(rid, prompt, params, ticket)

    async def _start_from_ticket(self, rid: str, prompt: list[int], params: SamplingParams,
                                 ticket: kv_pb2.TransferTicket) -> StartedRequest:
        """Reserve, pull, and start decoding; on any pull failure prefill here instead."""
        if list(ticket.groups) and ticket.num_tokens != len(prompt):
            raise ValueError(f"ticket covers {ticket.num_tokens} tokens, the prompt has {len(prompt)}")
        started = time.perf_counter()
        try:
            pulled = await self._reserve_and_pull(rid, prompt, params, ticket, started)
        except ValueError:
            raise  # bad input (a duplicate id among them): nothing was reserved under this call
        except BaseException:
            # Cancelled (the router gave up, or its deadline passed while this worker was stalled) between
            # reserving blocks and streaming: nobody will read this request, so it must not keep them.
            await asyncio.shield(self.engine.abort(rid))
            raise
        if pulled:
            return StartedRequest()
        return await self._recompute(rid, prompt, params, ticket.first_token_id)

    async def _recompute(self, rid: str, prompt: list[int], params: SamplingParams,
                         first_token_id: int) -> StartedRequest:
        """Prefill the prompt plus the first token the client already has, one token fewer to go."""
        self.metrics.local_recomputes.labels("decode").inc()
        rest = dataclasses.replace(params, max_tokens=params.max_tokens - 1, min_tokens=max(params.min_tokens - 1, 0))
        await self.engine.add_request(rid, [*prompt, first_token_id], rest, grammar_prefix=[first_token_id])
        return StartedRequest((first_token_id,), recomputed_locally=True)

    async def _reserve_and_pull(self, rid: str, prompt: list[int], params: SamplingParams,
                                ticket: kv_pb2.TransferTicket, started: float) -> bool:
        """Reserve local blocks and pull the ticket's KV into them; False when the prompt must be
        prefilled here instead (no room in time, or the pull failed: the reservation is dropped)."""
        request = await self._reserve(rid, prompt, params)
        reserved = time.perf_counter()
        if request is None:
            log.warning("request %s: no KV blocks or sequence seat free for %.0f s; prefilling locally",
                        rid, self.reserve_timeout_s)
            return False
        try:
            result = await self.puller.pull(ticket, request.block_ids, request.num_cached_tokens)
        except PULL_ERRORS as e:
            log.warning("request %s: KV pull from %s failed (%s); prefilling locally", rid, ticket.engine_id, e)
            self._count_failure(e)
            await self.engine.abort(rid)
            return False
        pulled = time.perf_counter()
        try:
            await self.engine.complete_external_kv(rid, ticket.first_token_id, ticket.first_token_logprob)
        except ValueError as e:  # the ticket's first token does not fit (e.g. not in the grammar)
            log.warning("request %s: the ticket's first token is refused (%s); prefilling locally", rid, e)
            await self.engine.abort(rid)
            return False
        resumed = time.perf_counter()
        self._count_pull(rid, result, reserved - started, resumed - pulled)
        return True

    async def _reserve(self, rid: str, prompt: list[int], params: SamplingParams) -> Request | None:
        """Reserve local blocks for the pull, waiting (bounded, with backoff) for a seat or blocks to free up;
        None when none came free in time. The prefill worker holds the blocks under its lease meanwhile."""
        deadline = time.monotonic() + self.reserve_timeout_s
        delay_s = RESERVE_FIRST_DELAY_S
        while True:
            request = await self.engine.add_request_with_external_kv(rid, prompt, params)
            if request is not None or time.monotonic() >= deadline:
                return request
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, RESERVE_MAX_DELAY_S)

    def _count_failure(self, error: Exception) -> None:
        failures = self.metrics.handshake_failures if isinstance(error, HandshakeError) else \
            self.metrics.transfer_failures
        failures.labels("decode").inc()
        if isinstance(error, TicketError):
            self.metrics.kv_refused.labels("decode", "ticket", error.reason).inc()

    def _count_pull(self, rid: str, result: PullResult, reserve_s: float, resume_s: float) -> None:
        """The transfer counters, pdserve_kv_pull_stage_seconds, and one debug line with every stage (the
        READ's own included)."""
        m = self.metrics
        m.transfer_bytes.labels("decode").inc(result.num_bytes)
        m.transfer_source_bytes.labels("decode", "host").inc(result.host_bytes)
        m.transfer_source_bytes.labels("decode", "device").inc(result.num_bytes - result.host_bytes)
        m.transfer_descriptors.labels("decode").inc(result.num_descriptors)
        m.transfer_seconds.labels("decode").observe(result.seconds)
        stages = {"reserve": reserve_s, **result.stages, "resume": resume_s}
        for stage in PULL_STAGES:
            m.pull_stage_seconds.labels("decode", stage).observe(stages.get(stage, 0.0))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: pulled %d bytes in %d descriptors; stages (ms): %s", rid, result.num_bytes,
                      result.num_descriptors, " ".join(f"{k}={v * 1e3:.3f}" for k, v in stages.items()))
