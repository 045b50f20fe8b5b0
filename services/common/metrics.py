"""Prometheus metrics every worker daemon exports (prefix ``pdserve_``), and the /metrics server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# The outcomes each role counts in pdserve_requests_total.
# decode "pull_required": refused because its pull was required (the router's --enforce-disagg) and failed;
# decode "migrated": given back unfinished by a role switch's drain (the router finished it elsewhere)
REQUEST_OUTCOMES = {"prefill": ("ticket", "kv_part", "finished", "invalid"),
                    "decode": ("finished", "invalid", "pull_required", "migrated")}
# pdserve_role_switches_total's results (services/worker/role_switch.py): switched, failed (the drain could
# not end), cancelled (the caller gave up during the drain; the worker kept its role).
ROLE_SWITCH_RESULTS = ("ok", "failed", "cancelled")
SWITCH_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The decode worker's path from a ticket to a request whose KV is usable, in order (they add up):
# reserve local blocks (on the engine thread), then KVPuller.pull's stages (handshake: the peer cache,
# a Handshake RPC on first contact; check: the ticket; pieces: token runs; plan: descriptors; read: the
# NIXL READs until their completion reached the event loop), then resume (the engine takes the request).
PULL_STAGES = ("reserve", "handshake", "check", "pieces", "plan", "read", "digest", "resume")
# The decode worker's share of the gap between a pulled request's first token (sampled by the prefill worker)
# and its second (this worker's first decode step), once per request, in order (they add up): last_pull (the
# ticket completing the prompt's KV arrived -> its pull ended; a whole ticket's includes reserving blocks),
# resume (-> the engine took the request), first_step (-> the token of its first decode step reached its stream).
JOIN_STAGES = ("last_pull", "resume", "first_step")
# pdserve_kv_probes_total's results (decode): the probe transfer worked, or it did not.
PROBE_RESULTS = ("ok", "failed")
# pdserve_kv_refused_total's reasons for a ticket (decode; services/kv/reader/errors.py TicketError.reason): not signed
# by its owner, not fitting its blocks, no usable digest, a part out of order; of another prompt, past its lease,
# pulled before, or naming neither lease nor prompt (services/kv/reader/tickets.py).
TICKET_REFUSALS = ("signature", "mismatch", "digest", "part", "prompt_mismatch", "expired", "replayed", "unbound")
# pdserve_kv_events_total's kinds, indexed by the event kind's number (services/engine/kv_cache/events.py).
KV_EVENT_KINDS = ("stored", "removed", "cleared")
# Why a KV event stream was cut off by the worker (the subscriber resubscribes and takes a snapshot).
KV_EVENT_DROP_REASONS = ("slow_subscriber",)
STAGE_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    """One registry per daemon (tests run several daemons' code in one process)."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["role"]
        self.role = role
        self.requests = Counter("pdserve_requests", "Requests by outcome", ["role", "outcome"], registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival to first token", labels,
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             labels, buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("pdserve_request_duration_seconds", "Arrival to last token", labels,
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.queue_depth = Gauge("pdserve_queue_depth", "Requests waiting to be scheduled", labels, registry=r)
        self.running = Gauge("pdserve_running_requests", "Requests in the running batch", labels, registry=r)
        self.kv_blocks = Gauge("pdserve_kv_blocks", "KV blocks by state", ["role", "state"], registry=r)
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes pulled", labels, registry=r)
        self.transfer_source_bytes = Counter("pdserve_kv_transfer_source_bytes", "KV bytes pulled, by where the "
                                             "owner held them (device blocks or its host KV tier)",
                                             ["role", "source"], registry=r)
        self.transfer_seconds = Histogram("pdserve_kv_transfer_seconds", "KV pull duration", labels,
                                          buckets=LATENCY_BUCKETS_S, registry=r)
        self.pull_stage_seconds = Histogram("pdserve_kv_pull_stage_seconds",
                                            "A successful KV pull's time by stage (decode workers)",
                                            ["role", "stage"], buckets=STAGE_BUCKETS_S, registry=r)
        self.join_stage_seconds = Histogram("pdserve_kv_join_stage_seconds",
                                            "A pulled request's way from its last KV ticket to its first decode "
                                            "token, by stage (decode workers)", ["role", "stage"],
                                            buckets=STAGE_BUCKETS_S, registry=r)
        self.transfer_descriptors = Counter("pdserve_kv_transfer_descriptors", "NIXL descriptors read", labels,
                                            registry=r)
        self.handshake_failures = Counter("pdserve_kv_handshake_failures", "Handshakes that failed", labels,
                                          registry=r)
        self.transfer_failures = Counter("pdserve_kv_transfer_failures", "KV pulls that failed", labels, registry=r)
        self.local_recomputes = Counter("pdserve_local_recompute_fallbacks",
                                        "Requests prefilled locally because the pull failed", labels, registry=r)
        self.kv_refused = Counter("pdserve_kv_refused", "Transfer tickets (decode) and NIXL notifications (prefill) "
                                  "refused: not signed by their owner, not fitting it, of another prompt, past "
                                  "their lease, pulled before, naming no pending ticket, or repeated",
                                  ["role", "kind", "reason"], registry=r)
        self.kv_integrity_failures = Counter("pdserve_kv_integrity_failures", "Pulls whose KV did not match the "
                                             "ticket's digest, by KV group (the blocks were dropped and the prompt "
                                             "prefilled here)", ["role", "group"], registry=r)
        # The start-up probe (services/decode/probe.py): one real pull per prefill engine epoch the router asks
        # about; "failed" says the pair cannot transfer (the router does not use it).
        self.kv_probes = Counter("pdserve_kv_probes", "KV probe transfers from a prefill worker, by result (ok, "
                                 "failed)", ["role", "result"], registry=r)
        # KV staging (services/kv/plan/staging.py): prefill counts its tickets staged ("staged") and those worth staging
        # that found no room ("full", read from their blocks); decode its pulls that read a staged span ("read").
        self.kv_staged = Counter("pdserve_kv_staged", "KV tickets gathered into the staging area (prefill: staged, "
                                 "full) and pulls that read a staged span (decode: read)", ["role", "outcome"],
                                 registry=r)
        # KV sent per prefill chunk: a decode worker whose pull is slower than the prefill worker's chunks reads the
        # parts that queued behind it in one pull (services/decode/pull_policy.py); each part read that way counts.
        self.kv_parts_coalesced = Counter("pdserve_kv_parts_coalesced", "Part tickets read in one pull with the "
                                          "part after them (the reader was behind its parts)", labels, registry=r)
        self.lease_expiries = Counter("pdserve_kv_lease_expiries", "Pinned KV freed by lease expiry, never pulled",
                                      labels, registry=r)
        # Prefix cache and host KV tier (services/engine/offload/); the engine counts, these follow.
        self.prefix_lookups = Counter("pdserve_kv_prefix_lookups", "Prefix lookups of admitted requests by tier "
                                      "and result (the host tier is asked only past the device hit)",
                                      ["role", "tier", "result"], registry=r)
        self.prefix_cached_tokens = Counter("pdserve_kv_prefix_cached_tokens", "Prompt tokens served from a "
                                            "tier's prefix cache instead of computed", ["role", "tier"], registry=r)
        self.offload_bytes = Counter("pdserve_kv_offload_bytes", "Bytes copied between device blocks and the "
                                     "host KV tier", ["role", "direction"], registry=r)
        self.offload_spans = Gauge("pdserve_kv_offload_spans", "Host KV tier spans by state (total, used: being "
                                   "copied or pinned, cached: holding a prefix)", ["role", "state"], registry=r)
        self.offload_queue = Gauge("pdserve_kv_offload_queue_depth", "Host KV tier copies queued or running: "
                                   "spans to store, requests loading", ["role", "kind"], registry=r)
        self.offload_skipped = Counter("pdserve_kv_offload_stores_skipped", "Spans not stored: every host span "
                                       "was in use", labels, registry=r)
        # KV events (services/worker/kv_events.py): what the prefix caches store and remove, for routers.
        self.kv_events = Counter("pdserve_kv_events", "KV cache events published to subscribers, by kind (stored, "
                                 "removed, cleared)", ["role", "kind"], registry=r)
        self.kv_event_subscribers = Gauge("pdserve_kv_event_subscribers", "KV event streams open", labels,
                                          registry=r)
        self.kv_event_streams_dropped = Counter("pdserve_kv_event_streams_dropped", "KV event streams the worker "
                                                "ended, by reason (slow_subscriber: its queue was full)",
                                                ["role", "reason"], registry=r)
        self.kv_events_dropped = Counter("pdserve_kv_events_dropped", "KV events dropped at the engine (its "
                                         "outbound queue was full): subscribers see a gap and resync", labels,
                                         registry=r)
        self.role_switches = Counter("pdserve_role_switches", "Role switches of this worker, by result (ok, failed, "
                                     "cancelled)", ["from", "to", "result"], registry=r)
        self.role_switch_seconds = Histogram("pdserve_role_switch_seconds", "A role switch, SwitchRole to serving "
                                             "the new role (drain included)", ["from", "to"],
                                             buckets=SWITCH_BUCKETS_S, registry=r)
        self.role_drain_seconds = Histogram("pdserve_role_drain_seconds", "A role switch's drain of the old role "
                                            "(prefill: tickets pulled, released or expired; decode: requests "
                                            "finished or migrated)", labels, buckets=SWITCH_BUCKETS_S, registry=r)
        self._counted: dict[tuple, float] = {}  # engine totals already added to the counters above
        self.info = Gauge("pdserve_worker_info", "Always 1; labels say what this worker serves",
                          ["role", "model", "engine_id", "tp_size", "block_size"], registry=r)
        self._start_at_zero()

    def _start_at_zero(self) -> None:
        """Create this role's series now, so dashboards and rates see 0 rather than nothing before traffic."""
        for metric in (self.ttft, self.itl, self.e2e, self.queue_depth, self.running, self.transfer_bytes,
                       self.transfer_seconds, self.transfer_descriptors, self.kv_parts_coalesced,
                       self.handshake_failures, self.transfer_failures, self.local_recomputes, self.lease_expiries,
                       self.offload_skipped, self.kv_event_subscribers, self.kv_events_dropped):
            metric.labels(self.role)
        for kind in KV_EVENT_KINDS:
            self.kv_events.labels(self.role, kind)
        for reason in KV_EVENT_DROP_REASONS:
            self.kv_event_streams_dropped.labels(self.role, reason)
        for outcome in ("staged", "full") if self.role == "prefill" else ("read",):
            self.kv_staged.labels(self.role, outcome)
        for tier in ("device", "host"):
            self.prefix_cached_tokens.labels(self.role, tier)
            for result in ("hit", "miss"):
                self.prefix_lookups.labels(self.role, tier, result)
        for direction in ("store", "load"):
            self.offload_bytes.labels(self.role, direction)
        if self.role == "decode":
            for source in ("device", "host"):
                self.transfer_source_bytes.labels(self.role, source)
        for state in ("total", "used", "cached"):
            self.offload_spans.labels(self.role, state)
        for kind in ("store", "load"):
            self.offload_queue.labels(self.role, kind)
        for outcome in REQUEST_OUTCOMES[self.role]:
            self.requests.labels(self.role, outcome)
        other = "decode" if self.role == "prefill" else "prefill"
        for old, new in ((self.role, other), (other, self.role)):
            self.role_switch_seconds.labels(old, new)
            for result in ROLE_SWITCH_RESULTS:
                self.role_switches.labels(old, new, result)
        self.role_drain_seconds.labels(self.role)
        for state in ("free", "used", "pinned_for_transfer"):
            self.kv_blocks.labels(self.role, state)
        if self.role == "decode":
            for stage in PULL_STAGES:
                self.pull_stage_seconds.labels(self.role, stage)
            for stage in JOIN_STAGES:
                self.join_stage_seconds.labels(self.role, stage)
            for result in PROBE_RESULTS:
                self.kv_probes.labels(self.role, result)
        kind, reasons = ("ticket", TICKET_REFUSALS) if self.role == "decode" else \
            ("notification", ("unknown", "duplicate"))
        for reason in reasons:
            self.kv_refused.labels(self.role, kind, reason)

    def set_info(self, model: str, engine_id: str, tp_size: int, block_size: int, num_kv_groups: int = 1) -> None:
        self.info.labels(self.role, model, engine_id, str(tp_size), str(block_size)).set(1)
        if self.role == "decode":  # the side that checks pulled KV
            for group in range(num_kv_groups):
                self.kv_integrity_failures.labels(self.role, str(group))

    def set_engine_stats(self, stats) -> None:  # stats: services.engine.async_engine.EngineStats
        self.queue_depth.labels(self.role).set(stats.num_waiting)
        self.running.labels(self.role).set(stats.num_running)
        used = stats.kv_blocks_total - stats.kv_blocks_free
        self.kv_blocks.labels(self.role, "free").set(stats.kv_blocks_free)
        self.kv_blocks.labels(self.role, "used").set(used)
        self.kv_blocks.labels(self.role, "pinned_for_transfer").set(stats.kv_blocks_held)
        if stats.prefix is not None:
            p = stats.prefix
            for tier, hits, misses, tokens in (("device", p.device_hits, p.device_misses, p.device_hit_tokens),
                                               ("host", p.host_hits, p.host_misses, p.host_hit_tokens)):
                self._count(self.prefix_lookups.labels(self.role, tier, "hit"), hits)
                self._count(self.prefix_lookups.labels(self.role, tier, "miss"), misses)
                self._count(self.prefix_cached_tokens.labels(self.role, tier), tokens)
        t = stats.host_tier
        if t is not None:
            self._count(self.offload_bytes.labels(self.role, "store"), t.bytes_stored)
            self._count(self.offload_bytes.labels(self.role, "load"), t.bytes_loaded)
            self._count(self.offload_skipped.labels(self.role), t.stores_skipped)
            for state, value in (("total", t.num_spans), ("used", t.spans_used), ("cached", t.spans_cached)):
                self.offload_spans.labels(self.role, state).set(value)
            self.offload_queue.labels(self.role, "store").set(t.store_queue_depth)
            self.offload_queue.labels(self.role, "load").set(t.loads_in_flight)

    def _count(self, child, total: float) -> None:
        """Bring a counter up to the engine's running total (the engine counts; a Counter only adds)."""
        key = id(child)
        delta = total - self._counted.get(key, 0)
        if delta > 0:
            child.inc(delta)
            self._counted[key] = total

    def serve(self, host: str, port: int) -> int:
        return serve_metrics(self.registry, host, port)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Expose ``registry`` as /metrics over HTTP on a thread; returns the bound port (``port=0``: a free one)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
