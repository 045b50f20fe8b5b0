"""A follower TP rank (1..tp-1): build its runtime, then run what rank 0 sends until told to stop.

It never schedules: rank 0 sends each step's chunks (``messages.Step``) before running the step
itself, and the model's all-reduces keep the ranks in lockstep. Everything else rank 0 sends (the
KV-transfer messages) goes to the rank service the worker layer installed (``rank_service``),
which runs its transfers beside the steps, as rank 0's pulls run beside its engine thread.

If rank 0 goes away (its end of the pipe closes) the follower exits; if the follower fails, it
says why (``messages.Fatal``) and exits non-zero, and rank 0 takes the worker down.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import traceback
from multiprocessing.connection import Connection

import msgspec
import torch

from services.engine.engine_config import EngineConfig
from services.engine.loading.source import resolve_model
from services.engine.runner.rank_runtime import RankRuntime
from services.engine.tp import messages as m
from services.engine.tp.distributed import join_group, leave_group
from services.engine.tp.rank_service import RankContext, RankService

log = logging.getLogger(__name__)


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
    os._exit(0)  # skip interpreter teardown: a rank service's threads (NIXL/UCX) may still hold its agent


class _RankZeroStopped(Exception):
    """Rank 0 stopped before the group was up (it sent no ``Allocate``)."""


class Follower:
    def __init__(self, config: EngineConfig, devices: list[str], init_method: str, conn: Connection) -> None:
        self.config = config
        self.rank = config.parallel.tp_rank
        self.device = torch.device(devices[self.rank])
        self.init_method = init_method
        self.conn = conn
        self._send_lock = threading.Lock()
        self.runtime: RankRuntime | None = None
        self.service: RankService | None = None

    # ---- the pipe --------------------------------------------------------------------------------
    def send(self, message: msgspec.Struct) -> None:
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
        try:
            self.runtime = RankRuntime(config, resolve_model(config.model), self._agree_num_blocks)
        except _RankZeroStopped:
            return
        runner = self.runtime.runner
        while True:
            message = self._recv()
            if isinstance(message, m.Step):
                runner.execute(message.chunks)
            elif isinstance(message, m.ToService):
                self._service().handle(message)
            elif isinstance(message, m.InstallService):
                self._install(message)
            elif isinstance(message, m.Shutdown):
                return

    def _agree_num_blocks(self, num_blocks: int) -> int:
        """Tell rank 0 how many blocks fit here; allocate the count it sends back (every rank's smallest)."""
        self.send(m.Hello(self.rank, num_blocks))
        allocate = self._recv()
        if not isinstance(allocate, m.Allocate):
            raise _RankZeroStopped
        return allocate.num_blocks

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
        leave_group()

    # ---- the rank service --------------------------------------------------------------------------
    def _install(self, message: m.InstallService) -> None:
        if self.service is not None:
            return  # one service per rank: a second install (a worker reopening its ranks) keeps it
        runtime = self.runtime
        factory = pickle.loads(message.factory)  # noqa: S301 - rank 0's own pipe, our own factory
        pool = runtime.state_pool
        self.service = factory(RankContext(self.rank, runtime.device, runtime.kv_layout, runtime.kv_cache, self.send,
                                           pool.buffer if pool is not None else None))

    def _service(self) -> RankService:
        if self.service is None:
            raise RuntimeError(f"TP rank {self.rank}: a KV-transfer message, but no rank service is installed")
        return self.service
