"""A ticket against its owner's handshake, before anything is planned from it: signed by the owner's epoch key,
parts read together consecutive, every group named once with enough block ids inside the owner's blocks (its host
tier's for a host-tier part, which must end on a block boundary), and the reader's own ids inside its blocks.

Descriptors are only ever computed from the layout specs and ids checked here, so a forged ticket cannot point a
READ outside the owner's registered KV buffers or the reader's own blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from services.kv.reader.errors import TicketError
from services.kv.spec.description import EngineDescription
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.wire import ticket_is_signed_by
from services.proto_gen.pdserve.v1 import kv_pb2


class TicketBlocks(NamedTuple):
    """A checked ticket's block ids per group: the owner's device blocks, its host tier's (None: the ticket reads
    none) and the reader's own."""

    device: list[np.ndarray]
    host: list[np.ndarray] | None
    local: list[np.ndarray]


def check_signed(parts: Sequence[kv_pb2.TransferTicket], remote: EngineDescription) -> None:
    """Each ticket carries the owner's signature (HMAC under its epoch's key, from the handshake)."""
    for part in parts:
        if not ticket_is_signed_by(part, remote.ticket_key):
            # Not issued by that engine as it is (forged, altered in transit, or from a peer too old to sign):
            # the blocks it names need not be this request's.
            raise TicketError(f"ticket for request {part.request_id!r} is not signed by engine "
                              f"{part.engine_id} (epoch {part.epoch})", reason="signature")


def check_consecutive(parts: Sequence[kv_pb2.TransferTicket]) -> None:
    """Part tickets read in one pull: one request's, from one owner, each starting where the one before ended,
    and none with a host-tier prefix (its READ from the host tier is a pull of its own)."""
    first = parts[0]
    for before, part in zip(parts, parts[1:], strict=False):
        if (part.engine_id, part.epoch, part.request_id, part.num_prompt_tokens) != \
                (first.engine_id, first.epoch, first.request_id, first.num_prompt_tokens) or \
                part.part_start_token != before.num_tokens or not part.num_prompt_tokens:
            raise ValueError(f"tickets of tokens {before.part_start_token}..{before.num_tokens} and "
                             f"{part.part_start_token}..{part.num_tokens} are not consecutive parts of one request")
    if any(p.num_host_tokens for p in parts):
        raise ValueError("a part ticket that reads the owner's host tier is pulled on its own")


def check_ticket(ticket: kv_pb2.TransferTicket, remote: EngineDescription, local: KVLayoutSpec,
                 local_block_ids: Sequence[Sequence[int]]) -> TicketBlocks:
    """The ticket's and the reader's (``local``'s) block ids per group, as arrays, after checking them against
    the owner's handshake and this engine.

    Every id must be inside the owner's blocks, placeholders included (they are never read but
    a forged id is refused all the same); repeats are only refused where a transfer reads them
    (``map_blocks``), since a sliding group's out-of-window placeholders may repeat.
    """
    if len(local_block_ids) != len(remote.groups):
        raise TicketError(f"{len(local_block_ids)} local block tables for {len(remote.groups)} KV groups")
    owner = remote.ranks[0]
    device_ids = _ticket_groups(ticket.groups, remote, owner.layout.num_blocks, ticket.num_tokens, "")
    host_ids = None
    if ticket.num_host_tokens or ticket.host_groups:
        host_ids = _host_tier_ids(ticket, remote)
    local_ids = [np.asarray(ids) for ids in local_block_ids]  # map_block_arrays refuses non-integers
    if not all(_inside(ids, local.num_blocks) for ids in local_ids):
        raise TicketError(f"local block ids fall outside this engine's {local.num_blocks} blocks")
    return TicketBlocks(device_ids, host_ids, local_ids)


def _host_tier_ids(ticket: kv_pb2.TransferTicket, remote: EngineDescription) -> list[np.ndarray]:
    """A host-tier part's block ids: the owner has a host tier, the part is the prompt's first whole blocks."""
    host_layout = remote.ranks[0].host_layout
    if host_layout is None:
        raise TicketError(f"ticket names host-tier blocks, engine {remote.engine_id} has no host tier")
    if not 0 < ticket.num_host_tokens <= ticket.num_tokens:
        raise TicketError(f"ticket reads {ticket.num_host_tokens} tokens from the host tier of a "
                          f"{ticket.num_tokens}-token prompt")
    if any(ticket.num_host_tokens % g.block_size for g in remote.groups):
        raise TicketError(f"ticket's host-tier part ({ticket.num_host_tokens} tokens) ends inside a block")
    return _ticket_groups(ticket.host_groups, remote, host_layout.num_blocks, ticket.num_host_tokens, "host-tier ")


def _ticket_groups(groups: Sequence[kv_pb2.GroupBlocks], remote: EngineDescription, num_blocks: int,
                   num_tokens: int, what: str) -> list[np.ndarray]:
    """A ticket's block ids per group, checked: every group once, ids inside the owner's blocks,
    enough of them for ``num_tokens``."""
    by_group: dict[int, np.ndarray] = {}
    for g in groups:
        if g.group_id in by_group:
            raise TicketError(f"ticket names {what}KV group {g.group_id} twice")
        by_group[g.group_id] = np.asarray(g.block_ids, dtype=np.int64)
    if sorted(by_group) != [g.group_id for g in remote.groups]:
        raise TicketError(f"ticket names {what}KV groups {sorted(by_group)}, the engine has "
                          f"{[g.group_id for g in remote.groups]}")
    for g in remote.groups:
        ids = by_group[g.group_id]
        if not _inside(ids, num_blocks):
            raise TicketError(f"ticket {what}block ids for {g.label} fall outside the owner's {num_blocks} blocks")
        if len(ids) * g.block_size < num_tokens:
            raise TicketError(f"ticket holds {len(ids)} {what}blocks of {g.block_size} for {num_tokens} tokens "
                              f"in {g.label}")
    return [by_group[g.group_id] for g in remote.groups]


def _inside(ids: np.ndarray, num_blocks: int) -> bool:
    return ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < num_blocks)
