"""The prefill daemon: prefill prompts, hold their KV for the decode worker, serve the handshake.

``Prefill`` runs the prompt (prefix cache on), samples the first token, keeps the request's
blocks pinned and answers with a transfer ticket. The blocks are freed when every reading rank's
NIXL notification has arrived, on ``Release``/``Abort``, or when the lease expires (counted;
release.py). ``PrefillStream`` does the same with the KV handed out per chunk: a part ticket as each
chunk's blocks are full (pinned by the engine, services/engine/kv_parts.py), then the answer with the last
part; the request's blocks are freed once every part was read (or as above). The daemon's start-up, drain and
shutdown are services/worker/daemon.py's.

The servicer is the prefill side of a drain (services/worker/role_switch.py): a role switch's, and on every
worker the one that stops it (the ``Drain`` RPC, SIGTERM). Its drain refuses new prompts and waits for in-flight
ones and every ticket out (pulled, released or expired: the lease loop keeps running, and the handshake and
``Release`` keep being answered). On a worker that switches roles each epoch it serves starts a new exporter (a
new ticket key; peers re-handshake).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from services.common.metrics import WorkerMetrics
from services.contract.sampling_params import SamplingParams
from services.contract.wire import sampling_from_proto, top_logprobs_to_proto
from services.engine.async_engine import AsyncEngine
from services.engine.kv_parts import PinnedPart
from services.engine.llm_engine import LLMEngine
from services.engine.output_processor import RequestOutput
from services.engine.request import Request, RequestStatus
from services.kv.owner.exporter import KVExporter
from services.kv.owner.handshake import HandshakeServicer, add_handshake_service
from services.kv.reader.tickets import DEADLINE_MARGIN_S
from services.kv.spec import wire as kv_wire
from services.kv.spec.groups import KVCacheGroupSpec
from services.prefill.release import ReleaseLoop, run_current
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.worker.config import PrefillConfig
from services.worker.daemon import Background, Role, WorkerContext
from services.worker.daemon import serve as serve_worker
from services.worker.drain_rpc import DrainRPCs
from services.worker.grpc_server import WorkerServer
from services.worker.kv_events import KVEventPublisher, KVEventsRPCs
from services.worker.role_switch import RoleSwitch
from services.worker.switch_rpc import SwitchRoleRPCs
from services.worker.worker_info import worker_info

log = logging.getLogger(__name__)


class PrefillServicer(KVEventsRPCs, SwitchRoleRPCs, DrainRPCs, worker_pb2_grpc.PrefillWorkerServicer):
    """Thin servicer: decode the message, call the engine, encode the answer (KV events: ``KVEventsRPCs``;
    role switching: ``SwitchRoleRPCs``, and this is the prefill ``RoleSide``, which stopping drains too:
    ``DrainRPCs``)."""

    accepts_while_draining = False  # a switch's drain refuses new prompts: only tickets out must end

    def __init__(self, server: WorkerServer, engine: AsyncEngine, exporter: KVExporter, address: str,
                 metrics: WorkerMetrics, kv_events: KVEventPublisher, switch: RoleSwitch | None = None,
                 new_exporter: Callable[[int], KVExporter] | None = None, lease_s: float = 30.0,
                 final_part_tokens: int = 0) -> None:
        """``new_exporter``: the exporter of a new epoch (a role switch back to prefill); ``final_part_tokens``:
        ``PrefillConfig.kv_final_part_tokens``."""
        self.server = server
        self.kv_events = kv_events
        self.engine = engine
        self.exporter = exporter
        self.address = address
        self.metrics = metrics
        self.switch = switch or RoleSwitch("prefill", exporter.epoch)
        self._new_exporter = new_exporter
        self.lease_s = lease_s
        self.final_part_tokens = final_part_tokens
        self.release_loop = ReleaseLoop(engine, exporter, metrics, lease_s)
        self.num_prefilling = 0  # Prefill calls in flight

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        await self.admit_role("prefill", context)
        async with self.server.in_flight.admit(context, "prefill worker"):
            self.num_prefilling += 1
            try:
                return await self._prefill(request, context, time.monotonic())
            finally:
                self.num_prefilling -= 1

    async def _prefill(self, request: worker_pb2.PrefillRequest, context, started: float):
        rid = request.request_id
        params, held = await self._add(request, context)
        final = None
        async for out in self.engine.outputs(rid):
            final = out
        return await self._answer(request, params, held, final, started)

    async def PrefillStream(self, request: worker_pb2.PrefillRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PrefillPart]:
        """Prefill with the KV handed out per chunk (kv_parts.py): a part ticket as each chunk's blocks are
        full, then the final answer, whose ticket is the last part (a whole one when no part came before)."""
        await self.admit_role("prefill", context)
        async with self.server.in_flight.admit(context, "prefill worker"):
            self.num_prefilling += 1
            try:
                async for message in self._prefill_parts(request, context, time.monotonic()):
                    yield message
            finally:
                self.num_prefilling -= 1

    async def _prefill_parts(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext,
                             started: float) -> AsyncIterator[worker_pb2.PrefillPart]:
        """Until the final answer is out, any end (the caller went away, a part refused) releases every block
        pinned for the request and stops waiting for its readers; the engine aborts it (``outputs``)."""
        rid, num_prompt_tokens = request.request_id, len(request.prompt_token_ids)
        align = part_alignment(self.engine.engine.kv_layout.groups, request.reader_block_size)
        params, held = await self._add(request, context, align)
        parts_end, answered = 0, False
        prompt_hash = kv_wire.prompt_hash(request.prompt_token_ids)  # every part names the prompt
        try:
            final = None
            async for item in self.engine.outputs_with_parts(rid):
                if not isinstance(item, PinnedPart):
                    final = item
                    continue
                try:
                    ticket = await self.exporter.hand_out(
                        rid, item.block_ids, num_tokens=item.end, first_token_id=0, handshake_address=self.address,
                        reader_tp_size=request.reader_tp_size or 1, reader_block_size=request.reader_block_size,
                        part_start_token=parts_end, num_prompt_tokens=num_prompt_tokens, prompt_hash=prompt_hash,
                        reader_compat_hash=request.reader_compat_hash)
                except ValueError as e:  # abandoned meanwhile (Release, Abort, a part's lease)
                    await context.abort(grpc.StatusCode.ABORTED, f"request {rid}: {e}")
                parts_end = item.end
                self.metrics.requests.labels("prefill", "kv_part").inc()
                yield worker_pb2.PrefillPart(part=ticket)
            response = await self._answer(request, params, held, final, started, parts_end, prompt_hash)
            answered = True
            yield worker_pb2.PrefillPart(final=response)
        finally:
            if not answered:
                self.exporter.abandon(rid)
                await asyncio.shield(self.engine.release_held_kv(rid))

    async def _add(self, request: worker_pb2.PrefillRequest, context,
                   kv_part_align: int = 0) -> tuple[SamplingParams, Request]:
        """The request queued for its first token, blocks held when it finishes; INVALID_ARGUMENT for bad input."""
        try:
            params = sampling_from_proto(request.params)
            # An FP8-KV reader continues where its own engine would: the prefill attends over FP8-rounded K/V.
            rounding = self.exporter.quantizes_for(request.reader_compat_hash)
            held = await self.engine.add_request(request.request_id, list(request.prompt_token_ids),
                                                 _first_token_only(params), hold_kv_on_finish=True,
                                                 kv_part_align=kv_part_align,
                                                 kv_final_part_tokens=self.final_part_tokens, kv_rounding=rounding)
        except ValueError as e:
            self.metrics.requests.labels("prefill", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return params, held

    async def _answer(self, request: worker_pb2.PrefillRequest, params: SamplingParams, held: Request,
                      final: RequestOutput, started: float, parts_end: int = 0, prompt_hash: bytes | None = None
                      ) -> worker_pb2.PrefillResponse:
        """The first token and the ticket of the rest of the prompt (from ``parts_end``, where its part tickets
        ended), or ``finished`` with every block released when the first token is also the last. ``prompt_hash``:
        the prompt's (``wire.prompt_hash``), when the parts already computed it."""
        rid, num_prompt_tokens = request.request_id, len(request.prompt_token_ids)
        self.metrics.ttft.labels("prefill").observe(time.monotonic() - started)
        response = _first_token_response(final, num_prompt_tokens)
        stopped = held.status is RequestStatus.FINISHED_STOPPED  # EOS or a stop token
        if stopped or params.max_tokens == 1:  # the first token is also the last: nothing to pull
            self.exporter.abandon(rid)  # its part tickets, if any went out
            await self.engine.release_held_kv(rid)
            response.finished, response.finish_reason = True, "stop" if stopped else "length"
            self.metrics.requests.labels("prefill", "finished").inc()
            return response
        host_ids, num_host_tokens = held.host_prefix or ((), 0)  # read from the host KV tier, not the device
        if num_host_tokens <= parts_end:  # the parts covered the host-tier prefix (pinned on the device)
            host_ids, num_host_tokens = (), 0
        response.ticket.CopyFrom(await self.exporter.hand_out(
            rid, held.block_ids, num_tokens=num_prompt_tokens, first_token_id=response.first_token_id,
            first_token_logprob=response.first_logprob, handshake_address=self.address,
            reader_tp_size=request.reader_tp_size or 1, host_block_ids=host_ids, num_host_tokens=num_host_tokens,
            reader_block_size=request.reader_block_size, part_start_token=parts_end,
            num_prompt_tokens=num_prompt_tokens if parts_end else 0, state_slot=held.state_slot,
            prompt_hash=prompt_hash or kv_wire.prompt_hash(request.prompt_token_ids),
            reader_compat_hash=request.reader_compat_hash,
        ))
        self.metrics.requests.labels("prefill", "ticket").inc()
        return response

    async def Release(self, request: worker_pb2.ReleaseRequest, context):  # noqa: N802
        self.exporter.abandon(request.request_id)
        return worker_pb2.ReleaseResponse(released=await self.engine.release_held_kv(request.request_id))

    async def Abort(self, request: worker_pb2.AbortRequest, context):  # noqa: N802
        aborted = await self.engine.abort(request.request_id)
        self.exporter.abandon(request.request_id)
        released = await self.engine.release_held_kv(request.request_id)
        return worker_pb2.AbortResponse(aborted=aborted or released)

    async def Info(self, request: worker_pb2.InfoRequest, context):  # noqa: N802
        return worker_info(self.engine, self.exporter.engine_id, self.switch, self.exporter.compat,
                           self.server.in_flight.draining)

    # ---- the prefill side of a role switch (services/worker/role_switch.py) ----------------------------------

    def outstanding(self) -> int:
        """Prompts being prefilled and tickets not yet pulled, released or expired."""
        return self.num_prefilling + self.exporter.num_outstanding

    async def evict(self) -> int:
        return 0  # never called: the drain waits for the lease instead

    def start_epoch(self, epoch: int) -> None:
        """Serve prefill again under ``epoch``: a new exporter (ticket key, handshake epoch), its lease loop."""
        if self._new_exporter is None:
            raise RuntimeError("this prefill servicer cannot start another epoch")
        self.exporter = self._new_exporter(epoch)
        self.release_loop = ReleaseLoop(self.engine, self.exporter, self.metrics, self.lease_s)

    def resume(self) -> None:
        pass  # a prefill drain changed nothing: the refusal of new prompts ends with the switch

    async def run_release_loop(self, stop: asyncio.Event) -> None:
        """The current epoch's lease loop (a background task of the daemon)."""
        await run_current(lambda: self.release_loop, stop)


