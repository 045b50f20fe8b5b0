"""A pull's KV digest check: what the tickets promise for the tokens it moves, per local rank and group, against
the digest of what arrived.

A digest is a sum of unit digests keyed by token position (``services.kv.digest.scheme``), so a pull of several
consecutive part tickets in one READ expects the sum of each part's units over the tokens it moves: a part's
units before its own first token are 0, and its range is its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import numpy as np

from services.kv.digest.scheme import MASK32, DigestJob, ticket_units, total
from services.kv.plan.staging import StagedRead
from services.kv.ranks.kv_rank import KVRank
from services.kv.reader.errors import KVIntegrityError, TicketError
from services.proto_gen.pdserve.v1 import kv_pb2

#: Per local rank, its digest jobs, each with the digest the tickets promise (None: only fault injection runs).
DigestJobs = list[list[tuple[DigestJob, int | None]]]


def digest_jobs(parts: Sequence[kv_pb2.TransferTicket], ranks: Sequence[KVRank], starts: dict[int, int],
                local_ids: Sequence[np.ndarray], digest_on: bool, corrupt: bool) -> DigestJobs:
    """The digest jobs covering every token a pull of ``parts`` moves (from each group's ``starts`` to the last
    part's end), with what the parts promise for them. Checked before any READ: a ticket without a usable digest
    is refused like any other that does not fit."""
    n = parts[-1].num_tokens
    entries = [{(e.group_id, e.reader_rank): e for e in p.digests} for p in parts]
    jobs = []
    for q, rank in enumerate(ranks):
        rank_jobs = []
        for g, start in starts.items():
            if start >= n:
                continue  # every token of the group was in this reader's prefix cache
            bs = rank.layout.block_size(g)
            unit = _unit(entries[-1].get((g, q)), bs)
            expected = _expected(parts, entries, g, q, bs, unit, start) if digest_on else None
            rank_jobs.append((DigestJob(g, local_ids[g], start, n, unit, 0, rank.layout.kv_heads(g), 0,
                                        corrupt=corrupt), expected))
        jobs.append(rank_jobs)
    return jobs


def _unit(entry: kv_pb2.GroupDigests | None, block_size: int) -> int:
    return entry.unit if entry is not None and entry.unit else block_size


def _expected(parts: Sequence[kv_pb2.TransferTicket], entries: list[dict], group: int, reader_rank: int,
              block_size: int, unit: int, start: int) -> int:
    """The sum the parts promise for group ``group`` on reading rank ``reader_rank`` over tokens ``start ..`` the
    last part's end: each part's units over its own tokens past ``start``. All parts share one ``unit``."""
    expected = 0
    for part, by_key in zip(parts, entries, strict=True):
        entry = by_key.get((group, reader_rank))
        begin = max(start, part.part_start_token)
        usable = entry is not None and _unit(entry, block_size) == unit and start % unit == begin % unit == 0 and \
            not (block_size % unit and unit % block_size) and len(entry.digests) == -(-part.num_tokens // unit)
        if not usable:
            raise TicketError(f"ticket for request {part.request_id!r} has no usable KV digest of group {group} for "
                              f"reading rank {reader_rank} from token {begin} (unit {unit}, local block {block_size})",
                              reason="digest")
        if begin < part.num_tokens:
            expected += ticket_units(entry.digests, unit, begin, part.num_tokens)
    return expected & MASK32


async def check_digests(ticket: kv_pb2.TransferTicket, ranks: Sequence[KVRank], jobs: DigestJobs,
                        spans: Sequence[tuple[KVRank, StagedRead]] = ()) -> None:
    """Digest every pulled token on every local rank (where the KV now is) and compare with what the tickets
    promised; KVIntegrityError names the groups that differ. ``spans`` (a dequantizing reader's, one per rank): the
    FP8 bytes are in each rank's staging area, not yet in its blocks, and digested there."""
    def run(q: int, rank: KVRank, rank_jobs: list[DigestJob]):  # noqa: ANN202 - the rank's digest coroutine
        if not spans:
            return rank.digest(rank_jobs)
        read = spans[q][1]
        offset, ids = read.scatter
        layout = dataclasses.replace(rank.layout, dtype=read.convert.dtype)
        return rank.span_digest(layout, offset, [len(i) for i in ids], rank_jobs)

    answers = await asyncio.gather(*(run(q, rank, [job for job, _ in rank_jobs])
                                     for q, (rank, rank_jobs) in enumerate(zip(ranks, jobs, strict=True))))
    bad = sorted({job.group_id for rank_jobs, got in zip(jobs, answers, strict=True)
                  for (job, expected), units in zip(rank_jobs, got, strict=True)
                  if expected is not None and total(units) != expected})
    if bad:
        raise KVIntegrityError(f"request {ticket.request_id!r}: the KV pulled from engine {ticket.engine_id} "
                               f"does not match the ticket's digest in KV group(s) {bad}", bad)
