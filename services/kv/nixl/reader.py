"""The agent's READ worker thread: posts READs handed to it, polls every READ in flight, wakes each caller once.

On DRAM, UCX performs the whole copy inside ``postXferReq`` (CMA/shared memory is synchronous; the
call drops the GIL), so ``TransferAgent.read`` hands a READ to this thread, which prepares and posts
it (through the agent: :class:`ReadPoster`) and then polls every READ in flight: tightly for the
first milliseconds (a GPU READ of a prompt takes 0.2-5 ms), then backing off, and wakes the waiting
coroutine once, when it finishes. A :class:`ReadJob` is the hand-over between the caller and the thread: the
caller waits on it (``woken``) and, past its deadline or cancelled, gives it up (``give_up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import weakref
from typing import Any, Protocol

import numpy as np

from services.kv.nixl.errors import TransferError, TransferTimeout
from services.kv.nixl.handle import TransferHandle

log = logging.getLogger(__name__)

# The worker polls a READ every _SPIN_POLL_S (the kernel makes it ~60-80 us) for its first _SPIN_S,
# then every ~10% of its age, at most every _MAX_POLL_S: bounded error for a READ of any length.
_SPIN_POLL_S, _SPIN_S, _MAX_POLL_S = 20e-6, 0.005, 0.001
# How long a cancelled read waits for a post in progress to return and be aborted (a frozen peer can hold it).
_CANCEL_WAIT_S = 2.0

#: What a waiting read's future holds when its deadline passed first (see :func:`expire`).
TIMED_OUT: Any = object()


def wake(future: asyncio.Future) -> None:
    """Resume the coroutine waiting on ``future`` (its job finished); called on the loop's thread."""
    if not future.done():
        future.set_result(None)


def expire(future: asyncio.Future) -> None:
    """Resume the coroutine waiting on ``future`` with :data:`TIMED_OUT` (its deadline passed)."""
    if not future.done():
        future.set_result(TIMED_OUT)


class ReadJob:
    """One ``read`` between the caller and the worker thread.

    ``state`` (under ``lock``): queued -> posting -> in_flight -> finished, or cancelled when the
    caller stopped waiting first; whoever moves it to finished or cancelled owns the outcome.
    """

    def __init__(self, peer: str, local: np.ndarray, remote: np.ndarray, notify: bytes, mem_kind: str,
                 remote_mem_kind: str, timeout_s: float, loop: asyncio.AbstractEventLoop, entered: float,
                 prepared: Any = None, size: tuple[int, int] | None = None) -> None:
        """``local``/``remote``: descriptor rows, or with ``prepared`` (``PreparedLists``) index arrays into
        its lists; then ``size`` is the READ's (bytes, descriptors), which the indices do not show."""
        self.peer, self.local, self.remote, self.notify = peer, local, remote, notify
        self.prepared = prepared
        self.notify_after = b""  # sent once the READ completed, instead of with it
        self.mem_kind, self.remote_mem_kind = mem_kind, remote_mem_kind
        self.num_bytes, num_descriptors = size if size is not None else (int(local[:, 1].sum()), int(local.shape[0]))
        self.ctx = {"peer": peer, "num_descriptors": num_descriptors, "num_bytes": self.num_bytes}
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s
        self.loop, self.future = loop, loop.create_future()
        self.lock = threading.Lock()
        self.state = "queued"
        self.post_returned = threading.Event()  # the worker's post returned (and aborted it if cancelled)
        self.handle: TransferHandle | None = None
        self.outcome: BaseException | None = None
        self.marks = {"entered": entered}

    async def woken(self) -> Any:
        """Wait (the caller, once the job is handed to the worker) until the worker wakes it or the deadline
        passes; what woke it (:data:`TIMED_OUT` for the deadline). A cancelled caller gives the READ up first."""
        loop = self.loop  # a timer on the future itself: fewer loop iterations than wait_for(shield(...))
        timer = loop.call_at(loop.time() + max(self.deadline - time.monotonic(), 0.0), expire, self.future)
        try:
            return await self.future
        except asyncio.CancelledError:
            if self.give_up(cancelled=True) == "posting":
                # The agent's thread is inside NIXL's post and aborts the READ when it returns: wait for
                # that (bounded, off the event loop), so a cancelled read has left nothing in flight.
                await asyncio.get_running_loop().run_in_executor(None, self.post_returned.wait, _CANCEL_WAIT_S)
            raise
        finally:
            timer.cancel()

    def give_up(self, cancelled: bool = False) -> str:
        """The caller stops waiting (timeout or cancellation): abort or disown the READ.

        Returns the state the job was in when the READ finished meanwhile (its outcome is the job's) or
        on cancellation; else raises TransferTimeout (not on cancellation, which the caller re-raises).
        """
        with self.lock:
            state = self.state
            if state == "finished":
                return state
            self.state = "cancelled"
        if state == "in_flight":
            aborted, what = self.handle.abort(), f"READ not complete after {self.timeout_s:.3f}s"
        else:  # queued: never posted, nothing to abort; posting: the worker aborts it when the post returns
            aborted, what = state == "queued", f"posting READ took more than {self.timeout_s:.3f}s"
        if not cancelled:
            raise TransferTimeout(what, aborted=aborted, **self.ctx) from None
        return state


