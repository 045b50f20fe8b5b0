"""A worker daemon's settings, each one a command-line flag declared on its field (config_flags).

``WorkerConfig`` is what both daemons take (where to listen, who may talk to them, how long to
drain); ``PrefillConfig`` and ``DecodeConfig`` add their role's own. Torch-free: the command line is
built without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config_flags import flag, non_negative_int, positive_int
from services.common.tls import TLSConfig
from services.contract.sampling_params import DEFAULT_MAX_REQUEST_BYTES


@dataclass(frozen=True)
class WorkerConfig:
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(0, "gRPC port (0: pick a free one, printed on the ready line)", parse=int)
    advertise_host: str | None = flag(
        None, "host peers should dial (default: --host; for 0.0.0.0 or ::, the IP this machine's name resolves "
        "to, i.e. the container's or pod's own address)")
    engine_id: str | None = flag(None, "stable id of this engine (default: <role>@host:port)")
    metrics_port: int = flag(0, "Prometheus /metrics port (0: a free one)", parse=int)
    kv_auth_token: str | None = flag(
        None, "shared token: KV agent metadata is only exchanged with peers presenting it (default: "
        "$PDSERVE_KV_AUTH_TOKEN, which keeps it out of the process list)", env="PDSERVE_KV_AUTH_TOKEN", secret=True)
    drain_timeout_s: float = flag(
        30.0, "the drain before a stop (SIGTERM, `pdserve drain`): how long decode requests may finish before the "
        "rest move to another decode worker; a prefill worker waits at most this for its tickets to be pulled "
        "(keep it at least --kv-lease-s)", parse=float)
    kv_digest: bool = flag(
        True, "do not checksum transferred KV (the digest a prefill worker puts in each ticket and the decode "
        "worker checks before decoding); both workers of a pair must agree", name="--no-kv-digest", negated=True)
    kv_staging_mib: int | None = flag(
        None, "a staging area of this many MiB beside the KV (0: none): a ticket whose blocks lie in many short runs "
        "is gathered there and read as one span, and a pull scatters such a span from there (default: 512 on a GPU, "
        "where NIXL's cost per descriptor outweighs the copies; 0 on CPU)", parse=int)
    max_request_bytes: int = flag(
        DEFAULT_MAX_REQUEST_BYTES, "the routers' --max-request-bytes: the largest body whose sampling params (stop "
        "strings, a structured-output schema) a call to this worker may carry; with the context length it sets the "
        f"gRPC receive limit, beyond which a message is refused unread (default {DEFAULT_MAX_REQUEST_BYTES})",
        parse=positive_int)
    tls: TLSConfig | None = None  # mTLS for gRPC: services.common.tls adds its flags (the router shares them)


@dataclass(frozen=True)
class PrefillConfig(WorkerConfig):
    kv_lease_s: float = flag(30.0, "free pinned KV that no decode worker pulled within this time (keep it well "
                                   "above 1 s: a decode worker refuses a ticket in its lease's last second)",
                             parse=float)
    kv_final_part_tokens: int = flag(
        512, "KV sent per chunk: a prompt prefilled over several steps ends with a chunk of at most this many "
        "tokens, so the KV its decode worker still has to pull after the first token is small (one more "
        "prefill step; 0: the last chunk is whatever the token budget leaves)", parse=non_negative_int)


@dataclass(frozen=True)
class DecodeConfig(WorkerConfig):
    kv_transfer_timeout_s: float = flag(30.0, "give up on a KV pull after this", parse=float)


@dataclass(frozen=True)
class SwitchableConfig(PrefillConfig, DecodeConfig):
    """Either daemon's command line: both roles' settings, and whether the worker may switch between them.

    A worker started with ``--role-switching`` serves its command's role first and the other after a
    ``SwitchRole`` (services/worker/role_switch.py); the engine flags stay as started, so they must suit both
    roles (``pdserve up --role-planner`` starts every worker with the same ones). Without it, the other role's
    settings are unused.
    """

    role_switching: bool = flag(
        False, "serve either role: start in this command's role, switch in place when a router asks (SwitchRole); "
        "the engine flags must suit both roles")


CONFIG_OF_ROLE: dict[str, type[WorkerConfig]] = {"prefill": PrefillConfig, "decode": DecodeConfig}
