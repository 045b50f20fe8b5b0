"""Rank 0's side of a tensor-parallel engine: start the followers, keep them in step, watch them.

::

    daemon process (rank 0)                          follower processes (ranks 1..tp-1)
    LLMEngine: schedule -> Step ------- pipe ------>  run the same chunks
               run the step  <==== all-reduce ====>   (gloo on CPU, NCCL on CUDA)
    worker layer --------- OpenAgent/Read -- pipe ->  rank service (the worker layer's):
      (on_message)    <- AgentOpened/ReadDone/...    NIXL agent of this rank's KV shard

One pipe per follower carries everything but tensors; the collectives inside the model carry
those. The group knows steps, start-up and failure; the KV-transfer messages are the worker
layer's (``install_rank_service``, ``send``, ``on_message``), so the engine holds no transfer
code. A follower that dies (its pipe closes) or reports ``Fatal`` fails the group: the
``on_failure`` callbacks run (the worker layer fails its pending pulls at once, the daemon takes
the worker down), and the next step raises, since a TP engine with a missing rank can only hang
or compute garbage.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from multiprocessing.connection import Connection

import msgspec
import torch

from services.engine.engine_config import EngineConfig
from services.engine.parallel import ParallelConfig
from services.engine.runner.model_runner import ModelRunner
from services.engine.runner.step import Chunk, StepLogits
from services.engine.tp import messages as m
from services.engine.tp.distributed import free_init_method, join_group, leave_group
from services.engine.tp.follower import follower_main
from services.engine.tp.rank_service import RankServiceFactory

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a follower loading a large checkpoint from a slow disk


class TPGroupError(RuntimeError):
    """A follower rank died or failed: this TP engine cannot go on."""


class _Follower:
    """One follower process as rank 0 sees it."""

    def __init__(self, rank: int, process: multiprocessing.Process, conn: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.send_lock = threading.Lock()
        self.replies: queue.Queue[m.Hello] = queue.Queue()  # start-up answers


class TPGroup:
    """Follower ranks 1..tp-1 of the engine this process runs as rank 0."""

    def __init__(self, config: EngineConfig, devices: Sequence[str], log_level: str = "WARNING") -> None:
        """Spawn the followers and join the group with them (blocks until every rank joined).

        ``devices[r]`` is rank r's device; ``config`` is rank 0's (its ``parallel.tp_rank`` is 0).
        """
        tp = config.parallel.tp_size
        if tp < 2 or config.parallel.tp_rank != 0 or len(devices) != tp:
            raise ValueError(f"a TP group needs tp >= 2, rank 0 and one device per rank (got tp {tp}, "
                             f"rank {config.parallel.tp_rank}, devices {list(devices)})")
        self.tp_size = tp
        self.failure: str | None = None
        self._on_failure: list[Callable[[str], None]] = []
        self._on_message: Callable[[int, m.FromService], None] | None = None
        self._failure_lock = threading.Lock()
        self._closing = False
        init_method = free_init_method()
        ctx = multiprocessing.get_context("spawn")
        self._followers: list[_Follower] = []
        for rank in range(1, tp):
            parent, child = ctx.Pipe()
            rank_config = replace(config, device=devices[rank], parallel=ParallelConfig(tp, rank))
            process = ctx.Process(target=follower_main, name=f"pdserve-tp-rank{rank}", daemon=True,
                                  args=(rank_config, list(devices), init_method, child, log_level))
            process.start()
            child.close()
            follower = _Follower(rank, process, parent)
            self._followers.append(follower)
            threading.Thread(target=self._listen, args=(follower,), name=f"tp-rank{rank}-pipe", daemon=True).start()
        self._join(torch.device(devices[0]), init_method)

    def _join(self, device: torch.device, init_method: str) -> None:
        """Join as rank 0 on a helper thread, so a follower that dies before joining is noticed."""
        joined: Future[None] = Future()

        def join() -> None:
            try:
                join_group(device, 0, self.tp_size, init_method)
                joined.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                joined.set_exception(e)

        threading.Thread(target=join, name="tp-join", daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not joined.done():
            self._check()
            if time.monotonic() > deadline:
                self.close()
                raise TPGroupError(f"TP ranks did not join within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        joined.result()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the join thread set it for itself only

    # ---- start-up ------------------------------------------------------------------------------
    def agree_num_blocks(self, num_blocks: int) -> int:
        """The smallest KV block count any rank can hold; every rank allocates that many."""
        hellos = [self._expect(f, m.Hello, START_TIMEOUT_S) for f in self._followers]
        agreed = min([num_blocks, *(h.num_blocks for h in hellos)])
        for f in self._followers:
            self._send(f, m.Allocate(agreed))
        return agreed

    def leader_runner(self, runner: ModelRunner) -> LeaderRunner:
        return LeaderRunner(runner, self)

    # ---- steps and reads -----------------------------------------------------------------------
    def send_step(self, chunks: Sequence[Chunk], block_size: int) -> None:
        """Send a step to every follower; raises TPGroupError once a follower has failed."""
        self._check()
        data = m.encode(m.Step([_step_chunk(c, block_size) for c in chunks]))
        for f in self._followers:
            self._send_bytes(f, data)

    # ---- the rank services (the worker layer's KV transfers) ---------------------------------------
    @property
    def follower_ranks(self) -> range:
        return range(1, self.tp_size)

    def install_rank_service(self, factory: RankServiceFactory) -> None:
        """Have every follower build ``factory``'s service for the messages that are not steps
        (``messages.ToService``); a follower keeps the first service it was given."""
        data = m.encode(m.InstallService(pickle.dumps(factory)))
        for f in self._followers:
            self._send_bytes(f, data)

    def on_message(self, handler: Callable[[int, m.FromService], None]) -> None:
        """``handler(rank, message)`` gets the rank services' messages, on that rank's pipe thread."""
        self._on_message = handler

    def send(self, rank: int, message: m.ToService) -> None:
        """Send a message to follower ``rank``'s service; raises TPGroupError once the group failed."""
        self._check()
        self._send(self._followers[rank - 1], message)

    # ---- failure -------------------------------------------------------------------------------
    def on_failure(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` runs once, on a pipe thread, when a follower dies or fails."""
        self._on_failure.append(callback)
        if self.failure is not None:
            callback(self.failure)

    @property
    def healthy(self) -> bool:
        return self.failure is None and all(f.process.is_alive() for f in self._followers)

    def _check(self) -> None:
        if self.failure is not None:
            raise TPGroupError(self.failure)

    def _fail(self, reason: str) -> None:
        with self._failure_lock:
            if self.failure is not None or self._closing:
                return
            self.failure = reason
        log.error("tensor-parallel group failed: %s", reason)
        for callback in self._on_failure:
            callback(reason)

    # ---- the pipes -----------------------------------------------------------------------------
    def _listen(self, f: _Follower) -> None:
        """Route a follower's messages until its pipe closes (it exited or died)."""
        while True:
            try:
                message = m.to_leader.decode(f.conn.recv_bytes())
            except (EOFError, OSError):
                f.process.join(2)
                self._fail(f"TP rank {f.rank} exited (exit code {f.process.exitcode})")
                return
            if isinstance(message, m.FromService):
                handler = self._on_message
                if handler is not None:
                    handler(f.rank, message)
                else:
                    log.warning("TP rank %d sent %s, but no handler is registered", f.rank, type(message).__name__)
            elif isinstance(message, m.Fatal):
                self._fail(f"TP rank {message.rank} failed: {message.error}")
            else:
                f.replies.put(message)

    def _expect(self, f: _Follower, kind: type, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            self._check()
            try:
                message = f.replies.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TPGroupError(f"TP rank {f.rank} sent no {kind.__name__} within {timeout_s:.0f} s") from None
                continue
            if not isinstance(message, kind):
                raise TPGroupError(f"TP rank {f.rank} sent {type(message).__name__}, expected {kind.__name__}")
            return message

    def _send(self, f: _Follower, message: msgspec.Struct) -> None:
        self._send_bytes(f, m.encode(message))

    def _send_bytes(self, f: _Follower, data: bytes) -> None:
        try:
            with f.send_lock:
                f.conn.send_bytes(data)
        except (OSError, ValueError) as e:
            self._fail(f"TP rank {f.rank} is unreachable ({e})")
            self._check()

    # ---- shutdown ------------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every follower (Shutdown, then kill what does not exit) and leave the group."""
        self._closing = True
        for f in self._followers:
            try:
                with f.send_lock:
                    f.conn.send_bytes(m.encode(m.Shutdown()))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for f in self._followers:
            f.process.join(max(0.0, deadline - time.monotonic()))
            if f.process.is_alive():
                f.process.kill()
                f.process.join(5)
            f.conn.close()
        if self.failure is None:
            leave_group()  # with a dead rank, NCCL's teardown could wait on it forever


class LeaderRunner:
    """Rank 0's model runner: each step goes to the followers first, then runs here."""

    def __init__(self, runner: ModelRunner, group: TPGroup) -> None:
        self.runner = runner
        self.group = group
        self.block_size = runner.groups[0].block_size  # every KV group has the engine's block size

    def runs_as_graph(self, chunks: Sequence[Chunk]) -> bool:
        return False  # a TP engine runs eagerly: the followers need every token on the host

    def execute(self, chunks: Sequence[Chunk]) -> StepLogits:
        self.group.send_step(chunks, self.block_size)
        return self.runner.execute(chunks)


def _step_chunk(c: Chunk, block_size: int) -> m.StepChunk:
    """The chunk as a message: block tables cut at the last block this chunk's context touches."""
    num_blocks = -(-(c.start + c.num_tokens) // block_size)
    return m.StepChunk(list(c.token_ids), c.start, c.num_tokens, c.samples, c.return_logits,
                       [list(t[:num_blocks]) for t in c.block_ids], c.state_slot, c.kv_rounding)
