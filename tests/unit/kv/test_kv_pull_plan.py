"""A pull's modes are data: the plan its check and plan steps build (``PullPlan``) for a ticket read from blocks or
from its staged span, with a host-tier part, with earlier parts, digest on and off (no NIXL: nothing is read)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from bench.kv_synthetic import identity_for, layout_for
from services.kv.reader.puller import KVPuller
from services.kv.reader.stage_clock import StageClock
from services.kv.spec.compat import DIGEST_OFF, DIGEST_SCHEME, CompatInfo
from services.kv.spec.description import EngineDescription, RankExport
from services.kv.spec.wire import MemoryRegion, ticket_signature
from services.proto_gen.pdserve.v1 import kv_pb2

CFG = dict(kind="cross_layer", order="NHD", num_blocks=24, num_kv_heads=2, head_dim=8, dtype="float16",
           num_layers=2, block_size=4, seed=1)
KEY = b"epoch key"


def _regions(layout, base: int) -> tuple[MemoryRegion, ...]:
    return tuple(MemoryRegion(b.index, base + 10**9 * b.index, b.num_bytes, 0, "DRAM") for b in layout.buffers())


def _pair(digest: str = DIGEST_OFF) -> tuple[KVPuller, EngineDescription]:
    layout = layout_for(CFG, 1)
    identity = identity_for({**CFG, "kv_digest": digest}, layout)
    host_layout = dataclasses.replace(layout, num_blocks=40)
    owner = RankExport(0, "owner-tp0", b"", _regions(layout, 1 << 40), layout, host_layout,
                       _regions(host_layout, 1 << 44), staging_region=MemoryRegion(0, 1 << 46, 1 << 20, 0, "DRAM"))
    remote = EngineDescription("owner", 1, "m", 2, 2, 8, CompatInfo.of_identity(identity), layout.groups, (owner,),
                               ticket_key=KEY)
    local = SimpleNamespace(layout=layout, regions=_regions(layout, 1 << 48), staging=None)
    return KVPuller(engine_id="reader", identity=identity, ranks=[local], check_tickets=False), remote


def _ticket(num_tokens: int, start: int = 0, host: int = 0, staged: bool = False, digests: bool = False,
            prompt: int = 0) -> kv_pb2.TransferTicket:
    t = kv_pb2.TransferTicket(engine_id="owner", epoch=1, request_id="r", num_tokens=num_tokens,
                              notify_nonce=f"n{start}", part_start_token=start, num_prompt_tokens=prompt,
                              num_host_tokens=host, staged_offsets=[0] if staged else [])
    t.groups.add(group_id=0, block_ids=list(range(10, 10 + -(-num_tokens // 4))))
    if host:
        t.host_groups.add(group_id=0, block_ids=list(range(host // 4)))
    if digests:
        t.digests.add(group_id=0, reader_rank=0, unit=4, digests=[0] * -(-num_tokens // 4))
    t.signature = ticket_signature(t, KEY)
    return t


def _plan(puller: KVPuller, remote: EngineDescription, *parts: kv_pb2.TransferTicket, cached: int = 0):
    checked = puller._check(parts, remote, [list(range(8))], cached, None)
    return puller._planner.plan(checked, remote, False, StageClock())


def _host_tier(plan) -> bool:  # noqa: ANN001 - a PullPlan
    return any(r.host_tier for r in plan.reads)


def test_the_plan_of_each_mode() -> None:
    puller, remote = _pair()
    blocks = _plan(puller, remote, _ticket(22))
    assert (blocks.staged, _host_tier(blocks), blocks.spans, blocks.notices) == (False, False, (), ())
    assert blocks.digest_jobs is None and blocks.state_digest is None and len(blocks.reads) == 1
    staged = _plan(puller, remote, _ticket(22, staged=True))
    assert staged.staged and [rank for rank, _ in staged.spans] == [staged.reads[0].rank]
    assert staged.reads[0].num_bytes == blocks.reads[0].num_bytes  # the same blocks' bytes, from the span
    host = _plan(puller, remote, _ticket(22, host=16, staged=True))  # a host-tier part reads the blocks
    assert not host.staged and _host_tier(host) and [r.host_tier for r in host.reads] == [True, False]
    first, second = _ticket(8, prompt=22), _ticket(22, start=8, prompt=22)
    parts = _plan(puller, remote, first, second)
    assert [(r.num_bytes, part) for r, part in parts.notices] == [(0, first)] and parts.reads[0].num_bytes > 0
    puller, remote = _pair(digest=DIGEST_SCHEME)
    digested = _plan(puller, remote, _ticket(22, digests=True), cached=8)
    ((job, expected),) = digested.digest_jobs[0]  # the one rank's one group, from its cached prefix
    assert (job.group_id, job.start, expected) == (0, 8, 0)
