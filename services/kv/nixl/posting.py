"""Where ``TransferAgent.read`` posts a READ: on the caller's thread (the event loop) or on the agent's worker
thread (``reader.ReadWorker``), and how long the caller's thread then polls it.

A READ whose post cannot block for long is posted on the caller's thread instead of the worker's, if the agent's
lock is free at that moment, and completes there when the post finishes it; a device READ posted there is also
polled there for up to ``_INLINE_SPIN_S``, so a small GPU copy costs no thread hand-over at all. "Cannot block for
long" is judged without knowing the transport: a few descriptors, from a peer already read from, while no other
READ of this agent is in flight, and at most ``_INLINE_MAX_HOST_BYTES``, or on device memory as many bytes as the
peer's fastest READ so far (its first aside, which sets up the connection) moved in ``_INLINE_MAX_COPY_S``. Over
UCX's TCP transport (``UCX_TLS=tcp``, and ``tcp,cuda_copy`` staging VRAM through host memory) the data moves inside
NIXL's calls (post, poll, or the UCX progress thread, which then holds UCX's worker: a 64 KiB post on the loop
waited ~50 ms behind another READ's stream on the CI machine), so an unbounded READ posted or polled on the loop
held it for as long as the copy: the H100 decode worker missed the router's 1 s health probe pulling 1 GiB parts.
"""

from __future__ import annotations

from services.kv.nixl.handle import TransferHandle
from services.kv.nixl.reader import ReadJob

# A post that may run on the caller's thread: at most this many descriptors and bytes (on host memory the
# post is the copy with shared memory, ~0.1 ms per MiB here; UCX over TCP moves 256 KiB in ~1 ms)...
_INLINE_MAX_DESCRIPTORS, _INLINE_MAX_HOST_BYTES = 64, 256 << 10
# ... or on device memory as many bytes as the peer's fastest READ moved in this long: whatever the transport
# does inside the post and polls (UCX over TCP moves the data there), the caller's thread is held about this long.
_INLINE_MAX_COPY_S = 2e-3
# How long the caller's thread polls a device READ it posted before handing it to the worker thread: a
# small GPU copy (0.1-0.3 ms) then completes with no thread hand-over at all.
_INLINE_SPIN_S = 0.5e-3


class PostingPolicy:
    """One agent's answer to "may this READ be posted on the caller's thread, and polled there how long", and the
    per-peer rates it judges by, learnt from the READs that completed."""

    def __init__(self) -> None:
        # Peers a READ has completed from (connection and mappings set up) -> the fastest rate a later one moved
        # (bytes/s), None after the first.
        self._peer_bytes_per_s: dict[str, float | None] = {}

    def inline(self, job: ReadJob, busy: bool) -> bool:
        """Whether the post (and a device READ's spin) is short enough for the caller's thread, whatever the
        transport (see the module docstring); ``busy``: another READ of the agent is in flight or queued."""
        if job.peer not in self._peer_bytes_per_s or job.ctx["num_descriptors"] > _INLINE_MAX_DESCRIPTORS:
            return False  # a first READ from a peer sets up its connection and mappings inside the post
        if busy:
            return False  # UCX moves the other READs' data meanwhile, and a post or poll here would wait for it
        bytes_per_s = self._peer_bytes_per_s[job.peer]
        if _on_device(job) and bytes_per_s is not None:
            return job.num_bytes <= max(bytes_per_s * _INLINE_MAX_COPY_S, _INLINE_MAX_HOST_BYTES)
        return job.num_bytes <= _INLINE_MAX_HOST_BYTES

    def spin_s(self, job: ReadJob) -> float:
        """How long the caller's thread polls a READ it posted that is still in flight (0: not at all, a host
        READ: its post is the copy)."""
        return _INLINE_SPIN_S if _on_device(job) else 0.0

    def completed(self, handle: TransferHandle) -> None:
        """Record a completed READ's rate for its peer: the fastest so far (latency only lowers it), none for the
        first, whose post set up the connection (40 ms for 64 KiB here)."""
        if handle.peer not in self._peer_bytes_per_s:
            self._peer_bytes_per_s[handle.peer] = None
            return
        result = handle.result()
        rate = result.num_bytes / max(result.seconds, 1e-6)
        self._peer_bytes_per_s[handle.peer] = max(rate, self._peer_bytes_per_s[handle.peer] or 0.0)

    def forget(self, peer: str) -> None:
        """The peer was removed: a READ from it again is a first one."""
        self._peer_bytes_per_s.pop(peer, None)


def _on_device(job: ReadJob) -> bool:
    return job.mem_kind == "VRAM" and job.remote_mem_kind == "VRAM"
