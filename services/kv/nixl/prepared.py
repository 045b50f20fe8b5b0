"""A pair of descriptor lists NIXL prepared once (this agent's side and one peer's), read by index.

``prep_xfer_dlist`` does once what ``initialize_xfer`` redoes on every READ (each descriptor checked
against the registrations and resolved for the backend), so a READ from prepared lists is only
``make_prepped_xfer`` with two int32 index arrays. The remote list belongs to one peer: the agent
releases it when that peer is removed or the agent closes, and a READ on released lists fails
(``UnknownPeerError``) instead of reaching NIXL.
"""

from __future__ import annotations

import logging
from typing import Any

from services.kv.nixl.errors import describe

log = logging.getLogger(__name__)


class PreparedLists:
    """The two prepared lists of READs from ``peer``: ``local`` entries of this agent's memory, ``remote``
    entries of the peer's, and their sizes (an index must stay below them)."""

    def __init__(self, peer: str, local: Any, remote: Any, num_local: int, num_remote: int, mem_kind: str,
                 remote_mem_kind: str) -> None:
        self.peer, self.local, self.remote = peer, local, remote
        self.num_local, self.num_remote = num_local, num_remote
        self.mem_kind, self.remote_mem_kind = mem_kind, remote_mem_kind
        self.released = False

    def release(self) -> None:
        """Free both lists in NIXL (the caller holds the agent's lock); idempotent, failures logged."""
        if self.released:
            return
        self.released = True
        for handle in (self.remote, self.local):
            try:
                handle.release()
            except Exception as exc:
                log.warning("releasing prepared descriptor lists of peer %s: %s", self.peer, describe(exc))
