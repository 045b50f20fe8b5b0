"""The prefill daemon: prefill prompts, hold their KV for the decode worker, serve the handshake.

``Prefill`` runs the prompt (prefix cache on), samples the first token, keeps the request's
blocks pinned and answers with a transfer ticket. The blocks are freed when every reading rank's
NIXL notification has arrived, on ``Release``/``Abort``, or when the lease expires (counted).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time

import grpc

from services.common.addresses import advertised_host, join_host_port
from services.common.engine_ranks import close_kv_ranks, go_down_with_tp_group, open_kv_ranks
from services.common.grpc_server import WorkerServer
from services.common.metrics import WorkerMetrics
from services.common.tls import tls_from_args
from services.common.worker_info import worker_info
from services.contract.wire import sampling_from_proto, top_logprobs_to_proto
from services.engine.async_engine import AsyncEngine
from services.engine.llm_engine import LLMEngine
from services.engine.sched.request import RequestStatus
from services.kv.exporter import KVExporter
from services.kv.handshake import HandshakeServicer, add_handshake_service
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """Thin servicer: decode the message, call the engine, encode the answer."""

    def __init__(self, server: WorkerServer, engine: AsyncEngine, exporter: KVExporter, address: str,
                 metrics: WorkerMetrics) -> None:
        self.server = server
        self.engine = engine
        self.exporter = exporter
        self.address = address
        self.metrics = metrics

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        async with self.server.in_flight.admit(context, "prefill worker"):
            return await self._prefill(request, context, time.monotonic())

    async def _prefill(self, request: worker_pb2.PrefillRequest, context, started: float):
        rid = request.request_id
        try:
            params = sampling_from_proto(request.params)
            # Only the first token is sampled here; min_tokens still bans EOS from it.
            first_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1),
                                               stop=(), return_logits=False)
            held = await self.engine.add_request(rid, list(request.prompt_token_ids), first_params,
                                                 hold_kv_on_finish=True)
        except ValueError as e:
            self.metrics.requests.labels("prefill", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        final = None
        async for out in self.engine.outputs(rid):
            final = out
        first = final.token_ids[0]
        logprob = final.logprobs[0] if final.logprobs else 0.0
        self.metrics.ttft.labels("prefill").observe(time.monotonic() - started)
        stopped = held.status is RequestStatus.FINISHED_STOPPED  # EOS or a stop token
        response = worker_pb2.PrefillResponse(
            first_token_id=first, first_logprob=logprob, num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=final.num_cached_tokens,
        )
        if final.top_logprobs:
            response.first_top_logprobs.CopyFrom(top_logprobs_to_proto(final.top_logprobs[:1])[0])
        if final.prompt_logprobs is not None:
            response.prompt_logprobs.extend(top_logprobs_to_proto(final.prompt_logprobs))
        if stopped or params.max_tokens == 1:  # the first token is also the last: nothing to pull
            await self.engine.release_held_kv(rid)
            response.finished, response.finish_reason = True, "stop" if stopped else "length"
            self.metrics.requests.labels("prefill", "finished").inc()
            return response
        host_ids, num_host_tokens = held.host_prefix or ((), 0)  # read from the host KV tier, not the device
        response.ticket.CopyFrom(self.exporter.hand_out(
            rid, held.block_ids, num_tokens=len(request.prompt_token_ids), first_token_id=first,
            first_token_logprob=logprob, handshake_address=self.address,
            reader_tp_size=request.reader_tp_size or 1, host_block_ids=host_ids, num_host_tokens=num_host_tokens,
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
        return worker_info(self.engine, self.exporter.engine_id, "prefill", self.exporter.compat,
                           self.server.in_flight.draining, self.exporter.epoch)


async def release_loop(engine: AsyncEngine, exporter: KVExporter, metrics: WorkerMetrics, lease_s: float,
                       stop: asyncio.Event) -> None:
    """Free pinned blocks as readers finish (notifications) or leases run out."""
    last_expiry = time.monotonic()
    refused = {reason: 0 for reason in exporter.refused_notifications()}
    while not stop.is_set():
        for rid in exporter.poll_released():
            await engine.release_held_kv(rid)
        if time.monotonic() - last_expiry > min(1.0, lease_s / 4):
            last_expiry = time.monotonic()
            for rid in exporter.expire(lease_s):
                log.warning("request %s: KV lease of %.0fs expired before it was pulled", rid, lease_s)
                metrics.lease_expiries.labels("prefill").inc()
                await engine.release_held_kv(rid)
            for reason, total in exporter.refused_notifications().items():
                if total > refused[reason]:
                    log.info("refused %d NIXL notifications (%s): they name no ticket held here",
                                total - refused[reason], reason)
                    metrics.kv_refused.labels("prefill", "notification", reason).inc(total - refused[reason])
                    refused[reason] = total
        metrics.set_engine_stats(engine.stats)
        await asyncio.sleep(0.005)


async def serve(args: argparse.Namespace, engine: LLMEngine) -> str | None:
    """Run the prefill daemon until drained (SIGTERM/SIGINT); the failure that stopped it, if one did."""
    metrics = WorkerMetrics("prefill")
    server = WorkerServer(["pdserve.v1.PrefillWorker", "pdserve.v1.KVHandshake"], args.kv_auth_token,
                          tls_from_args(args))
    port = server.bind(args.host, args.port)
    address = join_host_port(args.advertise_host or advertised_host(args.host), port)
    epoch = time.time_ns()
    engine_id = args.engine_id or f"prefill@{address}"
    ranks = open_kv_ranks(engine, engine_id, epoch)
    mc = engine.model_config
    exporter = KVExporter(
        engine_id=engine_id, model_name=engine.source.name, architecture=mc.architecture,
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, ranks=ranks,
        kv_sharing=mc.kv_sharing, group_kv_heads=engine.group_kv_heads, epoch=epoch,
    )
    aengine = AsyncEngine(engine)
    aengine.start()
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(
        PrefillServicer(server, aengine, exporter, address, metrics), server.server)
    add_handshake_service(server.server, HandshakeServicer(exporter.describe, args.kv_auth_token))
    metrics.set_info(engine.source.name, engine_id, engine.config.parallel.tp_size, engine.config.block_size)
    metrics_port = metrics.serve(args.host, args.metrics_port)
    stop = asyncio.Event()
    releaser = asyncio.create_task(release_loop(aengine, exporter, metrics, args.kv_lease_s, stop))
    go_down_with_tp_group(engine, server)
    await server.start({"role": "prefill", "port": port, "metrics_port": metrics_port, "engine_id": engine_id},
                       args.drain_timeout_s)
    await server.stopped.wait()
    stop.set()
    await releaser
    await aengine.stop()
    close_kv_ranks(ranks)
    return server.failure
