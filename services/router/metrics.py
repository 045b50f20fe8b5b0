"""The router's Prometheus metrics, in a registry of its own per app (no process-global state).

Latencies are what a client sees: TTFT from the request's arrival to its first token leaving the
router, inter-token latency between tokens reaching the router, end-to-end to the last byte. The
router's own cost is ``router_added_latency``: arrival to the first worker RPC (parse, validate,
tokenize, pick a pair); ``router_overhead`` times each stage up to the first byte out (``overhead.py``).
Worker counts, and pair probe states and results, are read from the pairing table at scrape time; the
prefix index's size and each worker's event staleness from the index.
Per-worker series are labelled ``worker`` by an opaque id (``worker_labels.py``), never by address:
``/metrics`` is open to whoever reaches the router's port.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.router.failover import FAILOVER_REASONS
from services.router.overhead import STAGES
from services.router.pair_probes import PairState
from services.router.pairing import PairingPolicy, Role, ServingStatus
from services.router.planner import Decision, DecisionReason
from services.router.prefix_index import PrefixIndex
from services.router.routes import Route
from services.router.scoring import Reason, RouteReason
from services.router.worker_labels import WorkerLabels

# How a request was served (routes.py): both workers, the decode worker alone, or recomputed on decode.
ROUTES = tuple(route.value for route in Route)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_STAGE_BUCKETS_S = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.25, 1.0)
_ROUTER_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class _WorkerCollector(Collector):
    """Workers per role and state, and what the router can serve, read from the pairing table when scraped."""

    def __init__(self, policy: PairingPolicy, decode_only: bool, labels: WorkerLabels) -> None:
        self._policy = policy
        self._decode_only = decode_only
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        status = GaugeMetricFamily("pdserve_router_status",
                                   "1 for the router's current status: ok (disaggregated pairs), degraded "
                                   "(decode workers prefill locally) or unavailable", labels=["status"])
        current = self._policy.serving_status(self._decode_only)
        for value in ServingStatus:
            status.add_metric([value.value], float(value == current))
        yield status
        workers = GaugeMetricFamily("pdserve_router_workers", "Known workers by role and state",
                                    labels=["role", "state"])
        outstanding = GaugeMetricFamily("pdserve_router_worker_outstanding_requests",
                                        "Requests the router has outstanding on each worker",
                                        labels=["role", "worker"])
        for role in Role:
            states = {"healthy": 0, "unhealthy": 0, "draining": 0}
            for worker in self._policy.workers(role):
                if worker.available:
                    states["healthy"] += 1
                elif worker.healthy:
                    states["draining"] += 1
                else:
                    states["unhealthy"] += 1
                outstanding.add_metric([role.value, self._labels(worker.address)], worker.outstanding_requests)
            for state, count in states.items():
                workers.add_metric([role.value, state], count)
        yield workers
        yield outstanding
        yield from self._pair_probes()

    def _pair_probes(self) -> Iterator[Metric]:
        """Compatible pairs by probe state, and probe results so far (every series, 0 without probes)."""
        table = self._policy.probes
        pairs = GaugeMetricFamily("pdserve_router_pairs", "Compatible pairs of available workers by KV probe state: "
                                  "probed (used), pending, failed (not used)", labels=["state"])
        counts = table.counts() if table is not None else {}
        for state in PairState:
            pairs.add_metric([state.value], counts.get(state.value, 0))
        yield pairs
        probes = CounterMetricFamily("pdserve_router_pair_probes", "Pair probes answered, by result (ok, failed)",
                                     labels=["result"])
        for result in ("ok", "failed"):
            probes.add_metric([result], table.results[result] if table is not None else 0)
        yield probes


class _IndexCollector(Collector):
    """The prefix index's size and per-worker state and staleness, read when scraped."""

    def __init__(self, index: PrefixIndex, labels: WorkerLabels) -> None:
        self._index = index
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        index = self._index
        keys = GaugeMetricFamily("pdserve_router_kv_index_keys", "Block keys in the prefix index: confirmed (from "
                                 "KV events) and predicted (requests this router sent, not yet confirmed)",
                                 labels=["kind"])
        for kind, count in index.num_keys().items():
            keys.add_metric([kind], count)
        yield keys
        yield GaugeMetricFamily("pdserve_router_kv_index_capacity_keys", "Most keys the prefix index holds "
                                "(--kv-index-capacity)", value=index.capacity_keys)
        yield CounterMetricFamily("pdserve_router_kv_index_evicted_keys", "Keys the prefix index forgot for "
                                  "capacity (least recently used first)", value=index.num_evicted)
        states = GaugeMetricFamily("pdserve_router_kv_index_workers", "Workers by what the index knows of their "
                                   "caches: synced, unknown (resyncing) or unsupported (no KV events)",
                                   labels=["state"])
        for state, count in index.worker_states().items():
            states.add_metric([state], count)
        yield states
        stale = GaugeMetricFamily("pdserve_router_kv_events_staleness_seconds", "Seconds since each synced "
                                  "worker's last KV event batch (events or heartbeat)", labels=["worker"])
        now = time.monotonic()
        for address in index.addresses():
            last = index.last_batch_s(address)
            if last is not None:
                stale.add_metric([self._labels(address)], max(now - last, 0.0))
        yield stale


