"""A pull's READ step: post its plan's READs (every local rank at once), then the earlier parts' notifications,
each READ's stages (``TransferAgent.read``'s, through ``read_stages``) kept with what it moved."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from services.kv.nixl.agent import read_stages
from services.kv.reader.pull_plan import PullPlan
from services.kv.reader.read_targets import PlannedRead
from services.kv.spec.wire import notification_key
from services.proto_gen.pdserve.v1 import kv_pb2


class ReadDone(NamedTuple):
    """What one READ moved, and its stages (``read_stages``: submit, prepare, post, complete, wake...)."""

    num_bytes: int
    num_descriptors: int
    stages: dict[str, float]


async def post_reads(plan: PullPlan, timeout_s: float) -> list[ReadDone]:
    """Every READ of ``plan`` under the ticket's notification, then its notices; what each READ moved, in order."""
    if len(plan.reads) == 1:  # no task to create and schedule for the one READ of a TP-1 pair
        done = [await post_read(plan.reads[0], plan.ticket, timeout_s)]
    else:
        done = await asyncio.gather(*(post_read(read, plan.ticket, timeout_s) for read in plan.reads))
    if plan.notices:  # each earlier part's readers notify its own key, with nothing left to read
        await asyncio.gather(*(post_read(read, part, timeout_s) for read, part in plan.notices))
    return list(done)


async def post_read(read: PlannedRead, ticket: kv_pb2.TransferTicket, timeout_s: float) -> ReadDone:
    """One READ from one owner rank under ``ticket``'s notification (or, when everything was local, only the
    notification)."""
    owner = read.owner
    notify = notification_key(ticket.request_id, read.host_tier, ticket.notify_nonce)
    sub: dict[str, float] = {}
    token = read_stages.set(sub)  # the agent's READ adds its stages here
    kind = (owner.host_regions if read.host_tier else owner.regions)[0].kind
    try:
        if read.lists is None:
            got = await read.rank.read(owner.agent_metadata, read.local_rows, read.remote_rows, notify, kind,
                                       timeout_s)
        elif not read.local_rows.size:  # everything was local: only the notification
            await read.rank.agent.notify(read.lists.peer, notify)  # off the loop while READs stream
            got = (0, 0)
        else:
            result = await read.rank.agent.read_prepared(
                read.lists, read.local_rows, read.remote_rows, notify, num_bytes=read.num_bytes,
                num_descriptors=read.num_descriptors, timeout_s=timeout_s)
            got = (result.num_bytes, result.num_descriptors)
    finally:
        read_stages.reset(token)
    return ReadDone(got[0], got[1], sub)
