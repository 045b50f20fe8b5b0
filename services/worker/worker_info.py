"""The Info RPC's answer, shared by both worker daemons: identity, compatibility, load, role."""

from __future__ import annotations

from services.engine.async_engine import AsyncEngine
from services.kv.spec.compat import CompatInfo
from services.proto_gen.pdserve.v1 import worker_pb2
from services.worker.role_switch import RoleSwitch


def worker_info(engine: AsyncEngine, engine_id: str, switch: RoleSwitch, compat: CompatInfo,
                draining: bool) -> worker_pb2.WorkerInfo:
    """The role and epoch are the switch's (a switchable worker's change); a switch's drain and a drain to stop
    report draining too, so routers stop sending the role new work."""
    e, s = engine.engine, engine.stats
    return worker_pb2.WorkerInfo(
        engine_id=engine_id, role=switch.role, model_name=e.source.name, compat_hash=compat.hash,
        compat_fields=dict(compat.fields), tp_size=e.config.parallel.tp_size, block_size=e.config.block_size,
        max_model_len=e.max_model_len, num_running=s.num_running, num_waiting=s.num_waiting,
        kv_usage=1.0 - s.kv_blocks_free / max(s.kv_blocks_total, 1),
        draining=draining or switch.stopping or switch.switching_to is not None, epoch=switch.epoch,
        kv_blocks_pinned=s.kv_blocks_held, kv_blocks_free=s.kv_blocks_free,
        switching_to=switch.switching_to or "", roles=list(switch.roles),
    )
