"""What a NIXL transfer raises: one error type the caller can catch, and its two refinements."""

from __future__ import annotations

from typing import Any


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


def describe(exc: BaseException) -> str:
    """An exception NIXL raised, as it goes into a message: its type and text."""
    return f"{type(exc).__name__}: {exc}"
