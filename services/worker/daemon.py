"""The life of a worker daemon, shared by prefill and decode: bind, serve, drain, shut down.

Both daemons start the same way (a grpc.aio server with health and the cluster token or mTLS, an
address peers can dial, an engine id and epoch, one KV rank per TP rank, prefix-cache keys salted
with the compatibility hash, the KV event publisher, the engine's thread, the /metrics server, the
ready line) and stop the same way (the ``Drain`` RPC or SIGTERM drains the role served now by its own
rules, as a role switch does; a dead TP rank fails the worker). Only what they serve differs:
:class:`Role` says that, and :func:`serve` does the rest.

A worker started with role switching attaches both roles over the one engine: each role's calls are
gated by the :class:`~services.worker.role_switch.RoleSwitch` in the context, which ``SwitchRole`` drives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from services.common.addresses import advertised_host, join_host_port
from services.common.fault_inject import log_fault_injection
from services.common.metrics import WorkerMetrics
from services.common.tls import TLSConfig
from services.contract.prefix_keys import cache_salt_for
from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.engine.llm_engine import LLMEngine
from services.kv.ranks.kv_rank import KVRank
from services.kv.spec.compat import CompatInfo, KVIdentity
from services.worker.config import WorkerConfig
from services.worker.grpc_server import WorkerServer
from services.worker.kv_events import KVEventPublisher
from services.worker.kv_ranks import close_kv_ranks, go_down_with_tp_group, kv_identity, open_kv_ranks, staging_mib
from services.worker.receive_limit import max_receive_bytes
from services.worker.role_switch import RoleSwitch

log = logging.getLogger(__name__)

#: A background task a role runs while the daemon serves; it returns soon after ``stop`` is set.
Background = Callable[[asyncio.Event], Awaitable[None]]


@dataclass(frozen=True)
class WorkerContext:
    """What a role's servicers are built from; ``aengine`` starts only after :attr:`Role.attach` returned."""

    config: WorkerConfig  # the role's own (PrefillConfig, DecodeConfig)
    engine: LLMEngine
    aengine: AsyncEngine
    server: WorkerServer
    metrics: WorkerMetrics
    tls: TLSConfig | None
    address: str  # host:port peers dial (the handshake address of tickets)
    engine_id: str
    epoch: int  # this start's; names the KV agents and tells peers a restarted worker from the old one
    ranks: list[KVRank]
    identity: KVIdentity  # the engine's KV identity, for the exporter or the puller
    kv_events: KVEventPublisher  # the KVEvents/KVSnapshot RPCs' publisher (services/worker/kv_events.py)
    faults: dict[str, int] = field(default_factory=dict)  # PDSERVE_FAULT_INJECT's (services.common.fault_inject)
    # The role served now and the current epoch (a role switch changes both; ``epoch`` above is the start's).
    switch: RoleSwitch | None = None


@dataclass(frozen=True)
class Role:
    """One daemon's part: its gRPC services and how it attaches them to the shared skeleton.

    ``attach`` registers the role's servicers on ``context.server.server`` and returns the background
    tasks it needs (the prefill worker's lease loop); ``stats_interval_s`` is how often the engine's
    stats reach the metrics gauges.
    """

    name: str  # "prefill" or "decode": the metrics role label and the default engine id's prefix
    service_names: tuple[str, ...]  # reported by grpc.health.v1 (the cluster token guards all but health)
    attach: Callable[[WorkerContext], Sequence[Background]]
    stats_interval_s: float


async def serve(config: WorkerConfig, engine: LLMEngine, role: Role, others: Sequence[Role] = ()) -> str | None:
    """Run the daemon until stopped (SIGTERM/SIGINT, after its drain); the failure that stopped it, if one did.

    ``role`` is served first; ``others`` are attached too, for a worker that can switch to them in place.
    """
    metrics = WorkerMetrics(role.name)
    tls = config.tls
    roles = [role, *others]
    receive_limit = max_receive_bytes(engine.max_model_len, len(engine.kv_layout.groups),
                                      engine.config.parallel.tp_size, config.max_request_bytes)
    server = WorkerServer(list(dict.fromkeys(name for r in roles for name in r.service_names)),
                          config.kv_auth_token, tls, max_receive_bytes=receive_limit)
    port = server.bind(config.host, config.port)
    address = join_host_port(config.advertise_host or advertised_host(config.host), port)
    epoch = time.time_ns()
    engine_id = config.engine_id or f"{role.name if not others else 'worker'}@{address}"
    ranks = open_kv_ranks(engine, engine_id, epoch, staging_mib(config, engine.device.type))
    identity = kv_identity(engine, config.kv_digest)
    # Prefix-cache keys salted with the compatibility hash Info reports: a router computes the same keys.
    engine.set_cache_salt(cache_salt_for(CompatInfo.of_identity(identity).hash))
    aengine = AsyncEngine(engine)
    publisher = KVEventPublisher(aengine, engine_id, epoch, metrics)
    server.before_stop.append(publisher.close)  # event streams end cleanly, not cut by the server's grace
    switch = RoleSwitch(role.name, epoch, tuple(r.name for r in roles), metrics)
    switch.on_epoch.append(publisher.restart)  # subscribers resubscribe and snapshot the new epoch
    server.role_drain = switch.drain_to_stop  # stopping drains the role served now, as a switch would
    context = WorkerContext(config, engine, aengine, server, metrics, tls, address, engine_id, epoch, ranks,
                            identity, publisher, log_fault_injection(), switch)
    background = [*(task for r in roles for task in r.attach(context)), publisher.run]
    aengine.start()
    metrics.set_info(engine.source.name, engine_id, engine.config.parallel.tp_size, engine.config.block_size,
                     len(engine.kv_layout.groups))
    metrics_port = metrics.serve(config.host, config.metrics_port)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run(stop)) for run in (*background, _stats_loop(aengine, metrics,
                                                                                 role.stats_interval_s))]
    for task in tasks:
        task.add_done_callback(lambda done: _fail_if_raised(done, server))
    go_down_with_tp_group(engine, server)
    try:
        await server.start({"role": role.name, "port": port, "metrics_port": metrics_port,
                            "engine_id": engine_id}, config.drain_timeout_s)
        await server.stopped.wait()
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await aengine.stop()
        close_kv_ranks(ranks)
    return server.failure


def _fail_if_raised(task: asyncio.Task, server: WorkerServer) -> None:
    """A background task that raised (the lease loop, the stats loop) takes the worker down: without
    it, leases would never expire and pinned blocks would leak while the worker looked healthy."""
    if task.cancelled() or task.exception() is None:
        return
    error = task.exception()
    log.error("a background task of the worker failed: %r", error, exc_info=error)
    asyncio.ensure_future(server.fail(f"background task failed: {type(error).__name__}: {error}"))


def _stats_loop(aengine: AsyncEngine, metrics: WorkerMetrics, interval_s: float) -> Background:
    """Copy the engine's stats (queue, running, KV blocks, prefix cache, host tier) into the gauges;
    raise once the engine thread died, which takes the worker down (``_fail_if_raised``)."""
    async def run(stop: asyncio.Event) -> None:
        while not stop.is_set():
            metrics.set_engine_stats(aengine.stats)
            if aengine.failure is not None:
                raise EngineDeadError(f"the engine thread stopped: {aengine.failure!r}")
            await asyncio.sleep(interval_s)

    return run
