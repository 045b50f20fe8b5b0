"""A pull's per-request state (Mamba2 layers): which slot a ticket names, its runs as READ rows, its digest.

The state rides with the KV: a whole ticket or a part ticket's last part names the owner's slot, and each device
READ of a (local rank, owner rank) pair carries that pair's state runs (``state_runs``) after its KV rows. The
reader then digests each local rank's runs, keyed by where they land in its slot, against the ticket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.kv.plan.state_runs import StateRun, state_runs
from services.kv.ranks.kv_rank import KVRank
from services.kv.reader.errors import KVIntegrityError, TicketError
from services.kv.spec.compat import KVIdentity
from services.kv.spec.description import EngineDescription, RankExport
from services.kv.spec.groups import StateGroupSpec
from services.proto_gen.pdserve.v1 import kv_pb2


@dataclass(frozen=True)
class StateRead:
    """A pull's state: the owner's and this engine's state groups (their TP sizes), and the two slots."""

    owner: StateGroupSpec
    local: StateGroupSpec
    owner_slot: int
    local_slot: int

    def runs(self, owner_rank: int, local_rank: int) -> tuple[StateRun, ...]:
        return state_runs(self.owner, owner_rank, self.local, local_rank)

    def rows(self, owner: RankExport, rank: KVRank, local_rank: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """(remote rows, local rows, bytes) of the runs local rank ``local_rank`` (``rank``) reads from ``owner``,
        in the planner's row form [address, length, device]; None when that owner rank holds none of its state."""
        runs = self.runs(owner.tp_rank, local_rank)
        if not runs:
            return None
        theirs, ours = owner.state_region, rank.state_region
        src = theirs.address + self.owner_slot * self.owner.slot_bytes
        dst = ours.address + self.local_slot * self.local.slot_bytes
        remote_rows = np.array([[src + x.src, x.length, theirs.device_id] for x in runs], dtype=np.uint64)
        local_rows = np.array([[dst + x.dst, x.length, ours.device_id] for x in runs], dtype=np.uint64)
        return remote_rows, local_rows, sum(x.length for x in runs)


def check_state_ticket(ticket: kv_pb2.TransferTicket, remote: EngineDescription, identity: KVIdentity,
                       ranks: Sequence[KVRank], local_state_slot: int | None) -> StateRead | None:
    """What a ticket carrying the state reads (None: none); a TicketError for a slot out of range, a digest missing,
    or the state missing where it belongs (a whole ticket or last part) or present where it does not."""
    spec = identity.state
    last = not ticket.num_prompt_tokens or ticket.num_tokens == ticket.num_prompt_tokens
    if spec is None or not (last and ticket.num_tokens):
        if ticket.has_state:
            raise TicketError(f"ticket for request {ticket.request_id!r} names a state slot "
                              + ("on a part before the last" if spec else "for a model without state layers"))
        return None
    if not ticket.has_state:
        raise TicketError(f"ticket for request {ticket.request_id!r} carries no state of its {spec.label}",
                          reason="state")
    if ticket.state_slot >= remote.num_state_slots:
        raise TicketError(f"ticket's state slot {ticket.state_slot} is outside the owner's "
                          f"{remote.num_state_slots} slots")
    num_local = ranks[0].state_region.length // spec.slot_bytes
    if local_state_slot is None or not 0 <= local_state_slot < num_local:
        raise TicketError(f"local state slot {local_state_slot} is outside this engine's {num_local} slots")
    if identity.digest_on and len(ticket.state_digests) != len(ranks):
        raise TicketError(f"ticket for request {ticket.request_id!r} has {len(ticket.state_digests)} state "
                          f"digests for {len(ranks)} reading ranks", reason="digest")
    return StateRead(remote.state, spec, ticket.state_slot, local_state_slot)


async def check_state_digest(ticket: kv_pb2.TransferTicket, ranks: Sequence[KVRank], state: StateRead) -> None:
    """Each local rank digests the state runs it read (keyed by their place in its slot) against the ticket."""
    got = await asyncio.gather(*(
        rank.state_digest(state.local_slot, [(x.dst, x.length, x.dst) for r in range(state.owner.tp_size)
                                             for x in state.runs(r, q)])
        for q, rank in enumerate(ranks)))
    bad = [q for q, d in enumerate(got) if d != ticket.state_digests[q]]
    if bad:
        raise KVIntegrityError(f"request {ticket.request_id!r}: the state pulled from engine {ticket.engine_id} "
                               f"does not match the ticket's state digest on reading rank(s) {bad}", [])
