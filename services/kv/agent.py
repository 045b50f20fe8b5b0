"""The KV transfer agent: moves (address, length, device) descriptor lists between processes over NIXL.

It knows nothing of layouts, blocks or models; the planner turns those into descriptors. The decode
side reads (``read``/``start_read``), the prefill side owns the memory and learns from NIXL
notifications when a reader is done (``poll_notifications`` + :class:`NotificationTracker`).

Threading: a NIXL agent is created in its no-locking mode, so every NIXL call here goes through one
lock. On DRAM, UCX performs the whole copy inside ``postXferReq`` (CMA/shared memory is synchronous;
64 MB take ~30-60 ms on the CI machine); the call drops the GIL, so ``read`` runs preparation and the
post on a per-agent worker thread and only polls from the event loop, never waiting on the lock there.
The synchronous methods (``start_read``, ``poll_notifications``...) may wait for that lock.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

log = logging.getLogger(__name__)

MemKind = Literal["DRAM", "VRAM"]
Device = Literal["cpu", "cuda"]
DescriptorsLike = Sequence[tuple[int, int, int]] | np.ndarray
RegionLike = Any  # a torch.Tensor, a RegisteredRegion, or an (addr, length, device_id, kind) tuple

#: UCX disables cuda_ipc GET without NVLink, so a READ of VRAM silently falls back to TCP (~0.7 GB/s).
CUDA_IPC_GET_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
_MEM_KINDS = ("DRAM", "VRAM")
_MD_HEADER = b"nixlSerDes|Agent"  # nixl's metadata starts: header, u64-le name length, name
_MIN_POLL_S, _MAX_POLL_S = 0.0002, 0.002  # the event loop rounds sleeps up to ~1 ms anyway
_LOCK_TIMEOUT_S = 30.0


class TransferError(RuntimeError):
    """A NIXL operation failed; the message names the peer, the descriptors and NIXL's state."""

    def __init__(
        self, message: str, *, peer: str | None = None, num_descriptors: int = 0, num_bytes: int = 0,
        nixl_state: str | None = None,
    ) -> None:
        details = [f"peer={peer!r}"] if peer is not None else []
        if num_descriptors:
            details.append(f"{num_descriptors} descriptors, {num_bytes} bytes")
        if nixl_state is not None:
            details.append(f"nixl: {nixl_state}")
        super().__init__(f"{message} ({'; '.join(details)})" if details else message)
        self.peer, self.nixl_state = peer, nixl_state
        self.num_descriptors, self.num_bytes = num_descriptors, num_bytes


class UnknownPeerError(TransferError):
    """The peer was never added (or was removed): handshake again before reading."""


