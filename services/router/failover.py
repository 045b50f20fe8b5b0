"""Decode failover: which requests decode where, and the streams of a worker marked down that went silent.

A decode worker that dies takes its streams with it: each breaks (UNAVAILABLE, a reset, an early end) and the
request goes on at another decode worker from the prompt and the tokens already sent (``request_run.py``: the same
replay as a role switch's migration, token-exact under greedy sampling). A worker whose link is blackholed
breaks nothing: its streams wait for the channel's keepalive, a minute or more, although the health checks took
the worker out within a second or two. So the router tracks which request decodes on which worker, and when a
worker is marked down (a failed health check, or another of its streams failing) it looks again after
``grace_s``: every stream still on a worker that is still down, and silent for the whole grace, is cut here and
fails over. A worker that came back in the meantime keeps its streams, and so does a stream that still
delivers (a slow health probe, not a dead link).

    mark_unhealthy(decode, A) ──► after grace_s: A still down? ──► streams on A silent >= grace_s: cut
                                                       │                 (request_run.py continues each elsewhere)
                                                       └── some spared (not silent): look again after grace_s
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from services.router.errors import RouterError
from services.router.pairing import Assignment, PairingPolicy, Role

log = logging.getLogger(__name__)

#: How a decode stream broke, the label of pdserve_router_decode_failovers_total: its RPC failed (``broken``:
#: UNAVAILABLE, a reset, an internal error), it ended before the request finished (``ended``), or it was cut here
#: because its worker was marked down and the stream went silent (``marked_down``).
FailoverReason = Literal["broken", "ended", "marked_down"]
FAILOVER_REASONS: tuple[FailoverReason, ...] = get_args(FailoverReason)


@dataclass(frozen=True)
class LostDecode:
    """How one request's decode stream broke: what the failover counts and logs, and the error the client gets
    when no decode worker takes the request on."""

    reason: FailoverReason
    detail: str
    error: RouterError


async def next_decode_worker(policy: PairingPolicy, assignment: Assignment, wait_s: float) -> str | None:
    """Move a request whose decode worker broke to another available one (the lost one too, once a health check
    says it is back: restarted), waiting up to ``wait_s`` for one; its address, or None when none came."""
    give_up = time.monotonic() + wait_s
    while (new := policy.move_decode(assignment, allow_same=True)) is None:
        if time.monotonic() >= give_up:
            return None
        await asyncio.sleep(0.2)
    return new


class DecodeStream(Protocol):
    """What the watch needs of one request's decode stream (``request_run.RequestRun``)."""

    last_chunk_s: float  # monotonic time of the last chunk (or of the call's start)

    def lose_decode(self, reason: str) -> None:
        """Cut the stream: its worker is gone; the request fails over."""


class DecodeWatch:
    """The decode streams in flight, by worker; cuts the silent ones of a worker marked down (docstring above)."""

    def __init__(self, policy: PairingPolicy, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not grace_s > 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s!r}")
        self._policy = policy
        self._grace_s = grace_s
        self._clock = clock
        self._streams: dict[str, set[DecodeStream]] = {}
        self._where: dict[DecodeStream, str] = {}
        self._pending: dict[str, asyncio.TimerHandle] = {}
        policy.down_listeners.append(self.worker_down)

    def track(self, stream: DecodeStream, address: str) -> None:
        """``stream`` decodes on ``address`` from now on (a failover's new worker replaces the old)."""
        self.untrack(stream)
        self._where[stream] = address
        self._streams.setdefault(address, set()).add(stream)

    def untrack(self, stream: DecodeStream) -> None:
        address = self._where.pop(stream, None)
        if address is not None:
            streams = self._streams[address]
            streams.discard(stream)
            if not streams:
                del self._streams[address]

    def worker_down(self, role: Role, address: str) -> None:
        """The policy marked a worker unhealthy: look at its streams after the grace (once per grace)."""
        if role != Role.DECODE or address not in self._streams or address in self._pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # marked outside the router's loop (a unit test of the policy): nothing in flight
            return
        self._pending[address] = loop.call_later(self._grace_s, self._check, address)

    def _check(self, address: str) -> None:
        self._pending.pop(address, None)
        worker = self._policy.get(Role.DECODE, address)
        if worker is not None and worker.healthy:
            return  # back within the grace: its streams stay
        reason = (worker.last_error if worker is not None else None) or "removed"
        now, spared = self._clock(), False
        for stream in list(self._streams.get(address, ())):
            if now - stream.last_chunk_s >= self._grace_s:
                log.warning("decode worker %s is down (%s) and a stream on it was silent %.1f s: cutting it",
                            address, reason, now - stream.last_chunk_s)
                self.untrack(stream)
                stream.lose_decode(reason)
            else:
                spared = True
        if spared:
            self.worker_down(Role.DECODE, address)
