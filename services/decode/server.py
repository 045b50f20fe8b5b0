"""The decode daemon: pull a prompt's KV from a prefill worker and stream the rest of the tokens.

``Generate(ticket)`` handshakes with the ticket's prefill engine on first contact (cached by
engine id + epoch), reserves local blocks (reusing what its own prefix cache holds), pulls the
rest over NIXL, then decodes with continuous batching alongside other requests. If the pull
fails or the peer is gone, it prefills the prompt itself: the request still completes
(pull_policy.py). Without a ticket it prefills locally (conditional disaggregation). With
``require_pull`` set (the router's ``--enforce-disagg``) it never recomputes: a pull that cannot be
done fails the call with FAILED_PRECONDITION and the reason, before any chunk.

``Probe(prefill_address)`` runs one small transfer from that prefill worker end to end (probe.py), so
the router pairs only workers that can really move KV.

The stream's first chunk is the ticket's first token, so a client of this service sees the whole
output; the router, which already sent that token, skips it. The daemon's start-up, drain and
shutdown are services/worker/daemon.py's.

The servicer is the decode side of a drain (services/worker/role_switch.py): a role switch's, and on every
worker the one that stops it (the ``Drain`` RPC, SIGTERM). Its drain keeps taking Generate calls (a router that
has not seen it yet loses nothing) and waits for them and for Probe calls; past the bound, every request still
streaming is aborted here and its stream ends with a ``migrated`` chunk (nothing new in it): the router replays
the prompt plus the tokens it has on another decode worker. A Generate that starts after that is given back the
same way as soon as it would stream. A drain to stop refuses new probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from services.common.metrics import WorkerMetrics
from services.contract.wire import sampling_from_proto, top_logprobs_to_proto
from services.decode.probe import PROBE_RESERVE_S, PairProber
from services.decode.pull_policy import PullPolicy, PullRequired, StartedRequest
from services.engine.async_engine import AsyncEngine
from services.engine.llm_engine import LLMEngine
from services.engine.output_processor import RequestOutput
from services.kv.reader.puller import KVPuller
from services.kv.spec.compat import CompatInfo
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.worker.config import DecodeConfig
from services.worker.daemon import Background, Role, WorkerContext
from services.worker.daemon import serve as serve_worker
from services.worker.drain_rpc import DrainRPCs
from services.worker.grpc_server import WorkerServer
from services.worker.kv_events import KVEventPublisher, KVEventsRPCs
from services.worker.role_switch import RoleSwitch
from services.worker.switch_rpc import SwitchRoleRPCs
from services.worker.worker_info import worker_info

# pdserve_requests_total's outcome for a request refused because its required pull could not be done
# (the failure itself is counted by the policy: handshake or transfer failures, refused tickets);
# one of REQUEST_OUTCOMES["decode"], so the series exists from the start.
PULL_REQUIRED_OUTCOME = "pull_required"


class DecodeServicer(KVEventsRPCs, SwitchRoleRPCs, DrainRPCs, worker_pb2_grpc.DecodeWorkerServicer):
    """Thin servicer: decode the message, start the request (pull_policy.py), encode the stream (KV events:
    ``KVEventsRPCs``; role switching: ``SwitchRoleRPCs``, and this is the decode ``RoleSide``, which stopping
    drains too: ``DrainRPCs``)."""

    accepts_while_draining = True  # a request a router sends during the drain is migrated, never lost

    def __init__(self, server: WorkerServer, engine: AsyncEngine, policy: PullPolicy, compat: CompatInfo,
                 engine_id: str, epoch: int, metrics: WorkerMetrics, prober: PairProber | None = None,
                 kv_events: KVEventPublisher | None = None, switch: RoleSwitch | None = None) -> None:
        self.server = server
        self.kv_events = kv_events
        self.engine = engine
        self.policy = policy
        self.compat = compat
        self.engine_id = engine_id
        self.metrics = metrics
        self.prober = prober
        self.switch = switch or RoleSwitch("decode", epoch)
        self.num_active = 0  # Generate and Probe calls in flight: what a switch's drain waits for
        self.migrating = False  # a switch's drain ran out: streams end migrated
        self._streaming: set[str] = set()  # request ids whose engine stream is being read
        self._migrated: set[str] = set()  # ... of those, the ones aborted to be given back

    @property
    def epoch(self) -> int:
        return self.switch.epoch

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        async with self._serving(context):
            async for chunk in self._generate(request, context):
                yield chunk

    @contextlib.asynccontextmanager
    async def _serving(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """A generation admitted (this role, a seat in flight) and counted active while it streams."""
        await self.admit_role("decode", context)
        async with self.server.in_flight.admit(context, "decode worker"):
            self.num_active += 1
            try:
                yield
            finally:
                self.num_active -= 1

    @contextlib.asynccontextmanager
    async def _refusals_as_status(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Starting a request: bad input ends the call INVALID_ARGUMENT, a required pull that could not be
        done FAILED_PRECONDITION, each counted."""
        try:
            yield
        except ValueError as e:
            self.metrics.requests.labels("decode", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except PullRequired as e:
            self.metrics.requests.labels("decode", PULL_REQUIRED_OUTCOME).inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the KV pull is required and could not be done: {e.reason}")

    async def _generate(self, request: worker_pb2.GenerateRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.TokenChunk]:
        started = time.monotonic()
        prompt = list(request.prompt_token_ids)
        async with self._refusals_as_status(context):
            params = sampling_from_proto(request.params)
            ticket = request.ticket if request.HasField("ticket") else None
            if request.num_output_tokens > len(prompt):
                raise ValueError(f"num_output_tokens {request.num_output_tokens} exceeds the prompt's "
                                 f"{len(prompt)} tokens")
            start = await self.policy.start(request.request_id, prompt, params, ticket,
                                            require_pull=request.require_pull,
                                            num_output_tokens=request.num_output_tokens)
        async for chunk in self._stream(request.request_id, len(prompt), start, started):
            yield chunk

    async def GenerateParts(self, request_iterator: AsyncIterator[worker_pb2.GenerateInput],  # noqa: N802
                            context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.TokenChunk]:
        """Generate whose KV arrives as part tickets, pulled as they come (``PullPolicy.start_parts``)."""
        context = InputFirstContext(context, request_iterator)
        async with self._serving(context):
            async for chunk in self._generate_parts(request_iterator, context):
                yield chunk

    async def _generate_parts(self, inputs: AsyncIterator[worker_pb2.GenerateInput],
                              context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.TokenChunk]:
        started = time.monotonic()
        first = await anext(aiter(inputs), None)
        if first is None or not first.HasField("start") or first.start.HasField("ticket"):
            self.metrics.requests.labels("decode", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "GenerateParts starts with a GenerateRequest "
                                "without a ticket; its KV comes in the part tickets after it")
        request, prompt = first.start, list(first.start.prompt_token_ids)
        async with self._refusals_as_status(context):
            params = sampling_from_proto(request.params)
            start = await self.policy.start_parts(request.request_id, prompt, params, _part_tickets(inputs),
                                                  require_pull=request.require_pull)
        async for chunk in self._stream(request.request_id, len(prompt), start, started):
            yield chunk

    async def _stream(self, rid: str, num_prompt_tokens: int, start: StartedRequest,
                      started: float) -> AsyncIterator[worker_pb2.TokenChunk]:
        """The request's chunks, timed: TTFT here is arrival (pull included) to the first token this
        worker produced, then the gaps between chunks, then the whole request.

        A caller that leaves while the ticket's first token is out, before the engine's stream began,
        aborts the request here: only a stream that began aborts it itself (``AsyncEngine.outputs``).
        A request a switch's drain gives back (``evict``) ends with a ``migrated`` chunk instead.
        """
        if start.emit_first:  # the ticket's first token, when the engine restarted the request without it
            try:
                yield worker_pb2.TokenChunk(token_ids=start.emit_first, num_prompt_tokens=num_prompt_tokens,
                                            recomputed_locally=True)
            except BaseException:
                await asyncio.shield(self.engine.abort(rid))
                raise
        if self.migrating:  # the drain ran out before this request streamed: give it back at once
            await self.engine.abort(rid)
            yield self._give_back(num_prompt_tokens)
            return
        last, num_outputs = None, 0
        join = self.metrics.join_stage_seconds
        if start.join is not None:
            join.labels("decode", "last_pull").observe(start.join.last_pull_s)
            join.labels("decode", "resume").observe(start.join.resume_s)
        self._streaming.add(rid)
        try:
            async for out in self.engine.outputs(rid):
                now = time.monotonic()
                num_outputs += 1
                if last is None:
                    self.metrics.ttft.labels("decode").observe(now - started)
                else:
                    self.metrics.itl.labels("decode").observe(now - last)
                if num_outputs == 2 and start.join is not None:  # the first after the ticket's token
                    join.labels("decode", "first_step").observe(time.perf_counter() - start.join.resumed_at)
                chunk = _chunk(out, num_prompt_tokens, start.recomputed_locally)
                if last is None and out.prompt_logprobs is not None:
                    chunk.prompt_logprobs.extend(top_logprobs_to_proto(out.prompt_logprobs))
                last = now
                yield chunk
        except asyncio.CancelledError:
            # evict() aborted it: the engine ended its stream with CancelledError (not this task's cancellation).
            if rid not in self._migrated or asyncio.current_task().cancelling():
                raise
            yield self._give_back(num_prompt_tokens)
            return
        finally:
            self._streaming.discard(rid)
            self._migrated.discard(rid)
        self.metrics.e2e.labels("decode").observe(time.monotonic() - started)
        self.metrics.requests.labels("decode", "finished").inc()

    def _give_back(self, num_prompt_tokens: int) -> worker_pb2.TokenChunk:
        self.metrics.requests.labels("decode", "migrated").inc()
        return worker_pb2.TokenChunk(migrated=True, num_prompt_tokens=num_prompt_tokens)

    # ---- the decode side of a role switch (services/worker/role_switch.py) ----------------------------------

    def outstanding(self) -> int:
        """Generate and Probe calls in flight."""
        return self.num_active

    async def evict(self) -> int:
        """Past the drain bound: abort every streaming request so its stream ends migrated; later ones too."""
        self.migrating = True
        rids = sorted(self._streaming)
        self._migrated.update(rids)
        for rid in rids:
            await self.engine.abort(rid)
        return len(rids)

    def start_epoch(self, epoch: int) -> None:
        """Serve decode again (the epoch is the switch's): requests stream normally."""
        self.migrating = False

    def resume(self) -> None:
        """The switch away failed or was cancelled: requests stream normally again."""
        self.migrating = False

    async def Abort(self, request: worker_pb2.AbortRequest, context):  # noqa: N802
        return worker_pb2.AbortResponse(aborted=await self.engine.abort(request.request_id))

    async def Info(self, request: worker_pb2.InfoRequest, context):  # noqa: N802
        return worker_info(self.engine, self.engine_id, self.switch, self.compat, self.server.in_flight.draining)

    async def Probe(self, request: worker_pb2.ProbeRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        """Pull a probe ticket from the prefill worker (probe.py), within the caller's deadline."""
        if self.prober is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this decode worker runs no KV probes")
        if not request.prefill_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prefill_address is required")
        await self.admit_role("decode", context)
        if self.switch.stopping:  # a probe would only hold up the drain: the worker is going away
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this decode worker is draining to stop")
        async with self.server.in_flight.admit(context, "decode worker"):
            self.num_active += 1
            try:
                remaining = context.time_remaining()
                timeout_s = self.prober.timeout_s if remaining is None else min(self.prober.timeout_s, remaining)
                result = await self.prober.probe(request.prefill_address, timeout_s)
            finally:
                self.num_active -= 1
        return result.to_proto()


class InputFirstContext:
    """A bidi call's context whose ``abort`` reads the caller's input to its end before it ends the call.

    A gRPC asyncio client that is still writing when the call's status arrives loses that status: the
    failed write replaces it with ``INTERNAL: Internal error from Core`` (grpc/grpc#36066), so a router
    relaying part tickets would see a broken worker instead of the refusal and its reason. The input ends
    when the router has relayed the prefill's last part (or gave up: then the call is cancelled), and the
    call's deadline bounds the wait; the tickets read meanwhile are dropped (the router releases them)."""

    def __init__(self, context: grpc.aio.ServicerContext, inputs: AsyncIterator) -> None:
        self._context = context
        self._inputs = inputs

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        async for _ in self._inputs:
            pass
        await self._context.abort(code, details, trailing_metadata)

    def __getattr__(self, name: str):
        return getattr(self._context, name)


async def _part_tickets(inputs: AsyncIterator[worker_pb2.GenerateInput]) -> AsyncIterator:
    """The part tickets after GenerateParts' first message; anything else is a ValueError."""
    async for message in inputs:
        if not message.HasField("part") or message.HasField("start"):
            raise ValueError("every GenerateParts message after the first is one part ticket")
        yield message.part


def _chunk(out: RequestOutput, num_prompt_tokens: int, recomputed: bool) -> worker_pb2.TokenChunk:
    n = len(out.new_token_ids)
    return worker_pb2.TokenChunk(
        token_ids=out.new_token_ids,
        logprobs=out.logprobs[-n:] if out.logprobs and n else [],
        top_logprobs=top_logprobs_to_proto(out.top_logprobs[-n:]) if out.top_logprobs and n else [],
        text=out.new_text,
        finished=out.finished,
        finish_reason=out.finish_reason or "",
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        recomputed_locally=recomputed,
    )


def _attach(context: WorkerContext) -> list[Background]:
    """Pull KV with this engine's compatibility, and serve Generate."""
    config = context.config
    puller = KVPuller(engine_id=context.engine_id, identity=context.identity, ranks=context.ranks,
                      auth_token=config.kv_auth_token, transfer_timeout_s=config.kv_transfer_timeout_s, tls=context.tls,
                      corrupt_pulled_kv_after=context.faults.get("kv_corrupt"))
    # A READ NIXL could not cancel gets as long again to land before its blocks are reused.
    policy = PullPolicy(context.aengine, puller, context.metrics, reserve_timeout_s=config.kv_transfer_timeout_s,
                        quarantine_s=config.kv_transfer_timeout_s)
    switch = context.switch or RoleSwitch("decode", context.epoch)
    servicer = DecodeServicer(context.server, context.aengine, policy, puller.compat, context.engine_id,
                              context.epoch, context.metrics, _prober(context, puller), context.kv_events, switch)
    servicer.default_drain_timeout_s = config.drain_timeout_s
    switch.add_side("decode", servicer)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, context.server.server)
    return []


def _prober(context: WorkerContext, puller: KVPuller) -> PairProber:
    """Probes pull through the requests' puller (the handshake they make is cached for requests), with a
    short wait for KV room, this engine's shape, and the worker's own token and TLS to dial with."""
    config, engine = context.config, context.engine
    policy = PullPolicy(context.aengine, puller, context.metrics,
                        reserve_timeout_s=min(PROBE_RESERVE_S, config.kv_transfer_timeout_s),
                        quarantine_s=config.kv_transfer_timeout_s)
    return PairProber(context.aengine, policy, context.metrics, block_size=engine.config.block_size,
                      tp_size=engine.config.parallel.tp_size, vocab_size=engine.model_config.vocab_size,
                      max_model_len=engine.max_model_len, auth_token=config.kv_auth_token, tls=context.tls,
                      timeout_s=config.kv_transfer_timeout_s)


DECODE = Role("decode", ("pdserve.v1.DecodeWorker",), _attach, stats_interval_s=0.5)


async def serve(config: DecodeConfig, engine: LLMEngine) -> str | None:
    """Run the decode daemon until stopped (SIGTERM/SIGINT, after its drain); the failure that stopped it, if
    one did."""
    return await serve_worker(config, engine, DECODE)
