"""A ticket's digests, computed on every owner rank where the KV lives: per (group, reading rank) of its KV, per
reading rank of its state slot (``services.kv.digest.scheme``).

A reader checks what it read against the digest of exactly what it reads, so the jobs follow the planner's own
mapping of heads to ranks (``group_rank_reads``) and of state runs to slots (``state_runs``); each owner rank
adds its share, and the sums are taken mod 2**32.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence

import numpy as np

from services.kv.digest.scheme import MASK32, DigestJob
from services.kv.owner.hand_out import HandOutPlan
from services.kv.plan.state_runs import state_runs
from services.kv.ranks.kv_rank import KVRank
from services.kv.spec.groups import StateGroupSpec
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.topology import group_rank_reads
from services.proto_gen.pdserve.v1 import kv_pb2

# per owner rank: (group, reading rank, job) of every digest that rank computes
_RankJobs = list[list[tuple[int, int, DigestJob]]]


#: A quantized staged span to digest instead of the blocks: (its layout, blocks per group, offset per owner rank).
SpanOnRanks = tuple[KVLayoutSpec, tuple[int, ...], Mapping[int, int]]


async def kv_digests(ranks: Sequence[KVRank], group_heads: Mapping[int, int],
                     plan: HandOutPlan, span: SpanOnRanks | None = None) -> list[kv_pb2.GroupDigests]:
    """Per (group, reading rank): unit digests from token 0 (0 before ``part_start_token``: a part's), each owner
    rank adding the heads that reader reads from it, every rank at once. Sliding groups from the window of the
    whole prompt; ``reader_block_size`` (0: this engine's) sets the unit, the largest that divides both block sizes.
    ``span``: the bytes a READ returns are the ranks' staged (quantized) spans, so those are digested."""
    layout = ranks[0].layout
    units = {g.group_id: math.gcd(g.block_size, plan.reader_block_size or g.block_size) for g in layout.groups}
    jobs = _digest_jobs(ranks, group_heads, plan, units)

    def run(index: int, rank_jobs: list[DigestJob]):  # noqa: ANN202 - the rank's digest coroutine
        if span is None:
            return ranks[index].digest(rank_jobs)
        return ranks[index].span_digest(span[0], span[2][index], span[1], rank_jobs)

    answers = await asyncio.gather(*(run(i, [j for _, _, j in rank_jobs])
                                     for i, rank_jobs in enumerate(jobs) if rank_jobs))
    sums = {(g, r): np.zeros(-(-plan.num_tokens // units[g]), dtype=np.uint64)
            for g in units for r in range(plan.reader_tp_size)}
    for rank_jobs, rank_units in zip([j for j in jobs if j], answers, strict=True):
        for (g, reader, job), got in zip(rank_jobs, rank_units, strict=True):
            first = job.start // job.unit
            sums[g, reader][first:first + len(got)] += got  # each < 2**32: no uint64 wrap
    return [kv_pb2.GroupDigests(group_id=g, reader_rank=r, unit=units[g], digests=(d & MASK32).tolist())
            for (g, r), d in sorted(sums.items())]


def _digest_jobs(ranks: Sequence[KVRank], group_heads: Mapping[int, int], plan: HandOutPlan,
                 units: dict[int, int]) -> _RankJobs:
    """Each owner rank's jobs: per reading rank and group it serves, one per source (host tier, then device)
    holding tokens the reader keeps (past the window's start and the part's)."""
    layout = ranks[0].layout
    begin, num_host_tokens, num_tokens = plan.part_start_token, plan.num_host_tokens, plan.num_tokens
    jobs: _RankJobs = [[] for _ in ranks]
    device_ids = [np.asarray(ids, dtype=np.int64) for ids in plan.block_ids]  # once, for every job that reads them
    host_ids = [np.asarray(ids, dtype=np.int64) for ids in plan.host_block_ids] if num_host_tokens else []
    for reader in range(plan.reader_tp_size):
        reads = group_rank_reads(plan.reader_tp_size, reader, len(ranks), group_heads)
        for owner, by_group in reads.items():
            for g, read in by_group.items():
                group = layout.groups[g]
                first_kept = max(group.first_needed_block(plan.whole) * group.block_size, begin)
                spans = [(True, host_ids[g] if num_host_tokens else (), 0, num_host_tokens),
                         (False, device_ids[g], num_host_tokens, num_tokens)]
                for host, ids, span_start, span_end in spans:
                    start = max(span_start, first_kept)
                    if start < span_end:
                        jobs[owner].append((g, reader, DigestJob(
                            g, ids, start, span_end, units[g], *read.remote_heads, read.local_heads[0],
                            host_tier=host)))
    return jobs


async def state_digests(ranks: Sequence[KVRank], spec: StateGroupSpec, plan: HandOutPlan) -> list[int]:
    """Per reading rank, the digest of the state runs it reads of the ticket's slot (``state_runs``), each owner
    rank digesting its own runs keyed by their place in that reader's slot; the sums mod 2**32."""
    slot, reader_tp_size = plan.state_slot, plan.reader_tp_size
    reader = spec.with_tp(reader_tp_size)
    jobs = [(q, rank.state_digest(slot, [(x.src, x.length, x.dst) for x in runs]))
            for q in range(reader_tp_size) for r, rank in enumerate(ranks)
            if (runs := state_runs(spec, r, reader, q))]
    sums = [0] * reader_tp_size
    for (q, _), got in zip(jobs, await asyncio.gather(*(job for _, job in jobs)), strict=True):
        sums[q] += got
    return [d & MASK32 for d in sums]