def part_alignment(groups: Sequence[KVCacheGroupSpec], reader_block_size: int) -> int:
    """Tokens a part ticket ends on a multiple of: a block boundary in every group here and at the reader (its
    block size, or the gcd of its groups'; 0: this engine's), so each part starts where a pull can start."""
    return math.lcm(*(g.block_size for g in groups), reader_block_size or 1)


def _first_token_only(params: SamplingParams) -> SamplingParams:
    """Only the first token is sampled here (stop strings are the decode side's); min_tokens still bans
    EOS from it."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=(),
                               return_logits=False)


def _first_token_response(final: RequestOutput, num_prompt_tokens: int) -> worker_pb2.PrefillResponse:
    """The first token, its logprob and alternatives, and the prompt's logprobs when asked for."""
    response = worker_pb2.PrefillResponse(
        first_token_id=final.token_ids[0], first_logprob=final.logprobs[0] if final.logprobs else 0.0,
        num_prompt_tokens=num_prompt_tokens, num_cached_tokens=final.num_cached_tokens,
    )
    if final.top_logprobs:
        response.first_top_logprobs.CopyFrom(top_logprobs_to_proto(final.top_logprobs[:1])[0])
    if final.prompt_logprobs is not None:
        response.prompt_logprobs.extend(top_logprobs_to_proto(final.prompt_logprobs))
    return response