class TransferTimeout(TransferError):
    """A read did not finish in time. ``aborted`` is False when NIXL could not cancel it, so the
    destination may still be written: do not hand those local blocks to another request."""

    def __init__(self, message: str, *, aborted: bool, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.aborted = aborted


@dataclass(frozen=True)
class RegisteredRegion:
    """A registered buffer as a peer needs to see it (goes on the wire in the handshake)."""

    addr: int
    length: int
    device_id: int
    mem_kind: MemKind


@dataclass(frozen=True)
class TransferResult:
    num_bytes: int
    num_descriptors: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class _Registration:
    regions: tuple[RegisteredRegion, ...]
    nixl_dlists: tuple[Any, ...]
    keepalive: tuple[Any, ...]  # tensors whose memory must outlive the registration


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ---- descriptors ---------------------------------------------------------------------------------


def as_descriptor_array(descs: DescriptorsLike, side: str) -> np.ndarray:
    """(addr, len, dev) rows as the C-contiguous uint64 [n, 3] array NIXL copies without a Python loop."""
    try:
        arr = descs if isinstance(descs, np.ndarray) else np.asarray(descs, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{side} descriptors must be (addr, len, dev) integer triples: {exc}") from None
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] == 0:
        raise ValueError(f"{side} descriptors must be a non-empty [n, 3] (addr, len, dev) list, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{side} descriptors must be integers, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.signedinteger) and arr.min() < 0:
        row = int(np.argmin(arr.min(axis=1)))
        raise ValueError(f"{side} descriptor {row} has a negative field: {arr[row].tolist()}")
    if (arr[:, 1] == 0).any():
        raise ValueError(f"{side} descriptor {int(np.argmin(arr[:, 1]))} has length 0")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def check_pairing(local: np.ndarray, remote: np.ndarray) -> None:
    """A READ copies remote row i into local row i, so counts and lengths must match row by row."""
    if local.shape[0] != remote.shape[0]:
        raise ValueError(f"{local.shape[0]} local descriptors but {remote.shape[0]} remote descriptors")
    bad = np.flatnonzero(local[:, 1] != remote[:, 1])
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"descriptor {i} length mismatch: local {int(local[i, 1])} bytes, remote {int(remote[i, 1])} bytes "
            f"({bad.size} mismatched rows)"
        )


def peer_name_from_metadata(metadata: bytes) -> str | None:
    """The agent name at the head of nixl's serialized metadata, or None if the format is unexpected."""
    start = len(_MD_HEADER)
    if not metadata.startswith(_MD_HEADER) or len(metadata) < start + 8:
        return None
    size = int.from_bytes(metadata[start : start + 8], "little")
    raw = metadata[start + 8 : start + 8 + size]
    if len(raw) != size:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


# ---- regions -------------------------------------------------------------------------------------


def _region_of(item: RegionLike) -> tuple[RegisteredRegion, Any]:
    """(region, object to keep alive) for a tensor, a RegisteredRegion or a raw 4-tuple."""
    if isinstance(item, RegisteredRegion):
        region, keep = item, None
    elif hasattr(item, "data_ptr") and hasattr(item, "is_contiguous"):
        region, keep = _tensor_region(item), item
    elif isinstance(item, tuple) and len(item) == 4:
        region, keep = RegisteredRegion(int(item[0]), int(item[1]), int(item[2]), item[3]), None
    else:
        raise ValueError(f"cannot register {type(item).__name__}: expected a tensor or (addr, length, device_id, kind)")
    if region.mem_kind not in _MEM_KINDS:
        raise ValueError(f"memory kind must be one of {_MEM_KINDS}, got {region.mem_kind!r}")
    if region.addr <= 0 or region.length <= 0 or region.device_id < 0:
        raise ValueError(f"invalid region {region}: address and length must be > 0, device_id >= 0")
    return region, keep


def _tensor_region(tensor: Any) -> RegisteredRegion:
    if not tensor.is_contiguous():
        raise ValueError(
            f"cannot register a non-contiguous tensor (shape {tuple(tensor.shape)}, stride {tensor.stride()}): "
            "NIXL registers one address range"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot register a tensor on {tensor.device}: only cpu (DRAM) and cuda (VRAM)")
    if tensor.numel() == 0:
        raise ValueError("cannot register an empty tensor")
    if tensor.device.type == "cuda":
        kind: MemKind = "VRAM"
        device_id = tensor.device.index if tensor.device.index is not None else 0
    else:
        kind, device_id = "DRAM", 0
    return RegisteredRegion(tensor.data_ptr(), tensor.numel() * tensor.element_size(), device_id, kind)


# ---- transfers -----------------------------------------------------------------------------------


class TransferHandle:
    """One posted READ. ``poll()`` until "DONE"; NIXL resources are released on every outcome."""

    def __init__(self, agent: TransferAgent, xfer: Any, peer: str, num_descriptors: int, num_bytes: int,
                 started_at: float) -> None:
        self._agent, self._xfer = agent, xfer
        self.peer, self.num_descriptors, self.num_bytes = peer, num_descriptors, num_bytes
        self.started_at = started_at
        self._state = "PROC"  # PROC -> DONE | ERR | ABORTED
        self._error: TransferError | None = None
        self._finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self._state != "PROC"

    def poll(self) -> Literal["PROC", "DONE"]:
        """"PROC" while in flight, "DONE" once complete; raises TransferError if NIXL reports a failure."""
        return self._poll(blocking=True)

    def try_poll(self) -> Literal["PROC", "DONE"]:
        """Like poll(), but answers "PROC" instead of waiting while another NIXL call holds the agent."""
        return self._poll(blocking=False)

    def result(self) -> TransferResult:
        if self._state != "DONE" or self._finished_at is None:
            raise TransferError(f"transfer not complete (state {self._state})", peer=self.peer)
        return TransferResult(self.num_bytes, self.num_descriptors, self._finished_at - self.started_at)

    def abort(self) -> bool:
        """Cancel if still in flight; True when nothing is left in flight (see TransferTimeout)."""
        if self._state != "PROC":
            return True
        self._state = "ABORTED"
        return self._agent._release(self)

    def _poll(self, blocking: bool) -> Literal["PROC", "DONE"]:
        if self._state == "PROC":
            self._settle(self._agent._poll_xfer(self, blocking), "READ failed")
        if self._state == "DONE":
            return "DONE"
        if self._state == "PROC":
            return "PROC"
        if self._error is None:
            self._error = self._make_error(f"transfer was {self._state.lower()}", self._state)
        raise self._error

    def _settle(self, state: str | None, failure: str) -> None:
        """Record NIXL's answer; the agent has already released the request if it is terminal."""
        if state is None or state == "PROC":
            return
        if state == "DONE":
            self._state, self._finished_at = "DONE", time.monotonic()
            return
        self._state = "ERR"
        self._error = self._make_error(failure, state)

    def _make_error(self, message: str, nixl_state: str) -> TransferError:
        return TransferError(message, peer=self.peer, num_descriptors=self.num_descriptors,
                             num_bytes=self.num_bytes, nixl_state=nixl_state)


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
            raise TransferError(f"creating NIXL agent {name!r} failed: {_describe(exc)}") from exc
        missing = [b for b in backends if b not in self._nixl.backends]
        if missing:
            raise TransferError(f"NIXL backend(s) {missing} unavailable; plugins: {self._nixl.get_plugin_list()}")
        self._lock = threading.Lock()
        self._registrations: list[_Registration] = []
        self._peers: dict[str, bytes] = {}
        self._active: set[TransferHandle] = set()
        self._unreleased: list[Any] = []
        self._executor: ThreadPoolExecutor | None = None
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
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
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
        pairs = [_region_of(item) for item in items]
        if not pairs:
            raise ValueError("nothing to register")
        regions = tuple(r for r, _ in pairs)
        if self.device == "cpu" and any(r.mem_kind == "VRAM" for r in regions):
            raise ValueError(f"agent {self.name!r} was created with device='cpu' and cannot register VRAM")
        dlists = []
        try:
            for kind in _MEM_KINDS:
                rows = [(r.addr, r.length, r.device_id, "") for r in regions if r.mem_kind == kind]
                if rows:
                    with self._locked():
                        dlists.append(self._nixl.register_memory(rows, kind))
        except Exception as exc:
            self._deregister_dlists(dlists)
            raise TransferError(f"agent {self.name!r}: registering {len(regions)} regions failed: "
                                f"{_describe(exc)}") from exc
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
                log.error("agent %s: deregistering memory failed: %s", self.name, _describe(exc))

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
                                nixl_state=_describe(exc)) from exc
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
        try:
            with self._locked():
                self._nixl.remove_remote_agent(name)
        except Exception as exc:
            log.warning("agent %s: removing peer %s: %s", self.name, name, _describe(exc))

    # -- reading --

    def start_read(
        self, peer: str, local: DescriptorsLike, remote: DescriptorsLike, notify: bytes = b"",
        mem_kind: MemKind = "DRAM", *, remote_mem_kind: MemKind | None = None,
    ) -> TransferHandle:
        """Post a READ of ``remote`` (in ``peer``'s memory) into ``local``; ``notify`` (if not empty)
        reaches the peer when the READ completes. On DRAM this blocks while the copy runs."""
        started_at = time.monotonic()
        self._check_open()
        local_arr, remote_arr = self._prepare(peer, local, remote, notify, mem_kind, remote_mem_kind)
        n, num_bytes = int(local_arr.shape[0]), int(local_arr[:, 1].sum())
        ctx = {"peer": peer, "num_descriptors": n, "num_bytes": num_bytes}
        with self._locked():
            self._check_open()
            self._retry_unreleased()
            try:
                local_dl = self._nixl.get_xfer_descs(local_arr, mem_kind)
                remote_dl = self._nixl.get_xfer_descs(remote_arr, remote_mem_kind or mem_kind)
                xfer = self._nixl.initialize_xfer("READ", local_dl, remote_dl, peer, notify)
            except Exception as exc:
                raise TransferError("preparing READ failed (are the ranges inside registered memory?)",
                                    nixl_state=_describe(exc), **ctx) from exc
            handle = TransferHandle(self, xfer, peer, n, num_bytes, started_at)
            self._active.add(handle)
            try:
                state = self._nixl.transfer(xfer)
            except Exception as exc:
                state = _describe(exc)
            if state != "PROC":
                self._release_locked(handle)
        handle._settle(state, "posting READ failed")
        if handle._error is not None:
            raise handle._error
        return handle

    async def read(
        self, peer: str, local: DescriptorsLike, remote: DescriptorsLike, notify: bytes = b"",
        mem_kind: MemKind = "DRAM", *, remote_mem_kind: MemKind | None = None, timeout_s: float,
    ) -> TransferResult:
        """``start_read`` + wait, without blocking the event loop (see module docstring).

        Raises TransferTimeout after ``timeout_s`` (the READ is aborted), TransferError on failure.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        deadline = time.monotonic() + timeout_s
        self._check_open()
        # Validate here so bad input raises at once, in the caller's thread.
        local_arr, remote_arr = self._prepare(peer, local, remote, notify, mem_kind, remote_mem_kind)
        ctx = {"peer": peer, "num_descriptors": int(local_arr.shape[0]), "num_bytes": int(local_arr[:, 1].sum())}
        posting = self._worker().submit(
            self.start_read, peer, local_arr, remote_arr, notify, mem_kind, remote_mem_kind=remote_mem_kind)
        try:
            handle = await asyncio.wait_for(asyncio.wrap_future(posting), max(deadline - time.monotonic(), 0.0))
        except (TimeoutError, asyncio.CancelledError) as exc:
            # The post cannot be interrupted; abort its READ when it returns (runs even after the loop closed).
            posting.add_done_callback(_abort_when_posted)
            if isinstance(exc, TimeoutError):
                raise TransferTimeout(f"posting READ took more than {timeout_s:.3f}s", aborted=False,
                                      **ctx) from None
            raise
        try:
            await _wait_done(handle, deadline)
        except TimeoutError:
            aborted = handle.abort()
            raise TransferTimeout(f"READ not complete after {timeout_s:.3f}s", aborted=aborted, **ctx) from None
        finally:
            handle.abort()  # a no-op once finished; covers cancellation
        return handle.result()

    def send_notification(self, peer: str, message: bytes) -> None:
        """A notification not tied to a READ (e.g. after several READs for one request all finished)."""
        self._check_open()
        self._check_peer(peer)
        try:
            with self._locked():
                self._nixl.send_notif(peer, message)
        except Exception as exc:
            raise TransferError("sending notification failed", peer=peer, nixl_state=_describe(exc)) from exc

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
        for kind in (mem_kind, remote_mem_kind or mem_kind):
            if kind not in _MEM_KINDS:
                raise ValueError(f"memory kind must be one of {_MEM_KINDS}, got {kind!r}")
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

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nixl-{self.name}")
        return self._executor

    @contextlib.contextmanager
    def _locked(self, timeout_s: float = _LOCK_TIMEOUT_S) -> Iterator[None]:
        if not self._lock.acquire(timeout=timeout_s):
            raise TransferError(f"agent {self.name!r}: a NIXL call held the agent for more than {timeout_s}s")
        try:
            yield
        finally:
            self._lock.release()

    def _poll_xfer(self, handle: TransferHandle, blocking: bool) -> str | None:
        """NIXL's state for a READ (released here once terminal), or None if not blocking and busy."""
        if not self._lock.acquire(blocking=blocking, timeout=_LOCK_TIMEOUT_S if blocking else -1):
            if blocking:
                raise TransferError(f"agent {self.name!r}: lock not acquired within {_LOCK_TIMEOUT_S}s")
            return None
        try:
            try:
                state = self._nixl.check_xfer_state(handle._xfer)
            except Exception as exc:  # e.g. nixlRemoteDisconnectError
                state = _describe(exc)
            if state != "PROC":
                self._release_locked(handle)
            return state
        finally:
            self._lock.release()

    def _release(self, handle: TransferHandle) -> bool:
        with self._locked():
            return self._release_locked(handle)

    def _release_locked(self, handle: TransferHandle) -> bool:
        """Release (and thereby cancel) a READ; one NIXL cannot release yet is retried later."""
        self._active.discard(handle)
        try:
            handle._xfer.release()
            return True
        except Exception as exc:
            log.warning("agent %s: releasing a READ from %s failed (%s); will retry", self.name, handle.peer,
                        _describe(exc))
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


def _abort_when_posted(posting: Future) -> None:
    if not posting.cancelled() and posting.exception() is None:
        posting.result().abort()


async def _wait_done(handle: TransferHandle, deadline: float) -> None:
    """Poll with a short backoff; never waits on the agent lock from the event loop."""
    delay = _MIN_POLL_S
    while handle.try_poll() == "PROC":
        if time.monotonic() >= deadline:
            raise TimeoutError
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_POLL_S)


