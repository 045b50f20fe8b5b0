"""One posted READ (:class:`TransferHandle`) and what a finished one moved (:class:`TransferResult`).

A handle asks its agent for NIXL's state and to abort, through :class:`HandleOwner`, so this module
does not depend on the agent that creates handles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from services.kv.nixl.errors import TransferError


@dataclass(frozen=True)
class TransferResult:
    """What one finished READ moved, and how long it took from its post."""

    num_bytes: int
    num_descriptors: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class HandleOwner(Protocol):
    """What a handle needs from the agent that posted it (``TransferAgent``)."""

    def _poll_xfer(self, handle: TransferHandle) -> None: ...

    def _abort(self, handle: TransferHandle) -> bool: ...


class TransferHandle:
    """One posted READ. ``poll()`` until "DONE"; NIXL resources are released on every outcome."""

    def __init__(self, agent: HandleOwner, xfer: Any, peer: str, num_descriptors: int, num_bytes: int,
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
        if self._state == "PROC":
            self._agent._poll_xfer(self)
        if self._state == "DONE":
            return "DONE"
        if self._state == "PROC":
            return "PROC"
        if self._error is None:
            self._error = self._make_error(f"transfer was {self._state.lower()}", self._state)
        raise self._error

    def result(self) -> TransferResult:
        if self._state != "DONE" or self._finished_at is None:
            raise TransferError(f"transfer not complete (state {self._state})", peer=self.peer)
        return TransferResult(self.num_bytes, self.num_descriptors, self._finished_at - self.started_at)

    def abort(self) -> bool:
        """Cancel if still in flight; True when nothing is left in flight (see TransferTimeout)."""
        if self._state != "PROC":
            return True
        return self._agent._abort(self)

    def _settle(self, state: str | None, failure: str) -> None:
        """Record NIXL's answer (under the agent lock); the agent has already released the request if it
        is terminal."""
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
