"""The router's settings, one frozen value built from the command line (or directly, in tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.tls import TLSConfig

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class RouterConfig:
    """Everything ``create_app`` needs; runtime facts (workers, their limits) live elsewhere.

    Worker endpoints come from ``prefill``/``decode`` (``host:port``) and from ``prefill_dns``/
    ``decode_dns`` (``name:port`` resolving to several addresses, e.g. a Kubernetes headless
    Service). A router with no prefill source at all runs decode-only.
    """

    model: str | None = None
    served_model_name: str | None = None
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    prefill_dns: tuple[str, ...] = ()
    decode_dns: tuple[str, ...] = ()
    dns_refresh_s: float = 10.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    # Prompts with fewer tokens than this skip the prefill worker (0: always disaggregate).
    direct_decode_threshold: int = 0
    # None: the smallest max_model_len the workers report.
    max_model_len: int | None = None
    request_timeout_s: float = 600.0
    # None: no limit; beyond it new requests get 429.
    max_inflight_requests: int | None = None
    retry_after_s: int = 1
    # How long the router waits for Abort/Release after a client goes away.
    cleanup_timeout_s: float = 5.0
    # Longer request bodies get 413.
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # None: open; else /v1/*, /tokenize and /detokenize need ``Authorization: Bearer <api_key>``.
    api_key: str | None = field(default=None, repr=False)
    # The workers' cluster token (services/common/grpc_auth.py), sent with every call to them.
    kv_auth_token: str | None = field(default=None, repr=False)
    # mTLS to the workers (services/common/tls.py): the router's certificate and the cluster CA.
    tls: TLSConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("dns_refresh_s", "health_interval_s", "health_timeout_s", "request_timeout_s",
                     "cleanup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.direct_decode_threshold < 0:
            raise ValueError(f"direct_decode_threshold must be >= 0, got {self.direct_decode_threshold}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_inflight_requests is not None and self.max_inflight_requests < 1:
            raise ValueError(f"max_inflight_requests must be >= 1, got {self.max_inflight_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for an open router)")

    @property
    def decode_only(self) -> bool:
        """No prefill worker was configured: every request goes straight to a decode worker."""
        return not (self.prefill or self.prefill_dns)
