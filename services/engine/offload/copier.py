"""Copies whole KV blocks between the device cache and the host tier, off the engine's thread.

Device and host hold blocks in the same format (the host tier is the device layout with more
blocks), so a copy is a list of block runs applied to every KV buffer, one ``copy_`` per run and
buffer plane (a block is one region per plane: ``KVBufferSpec.num_planes``), each between contiguous
memory, so no copy stages through a temporary. The allocators favour runs of consecutive ids, so a
long prompt is a few runs::

    device blocks 40 41 42 43 | 7 8      host blocks 96 97 98 99 | 100 101
    runs  (40 -> 96, 4 blocks), (7 -> 100, 2 blocks)

On CUDA the copies run on their own stream, after an event recorded on the compute stream when
the job was submitted (a store reads what the step before wrote), into pinned host memory; the
worker thread then waits for the stream, so the engine's thread never blocks on a copy. On CPU
the worker thread does the copies itself (``copy_`` releases the GIL for large tensors).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.kv.spec.layout import KVLayoutSpec

log = logging.getLogger(__name__)

BlockRun = tuple[int, int, int]  # (first source block, first destination block, blocks)


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[BlockRun]:
    """Pairs of (source, destination) block ids merged into runs where both sides continue."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    runs: list[BlockRun] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def block_planes(layout: KVLayoutSpec, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each buffer as ``[planes, num_blocks, elements per block and plane]``: a block is ``[:, b]``.

    A cross-layer buffer is one plane (a block holds all its layers' K and V); a per-layer buffer
    is two, K then V (``[2, num_blocks, block]``); a heads-outer buffer one per head.
    """
    out = []
    for spec, buf in zip(layout.buffers(), buffers, strict=True):
        per_block = spec.block_stride_bytes // layout.element_size
        out.append(buf.view(spec.num_planes, layout.num_blocks, per_block))
    return out


# One buffer's part of a job: (source block planes, destination block planes, runs of that buffer's group).
PlaneCopy = tuple[torch.Tensor, torch.Tensor, list[BlockRun]]


@dataclass(frozen=True)
class CopyJob:
    job_id: int
    copies: list[PlaneCopy]
    ready: torch.cuda.Event | None  # recorded on the compute stream at submit (CUDA only)


class BlockCopier:
    """One worker thread running copy jobs in order; ``poll`` returns the finished ones.

    ``on_done`` is called (on the worker thread) after each job: the engine uses it to wake its
    thread, which owns every block reference and releases them when it polls.
    """

    def __init__(self, device: torch.device, on_done: Callable[[], None] | None = None) -> None:
        self.device = device
        self.on_done = on_done
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._finished: deque[tuple[int, BaseException | None]] = deque()
        self._thread = threading.Thread(target=self._run, name="kv-offload-copier", daemon=True)
        self._thread.start()

    def submit(self, job_id: int, copies: list[PlaneCopy]) -> None:
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._jobs.put(CopyJob(job_id, copies, ready))

    @property
    def has_finished(self) -> bool:
        return bool(self._finished)

    def poll(self) -> list[tuple[int, BaseException | None]]:
        """Jobs finished since the last call: (job id, the error that failed it or None)."""
        done = []
        while self._finished:
            done.append(self._finished.popleft())
        return done

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        while (job := self._jobs.get()) is not None:
            error = None
            try:
                self._copy(job)
            except Exception as e:  # a failed job is reported, never lost: the engine falls back
                log.exception("KV offload copy job %d failed", job.job_id)
                error = e
            self._finished.append((job.job_id, error))
            if self.on_done is not None:
                self.on_done()

    def _copy(self, job: CopyJob) -> None:
        stream = self._stream
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            if job.ready is not None:
                stream.wait_event(job.ready)
            for src, dst, runs in job.copies:
                for s, d, n in runs:
                    for plane in range(src.shape[0]):  # contiguous on both sides: one DMA, no temporary
                        dst[plane, d:d + n].copy_(src[plane, s:s + n], non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()
