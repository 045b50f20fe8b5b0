"""What one router app holds: the worker pool with its channels, the pairing table, discovery, the dispatcher,
the planner loop and the metrics registry, made per app (``build_runtime``) and kept on ``app.state.runtime``.

Channels and the background tasks (discovery's refresh, the planner) live from the lifespan's start to its end
(``RouterRuntime.lifespan``); before the first request the workers are known and, bounded, their pairs probed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI

from services.router.chat_output import ChatFormats, resolve_formats
from services.router.config import RouterConfig
from services.router.discovery import Discovery, EndpointSource, PairProber, Probe, Resolver
from services.router.flow import Dispatcher
from services.router.kv_subscriber import KVSource, KVSubscriptions
from services.router.metrics import RouterMetrics
from services.router.pair_probes import PairProbeTable
from services.router.pairing import PairingPolicy, Role, ServingStatus, WorkerIdentity
from services.router.planner import Planner, PlannerConfig
from services.router.planner_loop import PlannerLoop, RoleSwitcher
from services.router.prefix_index import PrefixIndex
from services.router.role_switch import RoleSwitching
from services.router.scoring import ScoringConfig
from services.router.tokenizing import model_name
from services.router.traffic import TrafficWindow
from services.router.worker_labels import WorkerLabels
from services.router.workers import WorkerPool
from services.text.tokenizer import Tokenizer

# At start-up, how long the first pair probes may hold the router back (a pair probed by then takes the very
# first request); slower ones finish in the background while /health says they are pending.
STARTUP_PROBE_WAIT_S = 5.0


@dataclass
class RouterRuntime:
    """What the routes share, on ``app.state.runtime``."""

    config: RouterConfig
    model_name: str
    tokenizer: Tokenizer | None
    vocab_size: int | None
    policy: PairingPolicy
    pool: WorkerPool
    discovery: Discovery
    dispatcher: Dispatcher
    metrics: RouterMetrics
    created: int
    index: PrefixIndex | None
    planner: PlannerLoop
    # A worker's id on /metrics, /health and /admin/workers: the instance ``metrics`` labels with (build_runtime
    # makes one for both), never a default of its own that could key the ids differently.
    worker_labels: WorkerLabels
    switching: RoleSwitching | None = None  # in-place role switches (role_switch.py)
    chat_formats: ChatFormats = field(default_factory=ChatFormats)  # how answers are read (chat_output.py)

    def max_model_len(self) -> int | None:
        return self.config.max_model_len or self.policy.max_model_len()

    def status(self) -> ServingStatus:
        return self.policy.serving_status(self.config.decode_only)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """The app's lifespan: know the workers (and, bounded, their pairs' probes) before the first request, run
        discovery and the planner meanwhile, close every channel at the end."""
        await self.discovery.refresh()
        await self.discovery.wait_for_probes(min(STARTUP_PROBE_WAIT_S, self.config.pair_probe_timeout_s))
        refresher = asyncio.create_task(self.discovery.run(), name="pdserve-router-discovery")
        planning = asyncio.create_task(self.planner.run(), name="pdserve-router-planner")
        try:
            yield
        finally:
            for task in (planning, refresher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.discovery.close()
            await self.pool.close_all()


def build_runtime(config: RouterConfig, tokenizer: Tokenizer | None, *, probe: Probe | None, resolver: Resolver,
                  pair_prober: PairProber | None, kv_source: KVSource | None,
                  role_switcher: RoleSwitcher | None) -> RouterRuntime:
    """The app's runtime; the seams are ``create_app``'s (``app.py``)."""
    probes = PairProbeTable(config.pair_probe_retry_s) if config.pair_probe and not config.decode_only else None
    index = PrefixIndex(config.kv_index_capacity, config.kv_predicted_ttl_s) if config.kv_aware else None
    policy = PairingPolicy(config.pairing_threshold, config.enforce_disagg, probes, index, scoring_config(config))
    pool = WorkerPool(config.kv_auth_token, config.tls)
    served_name = model_name(config.model, config.served_model_name)
    worker_labels = WorkerLabels(config.api_key)
    metrics = RouterMetrics(policy, served_name, decode_only=config.decode_only, index=index,
                            worker_labels=worker_labels)
    discovery = _discovery(config, policy, pool, metrics, index, probe=probe, resolver=resolver,
                           pair_prober=pair_prober, kv_source=kv_source)
    traffic = TrafficWindow(config.planner_window_s)
    switching = RoleSwitching(policy, pool, discovery)  # role_switch.py: the planner's hook, POST /admin/.../role
    planner = PlannerLoop(Planner(planner_config(config)), policy, traffic, metrics, index=index,
                          interval_s=config.planner_interval_s, acting=config.role_planner,
                          switcher=role_switcher or switching.switch_role, busy=lambda: switching.busy)
    is_dummy = bool(config.model and config.model.startswith("dummy:"))
    return RouterRuntime(
        config=config,
        model_name=served_name,
        tokenizer=tokenizer,
        # A dummy model borrows a tokenizer whose vocabulary is not the model's.
        vocab_size=tokenizer.vocab_size if tokenizer is not None and not is_dummy else None,
        policy=policy,
        pool=pool,
        discovery=discovery,
        dispatcher=Dispatcher(config, policy, pool, tokenizer, metrics, traffic),
        metrics=metrics,
        created=int(time.time()),
        index=index,
        planner=planner,
        switching=switching,
        worker_labels=worker_labels,
        chat_formats=resolve_formats(tokenizer, config.tool_call_parser, config.reasoning_parser),
    )


def _discovery(config: RouterConfig, policy: PairingPolicy, pool: WorkerPool, metrics: RouterMetrics,
               index: PrefixIndex | None, *, probe: Probe | None, resolver: Resolver, pair_prober: PairProber | None,
               kv_source: KVSource | None) -> Discovery:
    """Discovery over the flags' endpoints, with the KV event subscriptions when routing is KV-aware; the health
    check, pair prober and KV source default to the pool's RPCs."""
    subscriptions = None
    if index is not None:
        subscriptions = KVSubscriptions(index, kv_source or pool, stale_s=config.kv_events_stale_s,
                                        snapshot_timeout_s=config.kv_snapshot_timeout_s,
                                        backoff_s=config.kv_resync_backoff_s,
                                        backoff_max_s=config.kv_resync_backoff_max_s,
                                        unsupported_retry_s=config.kv_unsupported_retry_s, metrics=metrics)

    async def info_probe(role: Role, address: str) -> WorkerIdentity:
        return await pool.info(role, address, config.health_timeout_s)

    sources = [EndpointSource(Role.PREFILL, config.prefill, config.prefill_dns),
               EndpointSource(Role.DECODE, config.decode, config.decode_dns)]
    return Discovery(policy, sources, probe or info_probe, dns_refresh_s=config.dns_refresh_s,
                     health_interval_s=config.health_interval_s, health_timeout_s=config.health_timeout_s,
                     resolver=resolver, on_removed=pool.close, pair_prober=pair_prober or pool.probe,
                     pair_probe_timeout_s=config.pair_probe_timeout_s, kv_subscriptions=subscriptions)


def scoring_config(config: RouterConfig) -> ScoringConfig:
    """The KV-aware scoring settings of the router's flags."""
    return ScoringConfig(host_hit_cost=config.kv_host_hit_cost, overload_queue_tokens=config.kv_overload_queue_tokens,
                         overload_factor=config.kv_overload_factor, valve_gain=config.kv_valve_gain,
                         default_prefill_tokens_per_s=config.kv_default_prefill_tokens_per_s,
                         direct_max_uncached_tokens=config.direct_decode_max_uncached)


def planner_config(config: RouterConfig) -> PlannerConfig:
    """The P:D planner's settings of the router's flags."""
    return PlannerConfig(slo_ttft_s=config.planner_slo_ttft_ms / 1e3, slo_itl_s=config.planner_slo_itl_ms / 1e3,
                         hysteresis_evaluations=config.planner_hysteresis_evaluations,
                         margin_workers=config.planner_margin_workers, min_dwell_s=config.planner_min_dwell_s,
                         default_prefill_tokens_per_s=config.kv_default_prefill_tokens_per_s,
                         default_decode_tokens_per_s=config.planner_decode_tokens_per_s)