class RouterMetrics:
    """Every metric the router exports, registered in ``self.registry``."""

    def __init__(self, policy: PairingPolicy, model: str = "", decode_only: bool = False,
                 index: PrefixIndex | None = None, worker_labels: WorkerLabels | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        info = Gauge("pdserve_router_info", "Always 1; the model the router serves", ["model"], registry=r)
        info.labels(model).set(1)
        self.requests = Counter("pdserve_router_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("pdserve_router_requests_in_flight", "Generation requests being served",
                               registry=r)
        self.ttft = Histogram("pdserve_router_time_to_first_token_seconds",
                              "Request arrival to the first token sent to the client", ["route"],
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.inter_token = Histogram("pdserve_router_inter_token_latency_seconds",
                                     "Time between successive output tokens", buckets=_TOKEN_BUCKETS_S, registry=r)
        self.e2e = Histogram("pdserve_router_e2e_request_latency_seconds",
                             "Request arrival to the end of the response", ["route"],
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.added_latency = Histogram("pdserve_router_added_latency_seconds",
                                       "Router time before the first worker RPC (parse, tokenize, pair)",
                                       buckets=_ROUTER_BUCKETS_S, registry=r)
        self.router_overhead = Histogram("pdserve_router_overhead_seconds", "The router's own time per answered "
                                         "generation request, by stage: " + ", ".join(STAGES) + " (overhead.py)",
                                         ["stage"], buckets=_STAGE_BUCKETS_S, registry=r)
        for stage in STAGES:
            self.router_overhead.labels(stage)
        self.routes = Counter("pdserve_router_routed_requests",
                              "Requests by final route, counted when they end: disaggregated, direct (decided by "
                              "cost or threshold, or no prefill worker) or fallback (the prefill worker or the KV pull "
                              "failed, the prompt was recomputed on decode)", ["route"], registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens of served requests",
                                     registry=r)
        self.generation_tokens = Counter("pdserve_router_generation_tokens", "Tokens sent to clients",
                                         registry=r)
        self.migrated_requests = Counter("pdserve_router_migrated_requests", "Requests a decode worker gave back "
                                         "unfinished during its role switch, continued on another decode worker",
                                         registry=r)
        self.decode_failovers = Counter("pdserve_router_decode_failovers", "Requests whose decode worker broke "
                                        "mid-request, continued on another decode worker, by how it broke",
                                        ["reason"], registry=r)
        self.worker_failures = Counter("pdserve_router_worker_failures", "Worker RPCs that failed, by role",
                                       ["role"], registry=r)
        self.client_disconnects = Counter("pdserve_router_client_disconnects",
                                          "Requests whose client went away before the end", registry=r)
        self.routing_decisions = Counter("pdserve_router_routing_decisions", "Workers picked, by role and why "
                                         "(prefix_hit, least_loaded, overload_valve, cache_room, cache_unknown, "
                                         "no_events, affinity, least_outstanding)", ["role", "reason"], registry=r)
        self.route_decisions = Counter("pdserve_router_route_decisions", "Requests disaggregated or served "
                                       "directly on a decode worker, and why", ["route", "reason"], registry=r)
        self.kv_resyncs = Counter("pdserve_router_kv_resyncs", "KV event streams dropped and resynced, by reason "
                                  "(gap, epoch_changed, resource_exhausted, stream_error, stream_ended, stale)",
                                  ["reason"], registry=r)
        self.kv_event_batches = Counter("pdserve_router_kv_event_batches", "KV event batches applied (heartbeats "
                                        "included)", registry=r)
        self.kv_events = Counter("pdserve_router_kv_events", "KV cache events applied to the prefix index",
                                 registry=r)
        for role in Role:
            for reason in Reason:
                self.routing_decisions.labels(role.value, reason.value)
        for reason in ("gap", "epoch_changed", "resource_exhausted", "stream_error", "stream_ended", "stale"):
            self.kv_resyncs.labels(reason)
        for route in ROUTES:  # every series from the start: a route's rate is 0 before its first request
            for metric in (self.ttft, self.e2e, self.routes):
                metric.labels(route)
        for role in Role:
            self.worker_failures.labels(role.value)
        for reason in FAILOVER_REASONS:
            self.decode_failovers.labels(reason)
        for route, reasons in ((Route.DIRECT, (RouteReason.DECODE_CACHED, RouteReason.PREFILL_QUEUE,
                                               RouteReason.THRESHOLD, RouteReason.NO_PREFILL)),
                               (Route.DISAGGREGATED, (RouteReason.COST, RouteReason.THRESHOLD,
                                                      RouteReason.ENFORCED))):
            for reason in reasons:
                self.route_decisions.labels(route.value, reason.value)
        self._add_planner_metrics()
        labels = worker_labels or WorkerLabels()
        r.register(_WorkerCollector(policy, decode_only, labels))
        if index is not None:
            r.register(_IndexCollector(index, labels))

    def _add_planner_metrics(self) -> None:
        """The P:D planner's outputs (planner.py, planner_loop.py); every series exists from the start."""
        r = self.registry
        self.planner_decisions = Counter("pdserve_planner_decisions", "P:D planner evaluations by outcome: balanced, "
                                         "pending (hysteresis), dwell, switch, switch_in_progress, no_traffic, "
                                         "too_few_workers", ["reason"], registry=r)
        self.planner_desired = Gauge("pdserve_planner_desired_workers", "Workers each role needs at the SLO "
                                     "targets, rounded up, at least 1 (what a Kubernetes HPA scales on)", ["role"],
                                     registry=r)
        self.planner_target = Gauge("pdserve_planner_target_workers", "The split of the router's available "
                                    "workers the traffic calls for (what --role-planner moves toward)", ["role"],
                                    registry=r)
        self.planner_demand = Gauge("pdserve_planner_demand_workers", "Each role's demand in workers at the SLO "
                                    "targets, unrounded (arrival rate x mean length / one worker's capacity)",
                                    ["role"], registry=r)
        self.planner_switches = Counter("pdserve_planner_switches", "Role switches the planner started, by the new "
                                        "role and result (ok, failed, unavailable: no role switching in this "
                                        "router)", ["role", "result"], registry=r)
        for reason in DecisionReason:
            self.planner_decisions.labels(reason.value)
        for role in Role:
            for result in ("ok", "failed", "unavailable"):
                self.planner_switches.labels(role.value, result)

    def observe_planner(self, decision: Decision) -> None:
        """Export one planner evaluation."""
        self.planner_decisions.labels(decision.reason.value).inc()
        for role in Role:
            self.planner_desired.labels(role.value).set(decision.desired.of(role))
            self.planner_target.labels(role.value).set(decision.target.of(role))
        self.planner_demand.labels(Role.PREFILL.value).set(decision.estimate.prefill_need)
        self.planner_demand.labels(Role.DECODE.value).set(decision.estimate.decode_need)

    def render(self) -> bytes:
        return generate_latest(self.registry)