class ReadPoster(Protocol):
    """What the worker needs from its agent (``TransferAgent``)."""

    name: str

    def _post(self, job: ReadJob, blocking: bool) -> TransferHandle | None: ...

    def _notify_after(self, job: ReadJob, handle: TransferHandle) -> None: ...


class ReadWorker:
    """The agent's worker thread: posts READs handed to it and polls every READ in flight until it ends.

    One thread serves all of an agent's READs, so concurrent pulls stay concurrent on the device
    (their posts are short there) and each completion wakes its coroutine exactly once.
    """

    _STOP: Any = object()

    def __init__(self, agent: ReadPoster) -> None:
        self._agent = weakref.proxy(agent)  # the thread must not keep an agent nobody closed alive
        self._name = agent.name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._in_flight: list[ReadJob] = []
        self._thread = threading.Thread(target=self._run, name=f"nixl-{agent.name}", daemon=True)
        self._thread.start()
        weakref.finalize(agent, self.stop)

    def submit(self, job: ReadJob) -> None:
        """Post ``job`` (queued) or watch it (in flight already)."""
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(self._STOP)

    def _run(self) -> None:
        try:
            while True:
                try:
                    job = self._jobs.get(timeout=self._delay()) if self._in_flight else self._jobs.get()
                except queue.Empty:
                    job = None
                while job is not None:
                    if job is self._STOP:
                        self._fail_all()
                        return
                    self._take(job)
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        job = None
                self._sweep()
        except ReferenceError:  # the agent was collected without close(): nothing can be waiting on it
            return
        except BaseException:  # never expected; callers still time out
            log.exception("agent %s: the READ thread stopped", self._name)

    def _delay(self) -> float:
        """Poll fresh READs every ~_SPIN_POLL_S, older ones every ~10% of their age (<= _MAX_POLL_S)."""
        age = time.perf_counter() - max(j.marks.get("posted", 0.0) for j in self._in_flight)
        return _SPIN_POLL_S if age < _SPIN_S else min(_MAX_POLL_S, 0.1 * age)

    def _take(self, job: ReadJob) -> None:
        with job.lock:
            state = job.state
            if state == "queued":
                job.state = "posting"
        if state == "in_flight":  # posted by the caller; watch it
            self._in_flight.append(job)
            return
        if state != "queued":  # the caller gave up before it started
            return
        try:
            handle = self._agent._post(job, blocking=True)
        except Exception as exc:
            job.post_returned.set()
            self._finish(job, exc)
            return
        with job.lock:
            cancelled = job.state == "cancelled"
            if not cancelled:
                job.state, job.handle = "in_flight", handle
        if cancelled:  # the caller timed out or was cancelled during the post (it said aborted=False)
            handle.abort()
        job.post_returned.set()
        if cancelled:
            return
        if handle.done:
            self._finish(job, None)
            self._agent._notify_after(job, handle)  # after waking the caller: not on its path
        else:
            self._in_flight.append(job)

    def _sweep(self) -> None:
        still = []
        for job in self._in_flight:
            if job.state != "in_flight":  # cancelled: the caller aborted it
                continue
            try:
                state = job.handle.poll()
            except TransferError as exc:
                self._finish(job, exc)
                continue
            if state == "DONE":
                self._finish(job, None)
                self._agent._notify_after(job, job.handle)  # after waking the caller: not on its path
            elif time.monotonic() >= job.deadline:
                aborted = job.handle.abort()
                self._finish(job, TransferTimeout(f"READ not complete after {job.timeout_s:.3f}s", aborted=aborted,
                                                  **job.ctx))
            else:
                still.append(job)
        self._in_flight = still

    def _finish(self, job: ReadJob, error: BaseException | None) -> None:
        job.marks["done"] = time.perf_counter()
        with job.lock:
            if job.state == "cancelled":
                return
            job.state, job.outcome = "finished", error
        with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody is waiting
            job.loop.call_soon_threadsafe(wake, job.future)

    def _fail_all(self) -> None:
        """The agent closed: end every READ this thread still has (closing aborted the posted ones)."""
        jobs = self._in_flight
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not self._STOP:
                jobs.append(job)
        for job in jobs:
            if job.handle is not None:
                job.handle.abort()
            self._finish(job, TransferError(f"agent {self._name!r} closed", **job.ctx))
