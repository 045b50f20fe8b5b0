"""What a pull raises when a ticket, or the KV it brought, is not what the owner signed."""

from __future__ import annotations

from collections.abc import Sequence

from services.kv.nixl.errors import TransferError


class TicketError(ValueError):
    """The ticket does not fit the owner's engine (forged, truncated or from another model), or may not be read
    (``reader.tickets``: of another prompt, past its lease, pulled before).

    ``reason`` names the check that refused it, for the refusal counter (``services.common.metrics``
    ``TICKET_REFUSALS``).
    """

    def __init__(self, message: str, reason: str = "mismatch") -> None:
        super().__init__(message)
        self.reason = reason


class KVIntegrityError(TransferError):
    """The pulled KV does not match the ticket's digest: the bytes that arrived are not the ones the
    owner computed. ``groups``: the KV groups that differ (on any reading rank)."""

    def __init__(self, message: str, groups: Sequence[int]) -> None:
        super().__init__(message)
        self.groups = tuple(groups)
