"""The KV transfer agent: moves (address, length, device) descriptor lists between processes over NIXL.

It knows nothing of layouts, blocks or models; the planner turns those into descriptors. The decode
side reads (``read``/``start_read``), the prefill side owns the memory and learns from NIXL
notifications when a reader is done (``poll_notifications`` + ``services.kv.owner.notifications``).

Threading: a NIXL agent is created in its no-locking mode, so every NIXL call here goes through one
lock. On DRAM, UCX performs the whole copy inside ``postXferReq`` (CMA/shared memory is synchronous;
64 MB take ~10-60 ms on the CI machine; the call drops the GIL). ``read`` therefore hands a READ to
the agent's one worker thread (``reader.ReadWorker``), which prepares and posts it and then polls
every READ in flight: tightly for the first milliseconds (a GPU READ of a prompt takes 0.2-5 ms),
then backing off, and wakes the waiting coroutine once, when it finishes. A READ whose post cannot block for
long is posted on the caller's thread instead, if the lock is free at that moment, and completes there when the
post finishes it (a device READ is polled there a little first): which READs, the agent asks its
``posting.PostingPolicy``, which also says why that bound matters (over UCX's TCP transport the data moves inside
NIXL's calls). NIXL 1.5.1 drops the GIL in ``postXferReq`` and ``getXferStatus`` (checked on the CI machine: the
main thread ran during a 54 ms poll on another thread), so the worker thread's long calls do not hold the loop.
The event loop never waits on the lock except to abort a READ that timed out (and to add, prepare or remove a
peer). ``prepare_lists``/``read_prepared``: lists NIXL prepared once per peer (``prepared.PreparedLists``), a READ
then being two index arrays (``make_prepped_xfer``). The synchronous methods (``start_read``,
``poll_notifications``, ``send_notification``...) may wait for that lock; ``notify`` is ``send_notification`` for
the event loop.

Quirks of nixl 1.5.1 this module works around (checked on the CI machine):
- ``add_remote_agent`` with a known name but new metadata (a restarted peer) fails with
  NIXL_ERR_NOT_ALLOWED; the old entry must be invalidated first. The name is read from the metadata
  header so a restarted peer can be replaced.
- A descriptor array must be C-contiguous uint64/int64; int64 takes a slower element-wise path
  (~15x when building the list), so arrays are converted to contiguous uint64 once.
- Releasing an in-flight transfer is NIXL's only abort and is best effort: the remote may still be
  writing the local destination afterwards, so after :class:`TransferTimeout` the caller must not
  reuse those destination blocks for another request's data. An aborted READ sends no notification.
- ``add_remote_agent`` connects at once: adding a dead peer fails there. A READ from a peer that died
  after connecting fails at post (NIXL_ERR_REMOTE_DISCONNECT); one from a peer that is alive but
  stalled (e.g. SIGSTOP) stays in progress forever, which is what the timeout is for.
- ``nixl_agent`` silently skips a backend whose plugin is missing; that is checked here.
- The UCX progress thread (on by default in nixl) busy-polls a core per agent on DRAM, idle or not:
  on the 2-core CI machine two agents took both cores and cut DRAM READs from ~6 to ~1.4 GB/s.
  Host-memory agents here run without it; device-memory agents keep it (see ``TransferAgent``).
- On DRAM, a READ that carries a notification, or follows one the peer has not taken in yet, completes
  only once the peer's agent has progressed (it polls notifications, or runs a progress thread): a
  4 MB READ copies in ~1 ms and then waited for the owner's next poll (10 ms here). So ``read`` sends
  a host-memory READ's notification itself, right after the READ completed, rather than with it; a
  device READ keeps it on the READ (device-memory agents run a progress thread). Either way the peer
  hears only of a completed READ, never of an aborted one.
- ``make_prepped_xfer`` merges consecutive entries that are adjacent on both sides; ``initialize_xfer``
  does not (the planner merges runs itself, so the two give the same descriptors here). Building the
  request costs microseconds either way (~2-14 us for 1-512 rows on the CI machine); what prepared lists
  save is the Python around it (rows, their checks, the lists per READ).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from services.kv.nixl.descriptors import (
    MEM_KINDS,
    DescriptorsLike,
    MemKind,
    RegionLike,
    RegisteredRegion,
    as_descriptor_array,
    check_pairing,
    checked_mem_kinds,
    peer_name_from_metadata,
    region_of,
)
from services.kv.nixl.errors import TransferError, UnknownPeerError, describe
from services.kv.nixl.handle import TransferHandle, TransferResult
from services.kv.nixl.posting import PostingPolicy
from services.kv.nixl.prepared import PreparedLists
from services.kv.nixl.reader import TIMED_OUT, ReadJob, ReadWorker

log = logging.getLogger(__name__)

Device = Literal["cpu", "cuda"]

#: UCX disables cuda_ipc GET without NVLink, so a READ of VRAM silently falls back to TCP (~0.7 GB/s).
CUDA_IPC_GET_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
_LOCK_TIMEOUT_S = 30.0

#: A dict here collects the stage durations (seconds) of ``TransferAgent.read`` calls in this context.
read_stages: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("read_stages", default=None)


@dataclass(frozen=True)
class _Registration:
    regions: tuple[RegisteredRegion, ...]
    nixl_dlists: tuple[Any, ...]
    keepalive: tuple[Any, ...]  # tensors whose memory must outlive the registration


class TransferAgent:
    """One NIXL agent (one per TP rank): registers KV memory, knows peers, reads, collects notifications.

    ``device`` says which memory it moves: "cpu" registers DRAM only; "cuda" registers VRAM (and
    DRAM, e.g. a CPU tier) and turns on UCX's cuda_ipc GET unless the operator already chose a value.
    Safe to share between the event loop and the agent's own worker thread, as the module docstring says.
    """

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), device: Device = "cpu",
                 progress_thread: bool | None = None) -> None:
        """``progress_thread``: NIXL's UCX progress thread; default on for device memory, off for host.

        On host memory it spins a whole core per agent even when idle (one per TP rank per worker)
        and buys nothing: shared-memory READs complete inside the post, and the owner progresses its
        worker whenever it polls notifications. On device memory (cuda_ipc) the transfer completes
        between polls only if something progresses it: without the thread an 8k-token pull on an
        H100 took ~3x longer in service.
        """
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and CUDA_IPC_GET_ENV not in os.environ:
            # Must be set before UCX reads its config (backend creation below); an operator's value wins.
            os.environ[CUDA_IPC_GET_ENV] = "y"
        from nixl._api import nixl_agent, nixl_agent_config

        self.name, self.device = name, device
        try:
            use_thread = device == "cuda" if progress_thread is None else progress_thread
            config = nixl_agent_config(enable_prog_thread=use_thread, backends=list(backends))
            self._nixl = nixl_agent(name, config)
        except Exception as exc:
            raise TransferError(f"creating NIXL agent {name!r} failed: {describe(exc)}") from exc
        missing = [b for b in backends if b not in self._nixl.backends]
        if missing:
            raise TransferError(f"NIXL backend(s) {missing} unavailable; plugins: {self._nixl.get_plugin_list()}")
        self._lock = threading.Lock()
        self._registrations: list[_Registration] = []
        self._peers: dict[str, bytes] = {}
        self._active: set[TransferHandle] = set()
        self._unreleased: list[Any] = []
        self._posting = PostingPolicy()  # which READs are posted on the caller's thread
        self._num_waiting = 0  # READs whose caller waits on the worker thread (posted or queued there)
        self._prepared: dict[str, list[PreparedLists]] = {}  # peer -> descriptor lists prepared for it
        self._reader: ReadWorker | None = None
        self._closed = False

    # -- lifecycle --

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Abort in-flight reads, drop peers, deregister memory. Idempotent."""
        if self._closed:
            return
        with self._locked():  # a READ being posted finishes first; later ones see the agent closed
            self._closed = True
            handles = list(self._active)
        if self._reader is not None:
            self._reader.stop()
        for handle in handles:
            handle.abort()
        for name in list(self._peers):
            self.remove_peer(name)
        with self._locked():
            self._retry_unreleased()
        if self._unreleased:
            log.error("agent %s: %d transfers could not be cancelled; keeping their memory registered",
                      self.name, len(self._unreleased))
            return
        self.deregister()

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    @property
    def num_in_flight(self) -> int:
        """READs posted and not yet completed, failed or released (a gauge for metrics and leak checks)."""
        return len(self._active)

    @property
    def regions(self) -> tuple[RegisteredRegion, ...]:
        return tuple(r for reg in self._registrations for r in reg.regions)

    # -- memory --

    def register(self, items: Iterable[RegionLike]) -> tuple[RegisteredRegion, ...]:
        """Register tensors / raw regions; all are validated before any is registered.

        Call before ``metadata()``: a peer only sees memory registered when it took the metadata.
        """
        self._check_open()
        pairs = [region_of(item) for item in items]
        if not pairs:
            raise ValueError("nothing to register")
        regions = tuple(r for r, _ in pairs)
        if self.device == "cpu" and any(r.mem_kind == "VRAM" for r in regions):
            raise ValueError(f"agent {self.name!r} was created with device='cpu' and cannot register VRAM")
        dlists = []
        try:
            for kind in MEM_KINDS:
                rows = [(r.addr, r.length, r.device_id, "") for r in regions if r.mem_kind == kind]
                if rows:
                    with self._locked():
                        dlists.append(self._nixl.register_memory(rows, kind))
        except Exception as exc:
            self._deregister_dlists(dlists)
            raise TransferError(f"agent {self.name!r}: registering {len(regions)} regions failed: "
                                f"{describe(exc)}") from exc
        keep = tuple(k for _, k in pairs if k is not None)
        self._registrations.append(_Registration(regions, tuple(dlists), keep))
        return regions

    def deregister(self) -> None:
        """Deregister everything this agent registered (peers lose access to it)."""
        while self._registrations:
            self._deregister_dlists(self._registrations.pop().nixl_dlists)

    def _deregister_dlists(self, dlists: Iterable[Any]) -> None:
        for dlist in dlists:
            try:
                with self._locked():
                    self._nixl.deregister_memory(dlist)
            except Exception as exc:
                log.error("agent %s: deregistering memory failed: %s", self.name, describe(exc))

    # -- peers --

    def metadata(self) -> bytes:
        """This agent's serialized metadata (connection info + registered memory) for a peer."""
        self._check_open()
        with self._locked():
            return bytes(self._nixl.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata and return its agent name. The same metadata again is a no-op;
        new metadata under a known name (a restarted peer) replaces the old entry."""
        self._check_open()
        name = peer_name_from_metadata(metadata)
        if name is not None and name in self._peers:
            if self._peers[name] == metadata:
                return name
            log.info("agent %s: peer %s came back with new metadata; replacing it", self.name, name)
            self.remove_peer(name)
        try:
            with self._locked():
                loaded = self._nixl.add_remote_agent(metadata)
        except Exception as exc:
            hint = "; a peer of that name is loaded with other metadata" if "NOT_ALLOWED" in str(exc) else ""
            raise TransferError(f"agent {self.name!r}: adding peer {name or '<unparsed name>'} failed{hint}",
                                nixl_state=describe(exc)) from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._peers[loaded_name] = bytes(metadata)
        return loaded_name

    def remove_peer(self, name: str) -> None:
        """Forget a peer and abort reads from it; unknown names are ignored."""
        if name not in self._peers:
            return
        with self._locked():
            handles = [h for h in self._active if h.peer == name]
        for handle in handles:
            handle.abort()
        del self._peers[name]
        self._posting.forget(name)
        try:
            with self._locked():
                for lists in self._prepared.pop(name, ()):
                    lists.release()
                self._nixl.remove_remote_agent(name)
        except Exception as exc:
            log.warning("agent %s: removing peer %s: %s", self.name, name, describe(exc))

    # -- reading --

    def start_read(
        self, peer: str, local: DescriptorsLike, remote: DescriptorsLike, notify: bytes = b"",
        mem_kind: MemKind = "DRAM", *, remote_mem_kind: MemKind | None = None,
    ) -> TransferHandle:
        """Post a READ of ``remote`` (in ``peer``'s memory) into ``local``; ``notify`` (if not empty)
        reaches the peer when the READ completes. On DRAM this blocks while the copy runs."""
        self._check_open()
        local_arr, remote_arr = self._prepare(peer, local, remote, notify, mem_kind, remote_mem_kind)
        with self._locked():
            handle = self._post_locked(peer, local_arr, remote_arr, notify, mem_kind, remote_mem_kind or mem_kind,
                                       {})
        if handle._error is not None:
            raise handle._error
        return handle

    async def read(
        self, peer: str, local: DescriptorsLike, remote: DescriptorsLike, notify: bytes = b"",
        mem_kind: MemKind = "DRAM", *, remote_mem_kind: MemKind | None = None, timeout_s: float,
    ) -> TransferResult:
        """``start_read`` + wait, without blocking the event loop (see module docstring).

        Raises TransferTimeout after ``timeout_s`` (the READ is aborted), TransferError on failure.
        When the context variable ``read_stages`` holds a dict, the READ's stage durations (seconds)
        are added to it: submit (until a thread starts on it), prepare (descriptor lists and request),
        post, complete (until its end was seen) and wake (until this coroutine resumed).
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        entered = time.perf_counter()
        self._check_open()
        # Validate here so bad input raises at once, in the caller's thread.
        local_arr, remote_arr = self._prepare(peer, local, remote, notify, mem_kind, remote_mem_kind)
        job = ReadJob(peer, local_arr, remote_arr, notify, mem_kind, remote_mem_kind or mem_kind, timeout_s,
                       asyncio.get_running_loop(), entered)
        return await self._run_read(job)

    def prepare_lists(self, peer: str, local: DescriptorsLike, remote: DescriptorsLike, mem_kind: MemKind = "DRAM",
                      *, remote_mem_kind: MemKind | None = None) -> PreparedLists:
        """Prepare ``local`` (this agent's memory) and ``remote`` (``peer``'s) descriptor lists once, for READs
        by index (``read_prepared``). The lists live until the peer is removed or the agent closes."""
        self._check_open()
        self._check_peer(peer)
        remote_kind = checked_mem_kinds(mem_kind, remote_mem_kind)
        local_arr, remote_arr = as_descriptor_array(local, "local"), as_descriptor_array(remote, "remote")
        with self._locked():
            try:
                local_dl = self._nixl.prep_xfer_dlist("NIXL_INIT_AGENT", local_arr, mem_kind)
            except Exception as exc:
                raise TransferError("preparing the local descriptor list failed", peer=peer,
                                    nixl_state=describe(exc)) from exc
            try:
                remote_dl = self._nixl.prep_xfer_dlist(peer, remote_arr, remote_kind)
            except Exception as exc:
                local_dl.release()
                raise TransferError("preparing the remote descriptor list failed", peer=peer,
                                    nixl_state=describe(exc)) from exc
            lists = PreparedLists(peer, local_dl, remote_dl, int(local_arr.shape[0]), int(remote_arr.shape[0]),
                                  mem_kind, remote_kind)
            self._prepared.setdefault(peer, []).append(lists)
        return lists

    async def read_prepared(self, lists: PreparedLists, local: np.ndarray, remote: np.ndarray, notify: bytes = b"",
                            *, num_bytes: int, num_descriptors: int, timeout_s: float) -> TransferResult:
        """``read`` of entries ``remote[i]`` of the peer's prepared list into entries ``local[i]`` of ours
        (int32 index arrays of one length; NIXL merges entries that continue each other on both sides).
        ``num_bytes``/``num_descriptors`` (after that merge) are what the READ reports and is judged by."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        entered = time.perf_counter()
        self._check_open()
        if lists.released or lists.peer not in self._peers:
            raise UnknownPeerError(f"agent {self.name!r}: the lists prepared for {lists.peer!r} were released",
                                   peer=lists.peer)
        if local.shape != remote.shape or local.ndim != 1 or not local.size:
            raise ValueError(f"index arrays must be 1-D, non-empty and of one length: {local.shape}, {remote.shape}")
        job = ReadJob(lists.peer, local, remote, notify, lists.mem_kind, lists.remote_mem_kind, timeout_s,
                       asyncio.get_running_loop(), entered, prepared=lists, size=(num_bytes, num_descriptors))
        return await self._run_read(job)

    async def _run_read(self, job: ReadJob) -> TransferResult:
        """Post ``job`` on this thread when that is short, else through the worker thread; wait for the end."""
        if job.notify and "DRAM" in (job.mem_kind, job.remote_mem_kind):  # see the module docstring
            job.notify, job.notify_after = b"", job.notify
        if self._posting.inline(job, self._busy()):  # the loop's only NIXL calls for a READ: bounded by the policy
            handle = self._post(job, blocking=False)  # None: the lock is busy, the worker takes it
            if handle is not None and not handle.done and (spin_s := self._posting.spin_s(job)):
                self._spin(handle, spin_s)
            if handle is not None:
                if handle.done:  # finished here: no thread involved at all
                    self._notify_after(job, handle)
                    job.marks["done"] = job.marks["resumed"] = time.perf_counter()
                    return self._outcome(job, handle)
                job.state, job.handle = "in_flight", handle
        self._num_waiting += 1
        self._reader_thread().submit(job)
        try:
            woken_by = await job.woken()
        finally:
            self._num_waiting -= 1
        if woken_by is TIMED_OUT:
            job.give_up()  # raises TransferTimeout unless the READ finished meanwhile
        job.marks["resumed"] = time.perf_counter()
        if isinstance(job.outcome, BaseException):
            raise job.outcome
        return self._outcome(job, job.handle)

    def send_notification(self, peer: str, message: bytes) -> None:
        """A notification not tied to a READ (e.g. after several READs for one request all finished)."""
        self._check_open()
        self._check_peer(peer)
        try:
            with self._locked():
                self._nixl.send_notif(peer, message)
        except Exception as exc:
            raise TransferError("sending notification failed", peer=peer, nixl_state=describe(exc)) from exc

    async def notify(self, peer: str, message: bytes) -> None:
        """``send_notification`` for the event loop: on a thread while a READ of this agent is in flight, when
        the call would wait for the agent's lock and UCX's worker behind that READ's data."""
        if self._busy():
            await asyncio.to_thread(self.send_notification, peer, message)
        else:
            self.send_notification(peer, message)

    # -- owner side --

    def poll_notifications(self) -> dict[str, list[bytes]]:
        """New notifications since the last call: peer agent name -> messages, in arrival order."""
        self._check_open()
        with self._locked():
            self._retry_unreleased()
            raw = self._nixl.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): [bytes(m) for m in v] for k, v in raw.items() if v}

    # -- internals --

    def _prepare(
        self, peer: str, local: DescriptorsLike, remote: DescriptorsLike, notify: bytes, mem_kind: str,
        remote_mem_kind: str | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        checked_mem_kinds(mem_kind, remote_mem_kind)
        if not isinstance(notify, bytes):
            raise ValueError(f"notify must be bytes, got {type(notify).__name__}")
        self._check_peer(peer)
        local_arr, remote_arr = as_descriptor_array(local, "local"), as_descriptor_array(remote, "remote")
        check_pairing(local_arr, remote_arr)
        return local_arr, remote_arr

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self.name!r} is closed")

    def _check_peer(self, peer: str) -> None:
        if peer not in self._peers:
            raise UnknownPeerError(f"agent {self.name!r} has no peer {peer!r} (known: {sorted(self._peers)}); "
                                   "add_peer() its metadata first", peer=peer)

    def _reader_thread(self) -> ReadWorker:
        if self._reader is None:
            self._reader = ReadWorker(self)
        return self._reader

    def _busy(self) -> bool:
        """Whether a READ of this agent is in flight or queued for the worker thread."""
        return bool(self._active) or self._num_waiting > 0

    def _spin(self, handle: TransferHandle, seconds: float) -> None:
        """Poll a READ this thread posted for up to ``seconds`` (while the lock is free)."""
        until = time.perf_counter() + seconds
        while not handle.done and time.perf_counter() < until:
            if not self._lock.acquire(blocking=False):
                return  # the worker thread is in NIXL: it watches the READ from here on
            try:
                self._poll_locked(handle)
            finally:
                self._lock.release()

    def _post(self, job: ReadJob, blocking: bool) -> TransferHandle | None:
        """Prepare and post ``job``'s READ; None when not ``blocking`` and another call holds the agent."""
        if not self._lock.acquire(blocking=blocking, timeout=_LOCK_TIMEOUT_S if blocking else -1):
            if blocking:
                raise TransferError(f"agent {self.name!r}: a NIXL call held the agent for more than "
                                    f"{_LOCK_TIMEOUT_S}s")
            return None
        try:
            return self._post_locked(job.peer, job.local, job.remote, job.notify, job.mem_kind, job.remote_mem_kind,
                                     job.marks, job.prepared, (job.num_bytes, job.ctx["num_descriptors"]))
        finally:
            self._lock.release()

    def _post_locked(self, peer: str, local: np.ndarray, remote: np.ndarray, notify: bytes, mem_kind: str,
                     remote_mem_kind: str, marks: dict[str, float], prepared: PreparedLists | None = None,
                     size: tuple[int, int] | None = None) -> TransferHandle:
        """Descriptor lists (or indices into ``prepared`` ones), request, post (the lock held). The handle may
        already be DONE or failed."""
        marks["start"] = time.perf_counter()
        started_at = time.monotonic()
        self._check_open()
        self._retry_unreleased()
        num_bytes, n = size if size is not None else (int(local[:, 1].sum()), int(local.shape[0]))
        ctx = {"peer": peer, "num_descriptors": n, "num_bytes": num_bytes}
        if prepared is not None and prepared.released:  # the peer was removed while this waited
            raise UnknownPeerError("the descriptor lists prepared for this peer were released", **ctx)
        try:
            if prepared is not None:
                xfer = self._nixl.make_prepped_xfer("READ", prepared.local, local, prepared.remote, remote, notify)
            else:
                local_dl = self._nixl.get_xfer_descs(local, mem_kind)
                remote_dl = self._nixl.get_xfer_descs(remote, remote_mem_kind)
                xfer = self._nixl.initialize_xfer("READ", local_dl, remote_dl, peer, notify)
        except Exception as exc:
            raise TransferError("preparing READ failed (are the ranges inside registered memory?)",
                                nixl_state=describe(exc), **ctx) from exc
        handle = TransferHandle(self, xfer, peer, n, num_bytes, started_at)
        self._active.add(handle)
        marks["prepared"] = time.perf_counter()
        try:
            state = self._nixl.transfer(xfer)
        except Exception as exc:
            state = describe(exc)
        marks["posted"] = time.perf_counter()
        if state != "PROC":
            self._release_locked(handle)
        handle._settle(state, "posting READ failed")
        return handle

    def _notify_after(self, job: ReadJob, handle: TransferHandle) -> None:
        """Send a completed READ's deferred notification. The data arrived whatever happens here: a failure
        is logged, and the peer's lease frees what the notification would have."""
        if not job.notify_after or handle._state != "DONE":
            return
        try:
            with self._locked():
                self._check_open()
                self._nixl.send_notif(job.peer, job.notify_after)
        except Exception as exc:
            log.warning("agent %s: READ from %s done, but its notification failed: %s", self.name, job.peer,
                        describe(exc))

    def _outcome(self, job: ReadJob, handle: TransferHandle) -> TransferResult:
        """The finished READ's result (or its error, raised), its stages recorded for the caller."""
        stages = read_stages.get()
        if stages is not None:
            m = job.marks
            stages.update(submit=m["start"] - m["entered"], prepare=m["prepared"] - m["start"],
                          post=m["posted"] - m["prepared"], complete=m["done"] - m["posted"],
                          wake=m["resumed"] - m["done"])
        if handle._error is not None:
            raise handle._error
        self._posting.completed(handle)
        return handle.result()

    @contextlib.contextmanager
    def _locked(self, timeout_s: float = _LOCK_TIMEOUT_S) -> Iterator[None]:
        if not self._lock.acquire(timeout=timeout_s):
            raise TransferError(f"agent {self.name!r}: a NIXL call held the agent for more than {timeout_s}s")
        try:
            yield
        finally:
            self._lock.release()

    def _poll_xfer(self, handle: TransferHandle) -> None:
        """Ask NIXL for a READ's state and settle the handle (released here once terminal); nothing when
        the handle settled while this waited for the lock."""
        with self._locked():
            self._poll_locked(handle)

    def _poll_locked(self, handle: TransferHandle) -> None:
        if handle._state != "PROC":  # aborted or settled by another thread while we waited
            return
        try:
            state = self._nixl.check_xfer_state(handle._xfer)
        except Exception as exc:  # e.g. nixlRemoteDisconnectError
            state = describe(exc)
        if state != "PROC":
            self._release_locked(handle)
        handle._settle(state, "READ failed")

    def _abort(self, handle: TransferHandle) -> bool:
        with self._locked():
            if handle._state != "PROC":
                return True
            handle._state = "ABORTED"
            return self._release_locked(handle)

    def _release_locked(self, handle: TransferHandle) -> bool:
        """Release (and thereby cancel) a READ; one NIXL cannot release yet is retried later."""
        self._active.discard(handle)
        try:
            handle._xfer.release()
            return True
        except Exception as exc:
            log.warning("agent %s: releasing a READ from %s failed (%s); will retry", self.name, handle.peer,
                        describe(exc))
            self._unreleased.append(handle._xfer)
            return False

    def _retry_unreleased(self) -> None:
        """Called with the lock held (or at close)."""
        still = []
        for xfer in self._unreleased:
            try:
                xfer.release()
            except Exception:
                still.append(xfer)
        self._unreleased = still
