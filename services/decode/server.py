"""The decode daemon: pull a prompt's KV from a prefill worker and stream the rest of the tokens.

``Generate(ticket)`` handshakes with the ticket's prefill engine on first contact (cached by
engine id + epoch), reserves local blocks (reusing what its own prefix cache holds), pulls the
rest over NIXL, then decodes with continuous batching alongside other requests. If the pull
fails or the peer is gone, it prefills the prompt itself: the request still completes. Without
a ticket it prefills locally (conditional disaggregation).

The stream's first chunk is the ticket's first token, so a client of this service sees the whole
output; the router, which already sent that token, skips it.
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
from services.common.metrics import PULL_STAGES, WorkerMetrics
from services.common.tls import tls_from_args
from services.common.worker_info import worker_info
from services.contract.sampling_params import SamplingParams
from services.contract.wire import sampling_from_proto, top_logprobs_to_proto
from services.engine.async_engine import AsyncEngine
from services.engine.llm_engine import LLMEngine, RequestOutput
from services.kv.agent import TransferError
from services.kv.compat import CompatInfo, compat_fields
from services.kv.handshake import HandshakeError
from services.kv.puller import KVPuller, PullResult, TicketError
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

PULL_ERRORS = (TransferError, HandshakeError, ValueError, OSError)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, server: WorkerServer, engine: AsyncEngine, puller: KVPuller, compat: CompatInfo,
                 engine_id: str, epoch: int, metrics: WorkerMetrics, reserve_timeout_s: float = 10.0) -> None:
        self.server = server
        self.reserve_timeout_s = reserve_timeout_s
        self.engine = engine
        self.puller = puller
        self.compat = compat
        self.engine_id = engine_id
        self.epoch = epoch
        self.metrics = metrics

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        async with self.server.in_flight.admit(context, "decode worker"):
            started = time.monotonic()
            try:
                params = sampling_from_proto(request.params)
                prompt = list(request.prompt_token_ids)
                if request.HasField("ticket"):
                    prefix, recomputed = await self._start_from_ticket(request.request_id, prompt, params,
                                                                       request.ticket)
                else:
                    await self.engine.add_request(request.request_id, prompt, params)
                    prefix, recomputed = [], False
            except ValueError as e:
                self.metrics.requests.labels("decode", "invalid").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if prefix:  # the ticket's first token, when the engine restarted the request without it
                yield worker_pb2.TokenChunk(token_ids=prefix, num_prompt_tokens=len(prompt), recomputed_locally=True)
            last = None  # TTFT here is arrival (pull included) to the first token this worker produced
            async for out in self.engine.outputs(request.request_id):
                now = time.monotonic()
                if last is None:
                    self.metrics.ttft.labels("decode").observe(now - started)
                else:
                    self.metrics.itl.labels("decode").observe(now - last)
                chunk = _chunk(out, len(prompt), recomputed)
                if last is None and out.prompt_logprobs is not None:
                    chunk.prompt_logprobs.extend(top_logprobs_to_proto(out.prompt_logprobs))
                last = now
                yield chunk
            self.metrics.e2e.labels("decode").observe(time.monotonic() - started)
            self.metrics.requests.labels("decode", "finished").inc()

    async def _start_from_ticket(self, rid: str, prompt: list[int], params: SamplingParams,
                                 ticket: kv_pb2.TransferTicket) -> tuple[list[int], bool]:
        """Reserve, pull, and start decoding; on any pull failure prefill here instead.

        Returns (tokens to emit before the engine's own outputs, whether it was recomputed).
        """
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
            return [], False
        # Recompute: the prompt plus the first token the client already has, one token fewer to go.
        self.metrics.local_recomputes.labels("decode").inc()
        rest = dataclasses.replace(params, max_tokens=params.max_tokens - 1, min_tokens=max(params.min_tokens - 1, 0))
        await self.engine.add_request(rid, [*prompt, ticket.first_token_id], rest,
                                      grammar_prefix=[ticket.first_token_id])
        return [ticket.first_token_id], True

    async def _reserve_and_pull(self, rid: str, prompt: list[int], params: SamplingParams,
                                ticket: kv_pb2.TransferTicket, started: float) -> bool:
        """Reserve local blocks and pull the ticket's KV into them; False when the prompt must be
        prefilled here instead (no room in time, or the pull failed: the reservation is dropped)."""
        request = await self._reserve(rid, prompt, params)
        reserved = time.perf_counter()
        if request is None:
            log.warning("request %s: no KV blocks or sequence seat free for %.0f s; prefilling locally",
                        rid, self.reserve_timeout_s)
        else:
            try:
                result = await self.puller.pull(ticket, request.block_ids, request.num_cached_tokens)
            except PULL_ERRORS as e:
                log.warning("request %s: KV pull from %s failed (%s); prefilling locally", rid, ticket.engine_id, e)
                failure = self.metrics.handshake_failures if isinstance(e, HandshakeError) else \
                    self.metrics.transfer_failures
                failure.labels("decode").inc()
                if isinstance(e, TicketError):
                    self.metrics.kv_refused.labels("decode", "ticket", e.reason).inc()
                await self.engine.abort(rid)
            else:
                pulled = time.perf_counter()
                try:
                    await self.engine.complete_external_kv(rid, ticket.first_token_id, ticket.first_token_logprob)
                except ValueError as e:  # the ticket's first token does not fit (e.g. not in the grammar)
                    log.warning("request %s: the ticket's first token is refused (%s); prefilling locally", rid, e)
                    await self.engine.abort(rid)
                    return False
                resumed = time.perf_counter()
                self.metrics.transfer_bytes.labels("decode").inc(result.num_bytes)
                self.metrics.transfer_source_bytes.labels("decode", "host").inc(result.host_bytes)
                self.metrics.transfer_source_bytes.labels("decode", "device").inc(result.num_bytes - result.host_bytes)
                self.metrics.transfer_descriptors.labels("decode").inc(result.num_descriptors)
                self.metrics.transfer_seconds.labels("decode").observe(result.seconds)
                self._observe_stages(rid, result, reserved - started, resumed - pulled)
                return True
        return False

    def _observe_stages(self, rid: str, result: PullResult, reserve_s: float, resume_s: float) -> None:
        """pdserve_kv_pull_stage_seconds, and one debug line with every stage (the READ's own included)."""
        stages = {"reserve": reserve_s, **result.stages, "resume": resume_s}
        histogram = self.metrics.pull_stage_seconds
        for stage in PULL_STAGES:
            histogram.labels("decode", stage).observe(stages.get(stage, 0.0))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: pulled %d bytes in %d descriptors; stages (ms): %s", rid, result.num_bytes,
                      result.num_descriptors, " ".join(f"{k}={v * 1e3:.3f}" for k, v in stages.items()))

    async def _reserve(self, rid: str, prompt: list[int], params: SamplingParams):
        """Reserve local blocks for the pull, waiting (bounded) for a seat or blocks to free up.

        Recomputing a prompt whose KV is ready on the prefill worker only because this worker is
        momentarily full would throw the disaggregation away; the prefill worker holds the blocks
        under its lease meanwhile.
        """
        deadline = time.monotonic() + self.reserve_timeout_s
        delay_s = 0.005
        while True:
            request = await self.engine.add_request_with_external_kv(rid, prompt, params)
            if request is not None or time.monotonic() >= deadline:
                return request
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, 0.05)

    async def Abort(self, request: worker_pb2.AbortRequest, context):  # noqa: N802
        return worker_pb2.AbortResponse(aborted=await self.engine.abort(request.request_id))

    async def Info(self, request: worker_pb2.InfoRequest, context):  # noqa: N802
        return worker_info(self.engine, self.engine_id, "decode", self.compat, self.server.in_flight.draining,
                           self.epoch)


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


