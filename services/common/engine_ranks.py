"""Both daemons' view of their engine's TP ranks: one KV rank per TP rank, and going down together."""

from __future__ import annotations

import asyncio
import logging

from services.common.grpc_server import WorkerServer
from services.engine.llm_engine import LLMEngine
from services.kv.agent import TransferAgent
from services.kv.rank import KVRank, LocalKVRank

log = logging.getLogger(__name__)


def open_kv_ranks(engine: LLMEngine, engine_id: str, epoch: int) -> list[KVRank]:
    """Rank 0's NIXL agent and KV shard here, then every follower's (each opens its own agent).

    Agent names carry the epoch, so a restarted worker's agents never collide with its old ones
    in a peer's NIXL state.
    """
    def name(rank: int) -> str:
        return f"{engine_id}-{epoch}-tp{rank}"

    tier = engine.host_tier
    ranks: list[KVRank] = [LocalKVRank(TransferAgent(name(0), device=engine.device.type), engine.kv_layout,
                                       engine.kv_cache.buffers, tier.layout if tier else None,
                                       tier.buffers if tier else ())]
    if engine.tp_group is not None:
        ranks += engine.tp_group.open_kv_ranks(name, engine.kv_layout)
    return ranks


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
