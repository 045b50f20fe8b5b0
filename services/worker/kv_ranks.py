"""Both daemons' view of their engine's TP ranks: one KV rank per TP rank, and going down together."""

from __future__ import annotations

import asyncio
import logging

import torch

from services.engine.llm_engine import LLMEngine
from services.kv.nixl.agent import TransferAgent
from services.kv.ranks.kv_rank import KVRank, LocalKVRank
from services.kv.spec.compat import DIGEST_OFF, DIGEST_SCHEME, KVIdentity
from services.worker.config import WorkerConfig
from services.worker.follower_kv_rank import FollowerKVRanks
from services.worker.grpc_server import WorkerServer

log = logging.getLogger(__name__)


def open_kv_ranks(engine: LLMEngine, engine_id: str, epoch: int, staging_mib: int = 0) -> list[KVRank]:
    """Rank 0's NIXL agent and KV shard here, then every follower's (each opens its own agent).

    Agent names carry the epoch, so a restarted worker's agents never collide with its old ones
    in a peer's NIXL state. ``staging_mib``: the KV staging area (``ranks.staging_area``) of a TP-1 engine; the
    ranks of a larger one have none (a gather or scatter runs where the KV is, and followers do not stage), so it
    stages nothing and reads owners' blocks, or straight from their staged spans.
    """
    def name(rank: int) -> str:
        return f"{engine_id}-{epoch}-tp{rank}"

    tier = engine.host_tier
    ranks: list[KVRank] = [LocalKVRank(TransferAgent(name(0), device=engine.device.type), engine.kv_layout,
                                       engine.kv_cache.buffers, tier.layout if tier else None,
                                       tier.buffers if tier else (), state_buffer=_state_buffer(engine),
                                       staging_bytes=0 if engine.tp_group is not None else staging_mib << 20)]
    if engine.tp_group is not None:
        ranks += FollowerKVRanks(engine.tp_group).open(name, engine.kv_layout)
    return ranks


def staging_mib(config: WorkerConfig, device_type: str) -> int:
    """The KV staging area's size: the flag's, or by default 512 MiB on a GPU and none on CPU."""
    if config.kv_staging_mib is not None:
        if config.kv_staging_mib < 0:
            raise ValueError(f"--kv-staging-mib must be >= 0, got {config.kv_staging_mib}")
        return config.kv_staging_mib
    return 512 if device_type == "cuda" else 0


def kv_identity(engine: LLMEngine, kv_digest: bool = True) -> KVIdentity:
    """What makes this engine's KV bytes mean what they mean: built once per daemon, handed to the
    exporter (prefill) or the puller (decode), which present and check it as the compatibility hash.
    ``kv_digest``: whether transfers carry and check the KV digest (both sides must agree). An FP8 KV cache's
    per-layer scales (``RankRuntime.kv_scales``) are part of it: its bytes mean nothing without them."""
    mc = engine.model_config
    return KVIdentity.of(architecture=mc.architecture, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                         head_dim=mc.head_dim, layout=engine.kv_layout, kv_sharing=mc.kv_sharing,
                         group_kv_heads=engine.group_kv_heads, kv_digest=DIGEST_SCHEME if kv_digest else DIGEST_OFF,
                         state=pool.spec if (pool := engine.runtime.state_pool) is not None else None,
                         kv_scales=dict(enumerate(engine.runtime.kv_scales.layers)))


def _state_buffer(engine: LLMEngine) -> torch.Tensor | None:
    """The engine's state slots (a model with state layers), registered beside its KV; None for other models."""
    pool = engine.runtime.state_pool
    return pool.buffer if pool is not None else None


def close_kv_ranks(ranks: list[KVRank]) -> None:
    """Close rank 0's agent (the followers close theirs when the TP group stops)."""
    local = ranks[0]
    if isinstance(local, LocalKVRank):
        local.agent.close()


def go_down_with_tp_group(engine: LLMEngine, server: WorkerServer) -> None:
    """A dead or failed TP rank takes the whole worker down: a TP engine missing a rank can only
    hang in its next all-reduce or compute garbage, so the worker stops serving and exits."""
    if engine.tp_group is None:
        return
    loop = asyncio.get_running_loop()

    def failed(reason: str) -> None:
        log.error("taking the worker down: %s", reason)
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(server.fail(reason)))

    engine.tp_group.on_failure(failed)