async def serve(args: argparse.Namespace, engine: LLMEngine) -> str | None:
    """Run the decode daemon until drained (SIGTERM/SIGINT); the failure that stopped it, if one did."""
    metrics = WorkerMetrics("decode")
    tls = tls_from_args(args)
    server = WorkerServer(["pdserve.v1.DecodeWorker"], args.kv_auth_token, tls)
    port = server.bind(args.host, args.port)
    address = join_host_port(args.advertise_host or advertised_host(args.host), port)
    epoch = time.time_ns()
    engine_id = args.engine_id or f"decode@{address}"
    mc, layout = engine.model_config, engine.kv_layout
    compat = CompatInfo.of(compat_fields(architecture=mc.architecture, num_layers=mc.num_layers,
                                         num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, layout=layout,
                                         kv_sharing=mc.kv_sharing, group_kv_heads=engine.group_kv_heads))
    ranks = open_kv_ranks(engine, engine_id, epoch)
    puller = KVPuller(engine_id=engine_id, compat=compat, ranks=ranks,
                      auth_token=args.kv_auth_token, transfer_timeout_s=args.kv_transfer_timeout_s,
                      tls=tls)
    aengine = AsyncEngine(engine)
    aengine.start()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
        DecodeServicer(server, aengine, puller, compat, engine_id, epoch, metrics,
                       reserve_timeout_s=args.kv_transfer_timeout_s), server.server)
    metrics.set_info(engine.source.name, engine_id, engine.config.parallel.tp_size, engine.config.block_size)
    metrics_port = metrics.serve(args.host, args.metrics_port)
    stop = asyncio.Event()

    async def stats_loop() -> None:
        while not stop.is_set():
            metrics.set_engine_stats(aengine.stats)
            await asyncio.sleep(0.5)

    stats = asyncio.create_task(stats_loop())
    go_down_with_tp_group(engine, server)
    await server.start({"role": "decode", "port": port, "metrics_port": metrics_port, "engine_id": engine_id},
                       args.drain_timeout_s)
    await server.stopped.wait()
    stop.set()
    await stats
    await aengine.stop()
    close_kv_ranks(ranks)
    return server.failure
