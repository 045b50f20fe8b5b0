"""KV staging end to end: an owner process gathers a ticket's scattered blocks into its registered staging
area, this process reads the span over real NIXL (into its own area, then scattered, or straight into its
blocks) and every byte lands where the colocated KV has it; the owner frees its span once read or abandoned.
``PDSERVE_TEST_DEVICE=cuda`` puts both sides' KV and staging areas on the GPU (gathers and scatters on the side
stream, READs over cuda_ipc).
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import torch

from bench.kv_synthetic import identity_for, layout_for
from services.engine.kv_cache.buffers import KVCache
from services.kv.nixl.agent import TransferAgent
from services.kv.owner.exporter import KVExporter
from services.kv.ranks.kv_rank import LocalKVRank
from services.kv.reader.errors import TicketError
from services.kv.spec.wire import prompt_hash
from tests.integration.test_kv_transfer import (
    BASE,
    SENTINEL,
    _resigned,
    check_received,
    owner_process,
    reader,
)

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
AREA = 1 << 20
NUM_TOKENS = 29  # 8 blocks of 4, the last partial
FRAGMENTED = list(range(1, 17, 2))  # no two adjacent
PROMPT_HASH = prompt_hash(range(NUM_TOKENS))
CASES = {  # name: (layout overrides, TP size on both sides)
    "cross_layer": ({"kind": "cross_layer"}, 1),
    "per_layer": ({}, 1),
    "cross_layer-tp-2": ({"kind": "cross_layer"}, 2),
}


def owner_cfg(name: str, over: dict, tp: int) -> dict:
    return {**BASE, **over, "engine_id": f"owner-staged-{name}", "tp": tp, "reader_tp": tp, "staging_bytes": AREA,
            "device": DEVICE,
            "reader_block_size": BASE["block_size"],
            "requests": [{"request_id": "frag", "num_tokens": NUM_TOKENS, "block_ids": [FRAGMENTED]},
                         {"request_id": "held", "num_tokens": NUM_TOKENS, "block_ids": [FRAGMENTED[::-1]]},
                         {"request_id": "direct", "num_tokens": NUM_TOKENS, "block_ids": [FRAGMENTED]},
                         {"request_id": "contiguous", "num_tokens": NUM_TOKENS, "block_ids": [list(range(8, 16))]}]}


def wait_release(owner, request_id: str) -> dict:  # noqa: ANN001
    while True:
        msg = owner.lines.get(timeout=10)
        if msg.get("released") == request_id:
            return msg


@pytest.mark.parametrize("case", list(CASES))
def test_scattered_blocks_are_read_from_the_owner_staging_span(case: str) -> None:
    over, tp = CASES[case]
    cfg = owner_cfg(case, over, tp)
    reader_cfg = {**BASE, **over}
    local_ids = list(range(22, 6, -2))  # no two adjacent on this side either
    with owner_process(cfg) as owner, reader(reader_cfg, tp, staging_bytes=AREA, device=DEVICE) as r:
        assert all(len(t.staged_offsets) == tp for rid, t in owner.tickets.items() if rid != "contiguous")
        assert not owner.tickets["contiguous"].staged_offsets  # one run: nothing to gain
        # Into this side's staging area, then scattered: one descriptor per rank (the span's rows merge).
        result = asyncio.run(r.puller.pull(owner.tickets["frag"], [local_ids]))
        check_received(cfg, r, owner.tickets["frag"], [local_ids], [0])
        assert result.staged and result.num_reads == tp and result.num_descriptors == tp
        assert all(q.staging.free_bytes == AREA for q in r.ranks)  # the reader's spans are back
        # A held prefix: only the staged blocks after it are read.
        for c in r.caches:
            for b in c.buffers:
                b.fill_(SENTINEL)
        held = asyncio.run(r.puller.pull(owner.tickets["held"], [local_ids], num_cached_tokens=12))
        check_received(cfg, r, owner.tickets["held"], [local_ids], [12])
        assert held.staged and held.num_bytes == result.num_bytes * 5 // 8
        # Without room on this side: straight from the owner's span into the blocks, a descriptor per run.
        for q in r.ranks:
            assert q.staging.alloc(AREA) == 0
        direct = asyncio.run(r.puller.pull(owner.tickets["direct"], [local_ids]))
        check_received(cfg, r, owner.tickets["direct"], [local_ids], [0])
        planes = sum(b.num_planes for b in layout_for(reader_cfg, tp).buffers())
        assert direct.staged and direct.num_descriptors == tp * 8 * planes
        unstaged = asyncio.run(r.puller.pull(owner.tickets["contiguous"], [local_ids]))
        assert not unstaged.staged
        last = [wait_release(owner, rid) for rid in ("frag", "held", "direct", "contiguous")][-1]
        assert last["staged"] == 3 and last["staging_free"] == [AREA] * tp  # every read span freed by the owner


def test_owner_frees_each_span_once_read_and_on_abandon() -> None:
    """The owner's area after reads and after an abandoned ticket: nothing staged is left held."""
    cfg = owner_cfg("release", {"kind": "cross_layer"}, 1)
    with owner_process(cfg) as owner, reader({**BASE, "kind": "cross_layer"}, 1, staging_bytes=AREA,
                                             device=DEVICE) as r:
        for rid in ("frag", "held", "direct"):
            asyncio.run(r.puller.pull(owner.tickets[rid], [list(range(8))]))
        msgs = [wait_release(owner, rid) for rid in ("frag", "held", "direct")]
        assert msgs[-1]["staged"] == 3
        assert max(m["staging_free"][0] for m in msgs) == AREA  # after the three reads, every span is free
    agent = TransferAgent(f"owner-{uuid.uuid4().hex[:8]}", device=torch.device(DEVICE).type)
    layout = layout_for({**BASE, "kind": "cross_layer"}, 1)
    cache = KVCache(layout, torch.device(DEVICE))
    rank = LocalKVRank(agent, layout, cache.buffers, staging_bytes=AREA)
    try:
        exporter = KVExporter(engine_id="owner-abandon", model_name="pattern",
                              identity=identity_for({**BASE, "kind": "cross_layer"}, layout), ranks=[rank])
        ticket = asyncio.run(exporter.hand_out("a", [FRAGMENTED], num_tokens=NUM_TOKENS, first_token_id=1,
                                               handshake_address="127.0.0.1:1", reader_tp_size=1,
                                             prompt_hash=PROMPT_HASH))
        assert ticket.staged_offsets and rank.staging.free_bytes < AREA
        assert exporter.abandon("a") and rank.staging.free_bytes == AREA
        # Another reader TP size cannot read the span: nothing is staged for it.
        other = asyncio.run(exporter.hand_out("b", [FRAGMENTED], num_tokens=NUM_TOKENS, first_token_id=1,
                                              handshake_address="127.0.0.1:1", reader_tp_size=2,
                                              prompt_hash=PROMPT_HASH))
        assert not other.staged_offsets and rank.staging.free_bytes == AREA
        # No room: the ticket goes out unstaged (its blocks are read), and the miss is counted.
        hog = rank.staging.alloc(AREA - 256)
        full = asyncio.run(exporter.hand_out("c", [FRAGMENTED], num_tokens=NUM_TOKENS, first_token_id=1,
                                             handshake_address="127.0.0.1:1", reader_tp_size=1,
                                             prompt_hash=PROMPT_HASH))
        assert not full.staged_offsets and exporter.num_staging_full == 1
        rank.staging.free(hog)
    finally:
        agent.close()


def test_a_staged_span_outside_the_owner_area_is_refused_before_any_read() -> None:
    cfg = owner_cfg("forged", {"kind": "cross_layer"}, 1)
    with owner_process(cfg) as owner, reader({**BASE, "kind": "cross_layer"}, 1, staging_bytes=AREA,
                                             device=DEVICE) as r:
        asyncio.run(r.puller.pull(owner.tickets["contiguous"], [list(range(8))]))  # handshake
        forged = owner.tickets["frag"]
        forged.staged_offsets[0] = AREA - 256
        with pytest.raises(TicketError, match="staging"):
            asyncio.run(r.puller.pull(_resigned(r, forged), [list(range(8, 16))]))
        assert all(bool((c.view(-1)[c.numel() // 2:] == SENTINEL).all()) for c in r.caches[0].buffers)  # not read
        assert r.ranks[0].staging.free_bytes == AREA
