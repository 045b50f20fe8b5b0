"""A pull's token runs per KV group (the "pieces" stage): which of the prompt's tokens it moves, as block pieces
(``map_block_arrays``, for the planner) or unit indices (``map_unit_arrays``, for prepared lists).

Each group starts after the reader's cached prefix (whole local blocks of that group) or, for a sliding-window
group, at the window's start (``window_start_token``), whichever is later; a host-tier ticket's first
``num_host_tokens`` come from the owner's host tier, the rest from its device blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from services.kv.reader.ticket_shape import TicketBlocks
from services.kv.spec.description import EngineDescription
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.topology import map_block_arrays, map_unit_arrays, window_start_token
from services.proto_gen.pdserve.v1 import kv_pb2

#: Per source (the owner's host tier: True, its device blocks: False), per group, a mapper's answer.
SourceMap = dict[bool, dict[int, Any]]


def window_prompt_tokens(ticket: kv_pb2.TransferTicket) -> int:
    """The prompt length sliding windows are clipped for: a part ticket's whole prompt, else its own tokens."""
    return max(ticket.num_prompt_tokens, ticket.num_tokens)


def group_starts(remote: EngineDescription, local: KVLayoutSpec, num_tokens: int, num_cached_tokens: int
                 ) -> dict[int, int]:
    """Per group, the first token a pull moves: after the reader's cached prefix (whole local blocks of
    that group) or, for a sliding group, the window's start, whichever is later."""
    return {lg.group_id: max(num_cached_tokens - num_cached_tokens % lg.block_size,
                             window_start_token(rg, lg, num_tokens))
            for rg, lg in zip(remote.groups, local.groups, strict=True)}


def group_pieces(remote: EngineDescription, local: KVLayoutSpec, num_tokens: int, remote_ids: list[np.ndarray],
                 local_ids: Sequence[np.ndarray], num_cached_tokens: int, begin: int = 0, end: int | None = None,
                 window_end: int | None = None, mapper: Callable = map_block_arrays) -> dict[int, Any]:
    """Token runs per group (``map_block_arrays``, or another ``mapper`` of the same arguments) of the
    prompt's tokens ``begin .. end``: from the reader's cached prefix (whole local blocks of that group)
    or, for a sliding group, the window's start (of a prompt of ``window_end`` tokens: a part ticket's
    whole prompt), whichever is later; to ``end`` (the prompt's end by default)."""
    end = num_tokens if end is None else end
    starts = group_starts(remote, local, window_end or num_tokens, num_cached_tokens)
    out = {}
    for rg, lg in zip(remote.groups, local.groups, strict=True):
        start = min(max(starts[lg.group_id], begin), end)
        out[lg.group_id] = mapper(remote_ids[rg.group_id], rg.block_size, local_ids[lg.group_id], lg.block_size,
                                  end, start)
    return out


def source_maps(ticket: kv_pb2.TransferTicket, remote: EngineDescription, local: KVLayoutSpec, blocks: TicketBlocks,
                num_cached_tokens: int, units: bool, runs: bool) -> tuple[SourceMap, SourceMap]:
    """(unit indices, token runs) per source and group, each only when wanted (``units``: a READ has prepared
    lists; ``runs``: one is planned). Every local rank shares the block tables, so they are the same for all of
    them. The host tier holds the prompt's first ``num_host_tokens``, the device blocks the rest."""
    if blocks.host is None:
        spans = {False: (blocks.device, 0, None)}
    else:
        spans = {True: (blocks.host, 0, ticket.num_host_tokens), False: (blocks.device, ticket.num_host_tokens, None)}
    window = window_prompt_tokens(ticket)
    maps: list[SourceMap] = [{}, {}]
    for i, (wanted, mapper) in enumerate(((units, map_unit_arrays), (runs, map_block_arrays))):
        if wanted:
            maps[i] = {host: group_pieces(remote, local, ticket.num_tokens, ids, blocks.local, num_cached_tokens,
                                          begin=begin, end=end, window_end=window, mapper=mapper)
                       for host, (ids, begin, end) in spans.items()}
    return maps[0], maps[1]
