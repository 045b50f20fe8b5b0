"""The router's settings, one frozen value built from the command line (or directly, in tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config_flags import flag
from services.common.tls import TLSConfig

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
KV_AWARE, LEAST_OUTSTANDING = "kv-aware", "least-outstanding"
ROUTING_POLICIES = (KV_AWARE, LEAST_OUTSTANDING)


def _threshold(text: str) -> int | None:
    """``--direct-decode-threshold``: a token count, or ``auto`` (the cost-based decision)."""
    return None if text.strip().lower() == "auto" else int(text)


def _addresses(text: str) -> tuple[str, ...]:
    """``a:1,b:2`` as a tuple; repeated flags are concatenated by ``action="extend"``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _address_flag(help: str, metavar: str) -> tuple[str, ...]:
    return flag((), help, parse=_addresses, action="extend", cli_default=[], to_field=tuple, metavar=metavar)


@dataclass(frozen=True)
class RouterConfig:
    """Everything ``create_app`` needs; runtime facts (workers, their limits) live elsewhere.

    Worker endpoints come from ``prefill``/``decode`` (``host:port``) and from ``prefill_dns``/
    ``decode_dns`` (``name:port`` resolving to several addresses, e.g. a Kubernetes headless
    Service). A router with no prefill source at all runs decode-only. The fields that are flags of
    ``pdserve router`` carry them (``services.common.config_flags``).
    """

    model: str | None = flag(None, "the workers' --model (HF directory, .gguf file or dummy:<preset>), for the "
                                   "tokenizer and the model name (default: bundled SmolLM2-135M-Instruct)")
    served_model_name: str | None = flag(None, "model id clients name in requests and /v1/models lists (default: "
                                               "from --model)")
    tool_call_parser: str = flag("auto", "how the model writes tool calls: hermes, llama3_json, mistral, deepseek_v3, "
                                         "harmony, qwen3_coder; auto: from the chat template's markers (hermes when "
                                         "it names none); none: tool calling off", metavar="FORMAT")
    reasoning_parser: str = flag("auto", "how the model writes its reasoning, returned as reasoning_content: think "
                                         "(also deepseek_r1, qwen3), harmony; auto: from the chat template; none: "
                                         "left in the content", metavar="FORMAT")
    prefill: tuple[str, ...] = _address_flag("prefill worker addresses", "HOST:PORT,...")
    decode: tuple[str, ...] = _address_flag("decode worker addresses", "HOST:PORT,...")
    prefill_dns: tuple[str, ...] = _address_flag(
        "DNS names whose addresses are prefill workers (e.g. a Kubernetes headless Service)", "NAME:PORT,...")
    decode_dns: tuple[str, ...] = _address_flag("DNS names whose addresses are decode workers", "NAME:PORT,...")
    dns_refresh_s: float = flag(10.0, "re-resolve DNS names this often", parse=float)
    health_interval_s: float = flag(2.0, "probe each worker's Info this often", parse=float)
    health_timeout_s: float = flag(1.0, "a probe slower than this fails", parse=float)
    # Prompts with fewer tokens than this skip the prefill worker (0: always disaggregate); None (``auto``): the
    # cost-based decision of KV-aware routing (scoring.py), never direct under least-outstanding routing.
    direct_decode_threshold: int | None = flag(
        None, "prompts shorter than this go straight to a decode worker, an explicit override of the cost-based "
              "decision (0: never; default auto: KV-aware routing serves a prompt directly when the decode "
              "worker's cache leaves at most --direct-decode-max-uncached tokens to compute, or when the prefill "
              "queue would cost more than computing it there)", parse=_threshold, metavar="TOKENS|auto")
    direct_decode_max_uncached: int = flag(32, "cost-based direct route: serve on the decode worker when its own "
                                               "cache holds the prompt but for at most this many tokens (default "
                                               "32)", parse=int, metavar="TOKENS")
    # KV-aware routing (prefix_index.py, kv_subscriber.py, scoring.py).
    routing: str = flag("kv-aware", "how workers are picked: kv-aware (by what their prefix caches hold, their "
                                    "queues and measured rates, from their KV events) or least-outstanding (the "
                                    "fewest outstanding requests and prompt tokens; default kv-aware)",
                        choices=ROUTING_POLICIES)
    kv_index_capacity: int = flag(1_000_000, "most block keys the prefix index holds over all workers, least "
                                             "recently used forgotten first (about 250 bytes each; default "
                                             "1000000)", parse=int, metavar="KEYS")
    kv_predicted_ttl_s: float = flag(10.0, "a prompt sent to a worker counts as cached there this long unless "
                                           "its KV events confirm it (default 10)", parse=float)
    kv_host_hit_cost: float = flag(0.25, "cost of a host-tier cache hit relative to computing the token, in TTFT "
                                         "estimates (default 0.25)", parse=float)
    kv_overload_queue_tokens: int = flag(2048, "overload valve floor: a prefill worker holding a prompt's prefix "
                                               "yields to colder workers when its queued prompt tokens exceed both "
                                               "this and --kv-overload-factor times the median worker's "
                                               "(default 2048)", parse=int, metavar="TOKENS")
    kv_overload_factor: float = flag(2.0, "overload valve: how many times the median prefill queue a prefix holder "
                                          "may have before colder workers compete (default 2)", parse=float)
    kv_valve_gain: float = flag(1.5, "overload valve: an overloaded prefix holder yields only when its estimated "
                                     "time to first token is this many times the best colder worker's, which "
                                     "computes the prefix again (default 1.5)", parse=float)
    kv_default_prefill_tokens_per_s: float = flag(4096.0, "prefill rate assumed for a worker that has not "
                                                          "reported one yet (default 4096)", parse=float)
    kv_events_stale_s: float = flag(10.0, "a worker's KV event stream without a batch (events or heartbeat) "
                                          "this long is resubscribed, its cache unknown meanwhile (default 10)",
                                    parse=float)
    kv_snapshot_timeout_s: float = 10.0  # a KVSnapshot slower than this fails the sync (taken on the engine thread)
    kv_resync_backoff_s: float = 0.5  # first wait before resubscribing; doubles up to kv_resync_backoff_max_s
    kv_resync_backoff_max_s: float = 10.0
    kv_unsupported_retry_s: float = 60.0  # a worker that predates KVEvents is asked again this often
    # Strict disaggregation: a request the prefill worker's KV cannot serve fails (503/502) instead of being
    # prefilled on a decode worker; short prompts are disaggregated too (direct_decode_threshold is ignored).
    enforce_disagg: bool = flag(False, "strict disaggregation: never prefill a prompt on a decode worker; a request "
                                       "with no prefill worker to pair gets 503, one whose prefill worker or KV pull "
                                       "failed gets 502, and --direct-decode-threshold is ignored (default: "
                                       "$PDSERVE_ENFORCE_DISAGG=1, else off)", env="PDSERVE_ENFORCE_DISAGG")
    # None: the smallest max_model_len the workers report.
    max_model_len: int | None = flag(None, "context length to check prompts against (default: the smallest the "
                                           "workers report)", parse=int)
    request_timeout_s: float = flag(600.0, "deadline for a whole request", parse=float)
    # None: no limit; beyond it new requests get 429.
    max_inflight_requests: int | None = flag(None, "beyond this many requests in flight, answer 429 (default: no "
                                                   "limit)", parse=int)
    retry_after_s: int = 1
    # Decode failover (failover.py): a request whose decode worker broke goes on at another decode worker.
    decode_failover_grace_s: float = flag(2.0, "a decode worker marked down (failed health check or stream) has "
                                               "every stream on it that was silent this long cut and continued on "
                                               "another decode worker (default 2)", parse=float)
    max_decode_failovers: int = flag(2, "how many times one request may move to another decode worker after its "
                                        "decode worker broke (0: never; default 2)", parse=int, metavar="N")
    # How long a failover waits for a decode worker to take the request (bounded by the request's deadline).
    decode_failover_wait_s: float = 10.0
    # How long the router waits for Abort/Release after a client goes away.
    cleanup_timeout_s: float = 5.0
    # Longer request bodies get 413.
    max_request_bytes: int = flag(DEFAULT_MAX_REQUEST_BYTES, f"longer request bodies get 413 (default "
                                                             f"{DEFAULT_MAX_REQUEST_BYTES})", parse=int,
                                  metavar="BYTES")
    # None: open; else /v1/*, /tokenize and /detokenize need ``Authorization: Bearer <api_key>``.
    api_key: str | None = flag(None, "require 'Authorization: Bearer <key>' on /v1/*, /tokenize and /detokenize "
                                     "(default: $PDSERVE_API_KEY, which keeps it out of the process list; unset: no "
                                     "key needed)", env="PDSERVE_API_KEY", secret=True)
    # The workers' cluster token (services/common/grpc_auth.py), sent with every call to them.
    kv_auth_token: str | None = flag(None, "the workers' cluster token, sent with every call to them (default: "
                                           "$PDSERVE_KV_AUTH_TOKEN; workers started with one refuse calls without "
                                           "it)", env="PDSERVE_KV_AUTH_TOKEN", secret=True)
    # Pair probes (pair_probes.py): a compatible pair takes requests only after its decode worker pulled a probe
    # ticket from its prefill worker; failed pairs are probed again after pair_probe_retry_s.
    pair_probe: bool = flag(True, "use every compatible (prefill, decode) pair without first probing it with one "
                                  "real KV transfer (default: probe each new pair, and again when either worker "
                                  "restarts; a pair whose probe fails is not used)", name="--no-pair-probe",
                            negated=True)
    # KV sent per prefill chunk (kv_parts.py): PrefillStream relayed into GenerateParts, so the decode worker pulls
    # each chunk's KV while the prefill worker computes the next; only the last chunk's pull is exposed.
    kv_parts: bool = flag(True, "pull a prompt's KV in one piece after the prefill instead of per prefill chunk "
                                "(default: per chunk: the decode worker pulls each finished chunk's blocks while "
                                "the prefill worker computes the next; a one-chunk prompt is one pull either way)",
                          name="--no-kv-parts", negated=True)
    pair_probe_timeout_s: float = 30.0
    pair_probe_retry_s: float = 15.0
    # The P:D planner (planner.py, planner_loop.py): always evaluated and exported; acted on with role_planner.
    role_planner: bool = flag(False, "act on the P:D planner: switch a worker's role in place when the traffic "
                                     "calls for another prefill:decode split (default: advisory, the planner only "
                                     "logs and exports its decisions, e.g. for a Kubernetes HPA)")
    planner_interval_s: float = flag(10.0, "evaluate the P:D planner this often (default 10)", parse=float)
    planner_window_s: float = flag(60.0, "the planner sizes the roles by the requests that ended in this last "
                                         "window (default 60)", parse=float)
    planner_slo_ttft_ms: float = flag(2000.0, "TTFT target the planner sizes prefill workers for (default 2000)",
                                      parse=float, metavar="MS")
    planner_slo_itl_ms: float = flag(50.0, "inter-token latency target the planner sizes decode workers for "
                                           "(default 50)", parse=float, metavar="MS")
    planner_hysteresis_evaluations: int = flag(3, "switch only after the planner called for the same change this "
                                                  "many evaluations in a row (default 3)", parse=int, metavar="N")
    planner_margin_workers: float = flag(0.25, "switch only when the ideal split is this many workers past the "
                                               "rounding boundary (default 0.25)", parse=float, metavar="WORKERS")
    planner_min_dwell_s: float = flag(300.0, "at least this long between two role switches (default 300)",
                                      parse=float)
    planner_decode_tokens_per_s: float = flag(1024.0, "output tokens/s one decode worker delivers within the ITL "
                                                      "target, assumed until the planner has measured it "
                                                      "(default 1024)", parse=float)
    # The operator API (admin.py). Without an API key it is closed unless this says otherwise.
    admin_without_api_key: bool = flag(False, "serve /admin/* although no --api-key is set (default: /admin/* "
                                              "answers 403 without an API key; only for a router nobody else can "
                                              "reach)")
    # mTLS to the workers (services/common/tls.py): the router's certificate and the cluster CA.
    tls: TLSConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("dns_refresh_s", "health_interval_s", "health_timeout_s", "request_timeout_s",
                     "cleanup_timeout_s", "pair_probe_timeout_s", "pair_probe_retry_s", "decode_failover_grace_s",
                     "decode_failover_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.direct_decode_threshold is not None and self.direct_decode_threshold < 0:
            raise ValueError(f"direct_decode_threshold must be >= 0 (or None: cost-based), got "
                             f"{self.direct_decode_threshold}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if not self.kv_overload_factor >= 1:
            raise ValueError(f"kv_overload_factor must be >= 1, got {self.kv_overload_factor}")
        if not self.kv_valve_gain >= 1:
            raise ValueError(f"kv_valve_gain must be >= 1, got {self.kv_valve_gain}")
        for name in ("direct_decode_max_uncached", "kv_overload_queue_tokens", "max_decode_failovers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_index_capacity < 1:
            raise ValueError(f"kv_index_capacity must be >= 1, got {self.kv_index_capacity}")
        if not 0 <= self.kv_host_hit_cost <= 1:
            raise ValueError(f"kv_host_hit_cost must be in [0, 1], got {self.kv_host_hit_cost}")
        for name in ("kv_predicted_ttl_s", "kv_default_prefill_tokens_per_s", "kv_events_stale_s",
                     "kv_snapshot_timeout_s", "kv_resync_backoff_s", "kv_resync_backoff_max_s",
                     "kv_unsupported_retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("planner_interval_s", "planner_window_s", "planner_slo_ttft_ms", "planner_slo_itl_ms",
                     "planner_decode_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.planner_hysteresis_evaluations < 1:
            raise ValueError(f"planner_hysteresis_evaluations must be >= 1, got {self.planner_hysteresis_evaluations}")
        if self.planner_margin_workers < 0 or self.planner_min_dwell_s < 0:
            raise ValueError("planner_margin_workers and planner_min_dwell_s must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_inflight_requests is not None and self.max_inflight_requests < 1:
            raise ValueError(f"max_inflight_requests must be >= 1, got {self.max_inflight_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for an open router)")
        if self.enforce_disagg and self.decode_only:
            raise ValueError("--enforce-disagg needs prefill workers (--prefill or --prefill-dns): without them "
                             "every prompt would be prefilled on a decode worker")

    @property
    def pairing_threshold(self) -> int | None:
        """The short-prompt bypass pairing applies: ``direct_decode_threshold`` (None: cost-based), off under
        ``enforce_disagg``."""
        return 0 if self.enforce_disagg else self.direct_decode_threshold

    @property
    def kv_aware(self) -> bool:
        return self.routing == KV_AWARE

    @property
    def decode_only(self) -> bool:
        """No prefill worker was configured: every request goes straight to a decode worker."""
        return not (self.prefill or self.prefill_dns)