def _attach(context: WorkerContext) -> list[Background]:
    """Publish the engine's KV (exporter and handshake), serve Prefill, and keep the leases."""
    engine, config = context.engine, context.config
    if config.kv_lease_s <= 2 * DEADLINE_MARGIN_S:
        log.warning("--kv-lease-s %g: decode workers refuse a ticket within %g s of its lease's end, so most "
                    "tickets will be refused and their prompts recomputed", config.kv_lease_s, DEADLINE_MARGIN_S)

    def exporter_of(epoch: int) -> KVExporter:
        return KVExporter(engine_id=context.engine_id, model_name=engine.source.name, ranks=context.ranks,
                          epoch=epoch, identity=context.identity, lease_s=config.kv_lease_s,
                          checkpoint_kv_scales=engine.source.kv_scales)

    switch = context.switch or RoleSwitch("prefill", context.epoch)
    servicer = PrefillServicer(context.server, context.aengine, exporter_of(switch.epoch), context.address,
                               context.metrics, context.kv_events, switch, exporter_of, config.kv_lease_s,
                               config.kv_final_part_tokens)
    servicer.default_drain_timeout_s = config.drain_timeout_s
    switch.add_side("prefill", servicer)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, context.server.server)
    # The current epoch's description (a switch back to prefill starts a new one).
    add_handshake_service(context.server.server, HandshakeServicer(lambda: servicer.exporter.describe(),
                                                                   config.kv_auth_token))
    return [servicer.run_release_loop]


# Engine stats reach the gauges every 50 ms, so pinned blocks show within a fraction of any scrape interval (every
# 5 ms, as the lease loop polls with tickets out, cost an idle worker ~3% of a CPU core: 5% against 2%).
PREFILL = Role("prefill", ("pdserve.v1.PrefillWorker", "pdserve.v1.KVHandshake"), _attach, stats_interval_s=0.05)


async def serve(config: PrefillConfig, engine: LLMEngine) -> str | None:
    """Run the prefill daemon until stopped (SIGTERM/SIGINT, after its drain); the failure that stopped it, if
    one did."""
    return await serve_worker(config, engine, PREFILL)