# ---- owner-side bookkeeping ----------------------------------------------------------------------


@dataclass(frozen=True)
class TrackerStats:
    num_pending: int
    num_completed: int
    num_expired: int
    num_unknown: int
    num_duplicate: int


@dataclass
class _Expected:
    num_readers: int
    created_at: float
    readers: set[str] = field(default_factory=set)


class NotificationTracker:
    """Which handed-out requests have been read by all their readers, so blocks are freed exactly once.

    With TP mismatch several reading ranks pull from one owner rank; each sends one notification
    (the request key) when its READ completes. Call ``expect`` before handing out the ticket.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._expected: dict[bytes, _Expected] = {}
        self._completed = self._expired = self._unknown = self._duplicate = 0

    def expect(self, key: bytes, num_readers: int) -> None:
        if num_readers < 1:
            raise ValueError(f"num_readers must be >= 1, got {num_readers}")
        if key in self._expected:
            raise ValueError(f"key {key!r} is already expected")
        self._expected[key] = _Expected(num_readers, self._clock())

    def feed(self, notifications: Mapping[str, Iterable[bytes]]) -> list[bytes]:
        """Count notifications (peer -> messages); return keys that just reached their reader count."""
        done = []
        for peer, messages in notifications.items():
            for key in messages:
                if self._count(peer, bytes(key)):
                    done.append(bytes(key))
        return done

    def _count(self, peer: str, key: bytes) -> bool:
        entry = self._expected.get(key)
        if entry is None:
            self._unknown += 1
            log.debug("notification %r from %s matches no pending request", key, peer)
            return False
        if peer in entry.readers:
            self._duplicate += 1
            log.debug("duplicate notification %r from %s", key, peer)
            return False
        entry.readers.add(peer)
        if len(entry.readers) < entry.num_readers:
            return False
        del self._expected[key]
        self._completed += 1
        return True

    def expire(self, older_than_s: float) -> list[bytes]:
        """Forget and return keys expected more than ``older_than_s`` ago and never completed."""
        cutoff = self._clock() - older_than_s
        old = [k for k, e in self._expected.items() if e.created_at <= cutoff]
        for key in old:
            del self._expected[key]
        self._expired += len(old)
        return old

    def discard(self, key: bytes) -> bool:
        """Stop tracking a key (its request was aborted); later notifications count as unknown."""
        return self._expected.pop(key, None) is not None

    def stats(self) -> TrackerStats:
        return TrackerStats(len(self._expected), self._completed, self._expired, self._unknown, self._duplicate)
