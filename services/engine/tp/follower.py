"""A follower TP rank (1..tp-1): load its shard, then run what rank 0 sends until told to stop.

It never schedules: rank 0 sends each step's chunks (``messages.Step``) before running the step
itself, and the model's all-reduces keep the ranks in lockstep. Pulls into this rank's KV shard
(``messages.Read``) run on a transfer thread, beside the steps, like rank 0's pulls run beside
its engine thread; NIXL notifications for this rank's agent are pushed to rank 0 as they come.

If rank 0 goes away (its end of the pipe closes) the follower exits; if the follower fails, it
says why (``messages.Fatal``) and exits non-zero, and rank 0 takes the worker down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import traceback
from multiprocessing.connection import Connection

import numpy as np
import torch

from services.engine.engine_config import EngineConfig
from services.engine.kv_cache.buffers import KVCache
from services.engine.loading.source import resolve_model
from services.engine.runner.model_runner import ModelRunner
from services.engine.runner.rank_setup import kv_layout, load_model, num_blocks_for
from services.engine.tp import messages as m
from services.engine.tp.distributed import join_group, leave_group
from services.kv.agent import TransferAgent, TransferTimeout
from services.kv.rank import LocalKVRank

log = logging.getLogger(__name__)

NOTIFICATION_POLL_S = 0.002


def follower_main(config: EngineConfig, devices: list[str], init_method: str, conn: Connection,
                  log_level: str = "WARNING") -> None:
    """Process entry point (multiprocessing spawn)."""
    rank = config.parallel.tp_rank
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    follower = Follower(config, devices, init_method, conn)
    try:
        follower.run()
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this process ends
        log.error("TP rank %d failed: %s", rank, traceback.format_exc())
        follower.send(m.Fatal(rank, f"{type(e).__name__}: {e}"))
        os._exit(1)
    finally:
        follower.close()
    os._exit(0)  # skip interpreter teardown: NIXL/UCX threads may still hold the agent


class Follower:
    def __init__(self, config: EngineConfig, devices: list[str], init_method: str, conn: Connection) -> None:
        self.config = config
        self.rank = config.parallel.tp_rank
        self.device = torch.device(devices[self.rank])
        self.init_method = init_method
        self.conn = conn
        self._send_lock = threading.Lock()
        self.kv_rank: LocalKVRank | None = None
        self._loop = asyncio.new_event_loop()
        self._transfers = threading.Thread(target=self._loop.run_forever, name="tp-transfers", daemon=True)

    # ---- the pipe --------------------------------------------------------------------------------
    def send(self, message: m.msgspec.Struct) -> None:
        """Thread-safe; a pipe rank 0 already closed is ignored (this process is ending anyway)."""
        try:
            with self._send_lock:
                self.conn.send_bytes(m.encode(message))
        except (OSError, ValueError):
            pass

    def _recv(self) -> m.ToFollower:
        try:
            return m.to_follower.decode(self.conn.recv_bytes())
        except EOFError:
            log.warning("TP rank %d: rank 0 is gone; exiting", self.rank)
            return m.Shutdown()

    # ---- lifetime --------------------------------------------------------------------------------
    def run(self) -> None:
        config = self.config
        join_group(self.device, self.rank, config.parallel.tp_size, self.init_method)
        source = resolve_model(config.model)
        dtype = config.resolve_dtype(self.device, source.checkpoint_dtype)
        model = load_model(config, source, dtype, self.device)
        self.send(m.Hello(self.rank, num_blocks_for(config, source, dtype, self.device)))
        allocate = self._recv()
        if not isinstance(allocate, m.Allocate):
            return  # rank 0 stopped before the group was up
        self.layout = kv_layout(config, source, dtype, allocate.num_blocks)
        self.cache = KVCache(self.layout, self.device, scratch_block=allocate.num_blocks - 1)
        # No CUDA graphs under TP (rank 0 has none either): every step runs eagerly on every rank.
        runner = ModelRunner(model, self.cache, self.device, kv_shared_prefill_skip=config.kv_shared_prefill_skip,
                             attention_backend=config.attention_backend)
        self._transfers.start()
        while True:
            message = self._recv()
            if isinstance(message, m.Step):
                runner.execute(message.chunks)
            elif isinstance(message, m.Read):
                asyncio.run_coroutine_threadsafe(self._read(message), self._loop)
            elif isinstance(message, m.OpenAgent):
                self._open_agent(message.name)
            elif isinstance(message, m.RemovePeer):
                if self.kv_rank is not None:
                    self._loop.call_soon_threadsafe(self.kv_rank.remove_peer, message.name)
            elif isinstance(message, m.Shutdown):
                return

    def close(self) -> None:
        if self._transfers.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._transfers.join(5)
        if self.kv_rank is not None:
            self.kv_rank.agent.close()
        leave_group()

    # ---- KV transfer -----------------------------------------------------------------------------
    def _open_agent(self, name: str) -> None:
        agent = TransferAgent(name, device=self.device.type)
        self.kv_rank = LocalKVRank(agent, self.layout, self.cache.buffers)
        regions = [m.Region(r.address, r.length, r.device_id, r.kind) for r in self.kv_rank.regions]
        self.send(m.AgentOpened(name, agent.metadata(), regions))
        asyncio.run_coroutine_threadsafe(self._push_notifications(), self._loop)

    async def _read(self, message: m.Read) -> None:
        try:
            if self.kv_rank is None:
                raise RuntimeError("no NIXL agent open on this rank")
            local = np.frombuffer(message.local_rows, dtype=np.uint64).reshape(-1, 3)
            remote = np.frombuffer(message.remote_rows, dtype=np.uint64).reshape(-1, 3)
            num_bytes, num_descriptors = await self.kv_rank.read(
                message.peer_metadata, local, remote, message.notify, message.remote_mem_kind, message.timeout_s)
            reply = m.ReadDone(message.id, num_bytes, num_descriptors)
        except TransferTimeout as e:
            reply = m.ReadDone(message.id, error=str(e), timed_out=True, aborted=e.aborted)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the reader as an error
            reply = m.ReadDone(message.id, error=f"{type(e).__name__}: {e}")
        self.send(reply)

    async def _push_notifications(self) -> None:
        while True:
            notes = self.kv_rank.poll_notifications()
            if notes:
                self.send(m.Notifications(notes))
            await asyncio.sleep(NOTIFICATION_POLL_S)
