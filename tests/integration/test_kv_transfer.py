"""KV transfer end to end: a real owner process and this (reader) process, gRPC handshake, NIXL READ.

The owner fills its KV with a pattern that depends only on (layer, K/V, block, token, global
head, element); the reader regenerates the pattern and checks every byte it received, and that
every byte it should not have touched (held prefix, blocks outside the window, other blocks)
still holds its sentinel.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import queue
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from bench.kv_synthetic import group_shapes, identity_for, layout_for, pattern, serve_on_pipes
from services.engine.kv_cache.buffers import KVCache
from services.engine.parallel import ParallelConfig
from services.kv.nixl.agent import TransferAgent
from services.kv.nixl.errors import TransferError
from services.kv.ranks.kv_rank import LocalKVRank
from services.kv.reader.errors import KVIntegrityError, TicketError
from services.kv.reader.puller import KVPuller
from services.kv.spec.compat import KVCompatibilityError
from services.kv.spec.description import HandshakeError, StaleTicketError
from services.kv.spec.wire import ticket_signature
from services.proto_gen.pdserve.v1 import kv_pb2

SENTINEL = -7.5
BASE = dict(kind="per_layer", order="NHD", num_blocks=24, num_kv_heads=4, head_dim=8, dtype="float16",
            num_layers=3, block_size=4, seed=11)


# Owners are forked from a server that imported ``bench.kv_synthetic`` once: a fresh interpreter per owner would
# spend ~2 s of a 2-core CI machine importing torch, for some 30 owners here. Each is still a process of its own
# (its own NIXL agents, gRPC server and memory), as in the benchmarks' ``python -m bench.kv_synthetic``.
_OWNERS = multiprocessing.get_context("forkserver")
_OWNERS.set_forkserver_preload(["bench.kv_synthetic"])


class OwnerProcess:
    """The owner's process: ``poll`` as ``subprocess.Popen`` answers it, and a stop that closes its stdin."""

    def __init__(self, cfg: dict) -> None:
        child_in, self._stdin = _OWNERS.Pipe(duplex=False)
        self._stdout_r, child_out = _OWNERS.Pipe(duplex=False)
        self.process = _OWNERS.Process(target=serve_on_pipes, args=(cfg, child_in, child_out), daemon=True)
        self.process.start()
        child_in.close()
        child_out.close()
        self.stdout = open(os.dup(self._stdout_r.fileno()))  # noqa: SIM115 - closed in stop()
        self._stdout_r.close()

    def poll(self) -> int | None:
        return self.process.exitcode

    def stop(self, timeout_s: float = 15.0) -> None:
        self._stdin.close()  # the owner exits when its stdin closes
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.stdout.close()


@dataclass
class Owner:
    proc: OwnerProcess
    port: int
    epoch: int
    tickets: dict[str, kv_pb2.TransferTicket]
    lines: queue.Queue

    def wait_released(self, request_id: str, timeout_s: float = 10.0) -> None:
        while True:
            msg = self.lines.get(timeout=timeout_s)
            if msg.get("released") == request_id:
                return


@contextmanager
def owner_process(cfg: dict):
    proc = OwnerProcess(cfg)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            try:  # NIXL/UCX may print their own lines on stdout
                lines.put(json.loads(line))
            except json.JSONDecodeError:
                sys.stderr.write(f"owner: {line}")

    threading.Thread(target=pump, daemon=True).start()
    try:
        first = lines.get(timeout=60)
        tickets = {rid: kv_pb2.TransferTicket.FromString(bytes.fromhex(h)) for rid, h in first["tickets"].items()}
        yield Owner(proc, first["port"], first["epoch"], tickets, lines)
    finally:
        proc.stop()


def reader_block_size(reader_cfg: dict) -> int:
    """What a router tells the owner of the reader's block size: its groups' gcd (the digest unit divides it)."""
    return math.gcd(*(g["block_size"] for g in group_shapes(reader_cfg)))


@dataclass
class Reader:
    puller: KVPuller
    caches: list[KVCache]
    agents: list[TransferAgent]
    cfg: dict
    tp: int
    ranks: list[LocalKVRank]

    def close(self) -> None:
        for a in self.agents:
            a.close()


@contextmanager
def reader(cfg: dict, tp: int, token: str | None = None, corrupt: bool = False, staging_bytes: int = 0,
           device: str = "cpu", check_tickets: bool = False):
    """A reading engine of ``cfg`` in this process. Its tickets go unchecked unless ``check_tickets``: these tests
    pull one ticket again on purpose (lists, restarts, refusals) and bind no prompt; test_kv_transfer_tickets.py
    checks the tickets."""
    layout = layout_for(cfg, tp)
    caches, agents, ranks = [], [], []
    for rank in range(tp):
        cache = KVCache(layout, torch.device(device))
        for b in cache.buffers:
            b.fill_(SENTINEL)
        agent = TransferAgent(f"reader-{uuid.uuid4().hex[:8]}-tp{rank}", device=torch.device(device).type)
        caches.append(cache)
        agents.append(agent)
        ranks.append(LocalKVRank(agent, layout, cache.buffers, staging_bytes=staging_bytes))
    puller = KVPuller(engine_id="reader", identity=identity_for(cfg, layout), ranks=ranks,
                      auth_token=token, handshake_timeout_s=10, transfer_timeout_s=20,
                      corrupt_pulled_kv_after=0 if corrupt else None, check_tickets=check_tickets)
    r = Reader(puller, caches, agents, cfg, tp, ranks)
    try:
        yield r
    finally:
        r.close()


def expected_views(owner_cfg: dict, r: Reader, remote_ids: list[list[int]], local_ids: list[list[int]],
                   num_tokens: int, starts: list[int]) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Per local rank and layer: what K and V must hold after the pull (sentinel elsewhere).

    Group g moves tokens ``starts[g]..num_tokens``, each from its own block tables and shape.
    """
    values = pattern(owner_cfg)
    out = []
    for rank, cache in enumerate(r.caches):
        views = {}
        for gid, (og, lg) in enumerate(zip(group_shapes(owner_cfg), group_shapes(r.cfg), strict=True)):
            h0, h1 = ParallelConfig(r.tp, rank).kv_head_range(og["num_kv_heads"])
            rbs, lbs = og["block_size"], lg["block_size"]
            for layer in lg["layers"]:
                k, v = cache.views[layer]
                exp = [torch.full_like(k, SENTINEL, device="cpu"), torch.full_like(v, SENTINEL, device="cpu")]
                for t in range(starts[gid], num_tokens):
                    for kv in (0, 1):
                        src = values[layer][kv, remote_ids[gid][t // rbs], t % rbs, h0:h1]
                        exp[kv][local_ids[gid][t // lbs], t % lbs] = src
                views[layer] = (exp[0], exp[1])
        out.append(views)
    return out


def check_received(owner_cfg: dict, r: Reader, ticket: kv_pb2.TransferTicket, local_ids: list[list[int]],
                   starts: list[int]) -> None:
    remote_ids = [list(g.block_ids) for g in ticket.groups]
    n = ticket.num_tokens
    expected = expected_views(owner_cfg, r, remote_ids, local_ids, n, starts)
    for gid, g in enumerate(group_shapes(r.cfg)):
        lbs = g["block_size"]
        last_block, tail = local_ids[gid][(n - 1) // lbs], n % lbs
        for rank, cache in enumerate(r.caches):
            for layer in g["layers"]:
                for kv, (got, exp) in enumerate(zip((v.cpu() for v in cache.views[layer]), expected[rank][layer],
                                                    strict=True)):
                    if tail:  # slots past the prompt in its last block may hold padding: don't care
                        exp[last_block, tail:] = got[last_block, tail:]
                    assert torch.equal(got, exp), f"rank {rank} group {gid} layer {layer} {'KV'[kv]} differs"


def _request(rid: str, num_tokens: int, block_size: int, first_block: int, shuffle: bool) -> dict:
    n = -(-num_tokens // block_size)
    ids = list(range(first_block, first_block + n))
    if shuffle:  # a few runs of consecutive ids, out of order
        ids = ids[n // 2:] + ids[: n // 2]
    return {"request_id": rid, "num_tokens": num_tokens, "block_ids": [ids]}


HEADS_OUTER = {"kind": "heads_outer", "order": "HND"}
CASES = {
    # name: (owner overrides, reader overrides, owner tp, reader tp)
    "per_layer-to-per_layer": ({}, {}, 1, 1),
    "cross_layer-to-cross_layer": ({"kind": "cross_layer"}, {"kind": "cross_layer"}, 1, 1),
    "per_layer-to-cross_layer": ({"order": "HND"}, {"kind": "cross_layer", "order": "HND"}, 1, 1),
    "block-ratio-1:4": ({"kind": "cross_layer", "block_size": 4}, {"kind": "cross_layer", "block_size": 16}, 1, 1),
    "block-ratio-4:1": ({"block_size": 16}, {"block_size": 4}, 1, 1),
    "tp-1-to-2": ({}, {}, 1, 2),
    "tp-2-to-1": ({"kind": "cross_layer"}, {}, 2, 1),
    "tp-2-to-4": ({"order": "HND"}, {"order": "HND"}, 2, 4),
    "tp-2-to-2": ({"kind": "cross_layer"}, {"kind": "cross_layer"}, 2, 2),  # the ranks share one plan
    "heads_outer-tp-1-to-2": (HEADS_OUTER, HEADS_OUTER, 1, 2),
    "heads_outer-tp-2-to-1": (HEADS_OUTER, HEADS_OUTER, 2, 1),
    "heads_outer-to-cross_layer-tp-2-to-1": (HEADS_OUTER, {"kind": "cross_layer", "order": "HND"}, 2, 1),
    "per_layer-to-heads_outer-tp-1-to-2": ({"order": "HND"}, HEADS_OUTER, 1, 2),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_pull_reproduces_owner_bytes(case: str) -> None:
    owner_over, reader_over, owner_tp, reader_tp = CASES[case]
    num_tokens = 29  # a partial last block on every block size used
    owner_cfg = {**BASE, **owner_over, "engine_id": f"owner-{case}", "tp": owner_tp, "reader_tp": reader_tp}
    owner_cfg["requests"] = [_request("req-1", num_tokens, owner_cfg["block_size"], 3, shuffle=True)]
    reader_cfg = {**BASE, **reader_over}
    owner_cfg["reader_block_size"] = reader_block_size(reader_cfg)
    local_ids = list(range(1, 1 + -(-num_tokens // reader_cfg["block_size"])))[::-1]
    with owner_process(owner_cfg) as owner, reader(reader_cfg, reader_tp) as r:
        ticket = owner.tickets["req-1"]
        result = asyncio.run(r.puller.pull(ticket, [local_ids]))
        check_received(owner_cfg, r, ticket, [local_ids], [0])
        assert result.num_descriptors > 0 and result.num_bytes > 0
        owner.wait_released("req-1")  # every reading rank notified: the owner frees the blocks
        # The pull's stages, each measured, together no longer than the pull; planned_reads describes it.
        top = [result.stages[k] for k in ("handshake", "check", "pieces", "plan", "read")]
        assert min(result.stages.values()) >= 0 and sum(top) <= result.seconds + 1e-6
        assert {"read.submit", "read.prepare", "read.post", "read.complete", "read.wake"} <= set(result.stages)
        planned = r.puller.planned_reads(ticket, [local_ids])
        assert len(planned) == result.num_reads
        assert sum(p.num_descriptors for p in planned) == result.num_descriptors
        assert sum(p.num_bytes for p in planned) == result.num_bytes
        # Every rank here has its agent in this process: every READ went through prepared lists, and NIXL's
        # merge of their entries leaves what the planner plans; heads-outer KV is always planned.
        heads_outer = "heads_outer" in (owner_over.get("kind"), reader_over.get("kind"))
        assert all((p.lists is None) == heads_outer for p in planned)
        rows = r.puller.planned_reads(ticket, [local_ids], prepared=False)
        assert [p.num_descriptors for p in rows] == [p.num_descriptors for p in planned]


@pytest.mark.parametrize(("owner_tp", "reader_tp"), [(1, 2), (2, 1)])
def test_heads_outer_pull_between_tp_sizes_reads_one_descriptor_per_head(owner_tp: int, reader_tp: int) -> None:
    """Between different TP sizes a READ of heads-outer blocks is one descriptor per head it reads when the
    blocks are consecutive on both sides (a head's plane holds every block), and one per (head, block) when
    they are fragmented; cross-layer HND blocks take one per block, layer and K/V
    (``tests/unit/kv/test_kv_layout.py`` compares the two)."""
    num_tokens, num_blocks = 32, 8
    heads_per_read = BASE["num_kv_heads"] // max(owner_tp, reader_tp)
    owner_cfg = {**BASE, **HEADS_OUTER, "engine_id": f"owner-heads-{owner_tp}-{reader_tp}", "tp": owner_tp,
                 "reader_tp": reader_tp}
    owner_cfg["requests"] = [
        {"request_id": "runs", "num_tokens": num_tokens, "block_ids": [list(range(3, 3 + num_blocks))]},
        {"request_id": "fragmented", "num_tokens": num_tokens, "block_ids": [list(range(2, 18, 2))]},
    ]
    reader_cfg = {**BASE, **HEADS_OUTER}
    pulls = {"runs": (list(range(1, 1 + num_blocks)), heads_per_read),  # 24-block pools: no plane is whole
             "fragmented": (list(range(num_blocks, 0, -1)), heads_per_read * num_blocks)}
    with owner_process(owner_cfg) as owner, reader(reader_cfg, reader_tp) as r:
        for request_id, (local_ids, per_read) in pulls.items():
            result = asyncio.run(r.puller.pull(owner.tickets[request_id], [local_ids]))
            check_received(owner_cfg, r, owner.tickets[request_id], [local_ids], [0])
            assert result.num_reads == max(owner_tp, reader_tp)
            assert result.num_descriptors == result.num_reads * per_read, request_id
            planned = r.puller.planned_reads(owner.tickets[request_id], [local_ids], prepared=False)
            assert [p.num_descriptors for p in planned] == [per_read] * result.num_reads  # the planner agrees
            owner.wait_released(request_id)


def test_prepared_lists_are_made_once_per_peer_and_released_with_it() -> None:
    """The lists are prepared at the first pull from a peer and reused; forgetting the peer (a failed READ
    does that) releases them with the peer's agent, a READ on them is refused, and the next pull
    handshakes and prepares afresh. A pull without lists moves the same bytes."""
    owner_cfg = {**BASE, "engine_id": "owner-lists", "tp": 1, "reader_tp": 1}
    owner_cfg["requests"] = [_request("a", 29, BASE["block_size"], 3, shuffle=True),
                             _request("b", 29, BASE["block_size"], 3, shuffle=True)]
    owner_cfg["reader_block_size"] = BASE["block_size"]
    local_ids = list(range(1, 9))[::-1]
    with owner_process(owner_cfg) as owner, reader(BASE, 1) as r:
        first = asyncio.run(r.puller.pull(owner.tickets["a"], [local_ids]))
        check_received(owner_cfg, r, owner.tickets["a"], [local_ids], [0])
        (read,) = r.puller.planned_reads(owner.tickets["a"], [local_ids])
        lists = read.lists
        assert lists is not None and r.agents[0]._prepared[lists.peer] == [lists]
        again = asyncio.run(r.puller.pull(owner.tickets["b"], [local_ids]))
        assert r.agents[0]._prepared[lists.peer] == [lists]  # reused, not prepared again
        assert (again.num_bytes, again.num_descriptors) == (first.num_bytes, first.num_descriptors)
        r.puller.peers.forget("owner-lists")
        assert lists.released and lists.peer not in r.agents[0]._prepared
        with pytest.raises(TransferError, match="released"):
            asyncio.run(r.agents[0].read_prepared(lists, read.local_rows, read.remote_rows, num_bytes=1,
                                                  num_descriptors=1, timeout_s=5))
        for b in r.caches[0].buffers:
            b.fill_(SENTINEL)
        asyncio.run(r.puller.pull(owner.tickets["a"], [local_ids]))  # a new handshake, new lists
        check_received(owner_cfg, r, owner.tickets["a"], [local_ids], [0])
        (fresh,) = r.puller.planned_reads(owner.tickets["a"], [local_ids])
        assert fresh.lists is not None and fresh.lists is not lists and not fresh.lists.released
        r.puller._prepared_lists = False
        for b in r.caches[0].buffers:
            b.fill_(SENTINEL)
        planned = asyncio.run(r.puller.pull(owner.tickets["b"], [local_ids]))
        check_received(owner_cfg, r, owner.tickets["b"], [local_ids], [0])
        assert (planned.num_bytes, planned.num_descriptors) == (first.num_bytes, first.num_descriptors)


def test_sliding_window_group_moves_only_the_window() -> None:
    cfg = {**BASE, "kind": "cross_layer", "window": 8}
    num_tokens = 30
    owner_cfg = {**cfg, "engine_id": "owner-window", "tp": 1, "reader_tp": 1,
                 "requests": [_request("w", num_tokens, 4, 0, shuffle=False)]}
    local_ids = list(range(10, 18))
    with owner_process(owner_cfg) as owner, reader(cfg, 1) as r:
        result = asyncio.run(r.puller.pull(owner.tickets["w"], [local_ids]))
        # Last token 29 sees keys 22..29: blocks 5..7 (tokens 20..29) are needed, blocks 0..4 are not.
        check_received(owner_cfg, r, owner.tickets["w"], [local_ids], [20])
        assert result.num_descriptors == 1  # consecutive ids, cross-layer: one run
        owner.wait_released("w")


def test_prefix_already_held_is_not_read() -> None:
    owner_cfg = {**BASE, "engine_id": "owner-prefix", "tp": 1, "reader_tp": 1,
                 "requests": [_request("p", 25, 4, 2, shuffle=False)]}
    local_ids = list(range(7))
    with owner_process(owner_cfg) as owner, reader(BASE, 1) as r:
        full = asyncio.run(r.puller.pull(owner.tickets["p"], [local_ids], num_cached_tokens=12))
        check_received(owner_cfg, r, owner.tickets["p"], [local_ids], [12])  # blocks 0..2 untouched
        per_token = 3 * 2 * 4 * 8 * 2  # layers * K/V * heads * head_dim * bytes
        assert full.num_bytes == (7 - 3) * 4 * per_token  # local blocks 3..6 (the last padded), not 0..2


@pytest.fixture(scope="module")
def compat_owner() -> Iterator[Owner]:
    """One owner for every incompatible reader below: each is refused at its own handshake (its reader is new,
    with its own agent), before any READ, so the owner and its ticket stay as they were."""
    owner_cfg = {**BASE, "engine_id": "owner-compat", "tp": 1, "reader_tp": 1,
                 "requests": [_request("c", 12, 4, 0, shuffle=False)]}
    with owner_process(owner_cfg) as owner:
        yield owner


@pytest.mark.parametrize(
    ("reader_over", "field"),
    [({"dtype": "bfloat16"}, "dtype"), ({"num_layers": 4}, "num_layers"), ({"head_dim": 16}, "head_dim"),
     ({"order": "HND"}, "kv_layout"), ({"kv_digest": "off"}, "kv_digest")],
)
def test_incompatible_reader_is_refused_with_the_field_named(compat_owner: Owner, reader_over: dict,
                                                             field: str) -> None:
    reader_cfg = {**BASE, **reader_over}
    with reader(reader_cfg, 1) as r:
        with pytest.raises(KVCompatibilityError, match=field) as e:
            asyncio.run(r.puller.pull(compat_owner.tickets["c"], [[0, 1, 2]]))
        assert field in e.value.differences
        assert all(bool((b == SENTINEL).all()) for b in r.caches[0].buffers)  # nothing was read
    assert compat_owner.proc.poll() is None  # the refusal left the owner serving the next reader


@pytest.mark.parametrize("digest", ["on", "off"])
def test_corrupted_pulled_kv_fails_its_digest(digest: str) -> None:
    """PDSERVE_FAULT_INJECT=kv_corrupt's flip after the READ: with the digest on, the pull fails with the
    group named (TP 2 -> 1 hybrid: every group, both owner ranks' shares); off, the corruption goes unseen
    (the caller would decode from it)."""
    cfg = {**hybrid_cfg(), **({"kv_digest": "off"} if digest == "off" else {})}
    scratch = cfg["num_blocks"] - 1
    owner_cfg = {**cfg, "engine_id": f"owner-corrupt-{digest}", "tp": 2, "reader_tp": 1,
                 "requests": [{"request_id": "x", "num_tokens": 31, "block_ids": hybrid_tables(cfg, 31, 3, scratch)}]}
    local_ids = hybrid_tables(cfg, 31, 10, scratch)
    with owner_process(owner_cfg) as owner, reader(cfg, 1, corrupt=True) as r:
        if digest == "on":
            with pytest.raises(KVIntegrityError, match="does not match the ticket's digest") as e:
                asyncio.run(r.puller.pull(owner.tickets["x"], local_ids))
            assert e.value.groups == (0, 1)
        else:
            result = asyncio.run(r.puller.pull(owner.tickets["x"], local_ids))
            assert result.num_bytes > 0 and not owner.tickets["x"].digests
        owner.wait_released("x")  # the READs notified: the owner frees its blocks either way


def test_a_ticket_without_a_usable_digest_is_refused_before_any_read() -> None:
    """An owner that left the digest out, or cut it for another block size than the reader's, is refused
    like any ticket that does not fit: nothing is read."""
    owner_cfg = {**BASE, "block_size": 8, "engine_id": "owner-no-digest", "tp": 1, "reader_tp": 1,
                 "requests": [_request("d", 20, 8, 0, shuffle=False)]}
    with owner_process(owner_cfg) as owner, reader(BASE, 1) as r:  # the reader's blocks are 4 tokens
        ticket = owner.tickets["d"]
        asyncio.run(r.puller.peers.get(ticket.handshake_address, ticket.engine_id, ticket.epoch))
        for cut in ("dropped", "coarse"):
            forged = kv_pb2.TransferTicket()
            forged.CopyFrom(ticket)
            if cut == "dropped":
                del forged.digests[:]
            with pytest.raises(TicketError, match="no usable KV digest") as refused:
                # "coarse": the ticket's unit is the owner's 8 tokens; a reader holding 12 cached tokens
                # starts mid-unit, which no digest entry covers (a router tells the owner the reader's size).
                asyncio.run(r.puller.pull(_resigned(r, forged), [[0, 1, 2, 3, 4]],
                                          num_cached_tokens=0 if cut == "dropped" else 12))
            assert refused.value.reason == "digest"
        assert all(bool((b == SENTINEL).all()) for b in r.caches[0].buffers)  # nothing was read


def test_restarted_owner_is_handshaked_again_and_never_read_stale() -> None:
    cfg = {**BASE, "engine_id": "owner-restart", "tp": 1, "reader_tp": 1}
    with reader(BASE, 1) as r:
        with owner_process({**cfg, "epoch": 1, "requests": [_request("a", 12, 4, 0, shuffle=False)]}) as first:
            old_ticket = first.tickets["a"]
            asyncio.run(r.puller.pull(old_ticket, [[0, 1, 2]]))
            port = first.port
        assert r.puller.peers.num_handshakes == 1
        # Same engine id and address, new life: new epoch, different bytes (another seed).
        restarted = {**cfg, "epoch": 2, "seed": 99, "port": port, "requests": [_request("b", 12, 4, 0, False)]}
        with owner_process(restarted) as second:
            # The cached epoch-1 agents are gone: the read fails (nothing from the new life is read)...
            with pytest.raises(TransferError):
                asyncio.run(r.puller.pull(old_ticket, [[3, 4, 5]]))
            # ...and the failure dropped the cached metadata: the new epoch's ticket handshakes again.
            for b in r.caches[0].buffers:
                b.fill_(SENTINEL)
            ticket = second.tickets["b"]
            asyncio.run(r.puller.pull(ticket, [[3, 4, 5]]))
            check_received(restarted, r, ticket, [[3, 4, 5]], [0])
            assert r.puller.peers.num_handshakes == 2
            # Now the old ticket is known stale at once: no read is attempted.
            with pytest.raises(StaleTicketError, match="epoch"):
                asyncio.run(r.puller.pull(old_ticket, [[6, 7, 8]]))
            assert r.puller.peers.num_handshakes == 3


def test_agent_metadata_needs_the_shared_token() -> None:
    owner_cfg = {**BASE, "engine_id": "owner-token", "tp": 1, "reader_tp": 1, "token": "s3cret",
                 "requests": [_request("t", 8, 4, 0, shuffle=False)]}
    with owner_process(owner_cfg) as owner:
        with reader(BASE, 1, token="wrong") as r, pytest.raises(HandshakeError, match="PERMISSION_DENIED"):
            asyncio.run(r.puller.pull(owner.tickets["t"], [[0, 1]]))
        with reader(BASE, 1, token="s3cret") as r:
            asyncio.run(r.puller.pull(owner.tickets["t"], [[0, 1]]))
            check_received(owner_cfg, r, owner.tickets["t"], [[0, 1]], [0])


def _resigned(r: Reader, ticket: kv_pb2.TransferTicket) -> kv_pb2.TransferTicket:
    """The ticket signed again with its owner's key (from the handshake): what a buggy owner could issue."""
    ticket.signature = ticket_signature(ticket, r.puller.peers.cached(ticket.engine_id, ticket.epoch).ticket_key)
    return ticket


def test_forged_ticket_cannot_read_outside_the_owner_blocks() -> None:
    owner_cfg = {**BASE, "engine_id": "owner-forged", "tp": 1, "reader_tp": 1,
                 "requests": [_request("f", 8, 4, 0, shuffle=False)]}
    with owner_process(owner_cfg) as owner, reader(BASE, 1) as r:
        forged = kv_pb2.TransferTicket()
        forged.CopyFrom(owner.tickets["f"])
        forged.groups[0].block_ids[0] = 2  # another request's block, inside the owner's pool
        with pytest.raises(TicketError, match="not signed") as refused:
            asyncio.run(r.puller.pull(forged, [[0, 1]]))
        assert refused.value.reason == "signature"
        assert all(bool((b == SENTINEL).all()) for b in r.caches[0].buffers)  # nothing was read
        # Behind the signature, the checks still hold for a ticket its owner got wrong.
        forged.groups[0].block_ids[1] = 10_000  # beyond the owner's 24 blocks
        with pytest.raises(TicketError, match="outside"):
            asyncio.run(r.puller.pull(_resigned(r, forged), [[0, 1]]))
        forged.CopyFrom(owner.tickets["f"])
        forged.num_tokens = 4096  # more tokens than its blocks hold
        with pytest.raises(TicketError):
            asyncio.run(r.puller.pull(_resigned(r, forged), [[0, 1]]))
        forged.CopyFrom(owner.tickets["f"])  # a host-tier part from an owner that has no host tier
        forged.num_host_tokens = 4
        forged.host_groups.add(group_id=0, block_ids=[0])
        with pytest.raises(TicketError, match="no host tier"):
            asyncio.run(r.puller.pull(_resigned(r, forged), [[0, 1]]))
        assert all(bool((b == SENTINEL).all()) for b in r.caches[0].buffers)


# ---- hybrid models: a sliding group and a full group with its own heads and head dim -----------------

# Gemma-4-like: layers 0, 1, 3, 4 sliding (window 10; 4 heads of 8, the model's shape), layer 2 full
# with 2 heads of 16, layer 5 reads layer 2's KV (no KV of its own, in no group).
HYBRID = {**BASE, "num_layers": 6, "num_blocks": 24, "window": 10, "kv_sharing": {"5": 2},
          "groups": [{"kind": "sliding_window", "layers": [0, 1, 3, 4]},
                     {"kind": "full", "layers": [2], "num_kv_heads": 2, "head_dim": 16}]}


def hybrid_cfg(kind: str = "per_layer", sliding_bs: int = 4, full_bs: int = 4, **over) -> dict:
    cfg = {**HYBRID, "kind": kind, **over}
    cfg["groups"] = [{**cfg["groups"][0], "block_size": sliding_bs}, {**cfg["groups"][1], "block_size": full_bs}]
    return cfg


def hybrid_tables(cfg: dict, num_tokens: int, first_block: int, placeholder: int) -> list[list[int]]:
    """Per group: consecutive ids, with the sliding group's out-of-window blocks set to ``placeholder``
    (the engine's scratch block: the layout's last), repeated."""
    out = []
    for g in group_shapes(cfg):
        n = -(-num_tokens // g["block_size"])
        ids = list(range(first_block, first_block + n))
        if g["window"] is not None:
            dropped = max(0, num_tokens - g["window"]) // g["block_size"]
            ids[:dropped] = [placeholder] * dropped
        out.append(ids)
    return out


def ideal_bytes(owner_cfg: dict, reader_cfg: dict, num_tokens: int, starts: list[int]) -> int:
    """Full group: every token; sliding group: from the window's start; each padded to the finer block."""
    total = 0
    for og, lg, start in zip(group_shapes(owner_cfg), group_shapes(reader_cfg), starts, strict=True):
        unit = min(og["block_size"], lg["block_size"])
        per_token = len(og["layers"]) * 2 * og["num_kv_heads"] * og["head_dim"] * 2  # float16
        total += (-(-num_tokens // unit) * unit - start) * per_token
    return total


HYBRID_CASES = {
    # name: (owner (kind, sliding bs, full bs), reader (kind, sliding bs, full bs), [(tokens, window starts)])
    # 31 tokens, window 10: the newest token sees keys 21..30; 9 tokens: the prompt is inside the window
    "cross_layer-same-blocks": (("cross_layer", 4, 4), ("cross_layer", 4, 4), [(31, [20, 0]), (9, [0, 0])]),
    # sliding 4 -> 8 (the start 20 falls inside local block 2, tokens 16..23), full 8 -> 4
    "ratios-per-group": (("cross_layer", 4, 8), ("per_layer", 8, 4), [(31, [20, 0]), (10, [0, 0])]),
    # sliding 8 -> 4 (the owner's block 2 is read from its middle), full 4 -> 8
    "ratios-per-group-reversed": (("per_layer", 8, 4), ("cross_layer", 4, 8), [(31, [20, 0]), (27, [16, 0])]),
}


@pytest.mark.parametrize("case", list(HYBRID_CASES), ids=list(HYBRID_CASES))
def test_hybrid_pull_moves_the_window_and_full_groups_with_their_shapes(case: str) -> None:
    (o_kind, o_sw, o_full), (r_kind, r_sw, r_full), requests = HYBRID_CASES[case]
    owner_cfg = {**hybrid_cfg(o_kind, o_sw, o_full), "engine_id": f"owner-hybrid-{case}", "tp": 1, "reader_tp": 1}
    scratch = owner_cfg["num_blocks"] - 1
    owner_cfg["requests"] = [{"request_id": f"h{n}", "num_tokens": n,
                              "block_ids": hybrid_tables(owner_cfg, n, 3, scratch)} for n, _ in requests]
    reader_cfg = hybrid_cfg(r_kind, r_sw, r_full)
    owner_cfg["reader_block_size"] = reader_block_size(reader_cfg)
    with owner_process(owner_cfg) as owner, reader(reader_cfg, 1) as r:
        for num_tokens, starts in requests:
            for b in r.caches[0].buffers:
                b.fill_(SENTINEL)
            local_ids = hybrid_tables(reader_cfg, num_tokens, 9, reader_cfg["num_blocks"] - 1)
            ticket = owner.tickets[f"h{num_tokens}"]
            assert (scratch in ticket.groups[0].block_ids) == (starts[0] >= o_sw)  # placeholders in the ticket
            result = asyncio.run(r.puller.pull(ticket, local_ids))
            # every byte: the window and the full group arrived, nothing else was touched (the reader's
            # own scratch block included), the owner's placeholders were never read
            check_received(owner_cfg, r, ticket, local_ids, starts)
            assert result.num_bytes == ideal_bytes(owner_cfg, reader_cfg, num_tokens, starts)
            owner.wait_released(f"h{num_tokens}")


def test_hybrid_tp_with_equal_heads_per_group_works() -> None:
    # both groups have 4 heads (head dims 8 and 16): TP 2 -> 1 keeps working
    cfg = hybrid_cfg("cross_layer")
    cfg["groups"][1] = {**cfg["groups"][1], "num_kv_heads": 4}
    owner_cfg = {**cfg, "engine_id": "owner-hybrid-tp", "tp": 2, "reader_tp": 1}
    owner_cfg["requests"] = [{"request_id": "t", "num_tokens": 31,
                              "block_ids": hybrid_tables(cfg, 31, 2, cfg["num_blocks"] - 1)}]
    local_ids = hybrid_tables(cfg, 31, 10, cfg["num_blocks"] - 1)
    with owner_process(owner_cfg) as owner, reader(cfg, 1) as r:
        result = asyncio.run(r.puller.pull(owner.tickets["t"], local_ids))
        check_received(owner_cfg, r, owner.tickets["t"], local_ids, [20, 0])
        assert result.num_reads == 2  # one READ per owner rank, both groups in it
        assert result.num_bytes == ideal_bytes(owner_cfg, cfg, 31, [20, 0])
        owner.wait_released("t")


@pytest.mark.parametrize(("owner_tp", "reader_tp", "kind"), [(2, 1, "cross_layer"), (1, 2, "cross_layer"),
                                                       (2, 2, "cross_layer"), (2, 1, "heads_outer"),
                                                       (1, 2, "heads_outer")])
def test_hybrid_tp_with_per_group_heads_works(owner_tp: int, reader_tp: int, kind: str) -> None:
    # group 0 has 4 heads, group 1 has 2: each group is sharded by its own head count, and the
    # owner waits for one notification per reading rank whatever group it read
    cfg = hybrid_cfg(kind, order="HND") if kind == "heads_outer" else hybrid_cfg(kind)
    owner_cfg = {**cfg, "engine_id": f"owner-hybrid-{kind}-tp{owner_tp}-{reader_tp}", "tp": owner_tp,
                 "reader_tp": reader_tp}
    owner_cfg["requests"] = [{"request_id": "t", "num_tokens": 31,
                              "block_ids": hybrid_tables(cfg, 31, 2, cfg["num_blocks"] - 1)}]
    local_ids = hybrid_tables(cfg, 31, 10, cfg["num_blocks"] - 1)
    with owner_process(owner_cfg) as owner, reader(cfg, reader_tp) as r:
        result = asyncio.run(r.puller.pull(owner.tickets["t"], local_ids))
        check_received(owner_cfg, r, owner.tickets["t"], local_ids, [20, 0])
        assert result.num_reads == max(owner_tp, reader_tp)
        assert result.num_bytes == ideal_bytes(owner_cfg, cfg, 31, [20, 0])
        owner.wait_released("t")


def test_hybrid_refusals_group_mismatch_at_handshake_and_forged_placeholders() -> None:
    owner_cfg = {**hybrid_cfg(), "engine_id": "owner-hybrid-refusals", "tp": 1, "reader_tp": 1,
                 "requests": [{"request_id": "f", "num_tokens": 31,
                               "block_ids": hybrid_tables(hybrid_cfg(), 31, 0, 23)}]}
    local_ids = hybrid_tables(hybrid_cfg(), 31, 9, 23)
    wide = hybrid_cfg()
    wide["groups"][1] = {**wide["groups"][1], "head_dim": 32}
    with owner_process(owner_cfg) as owner:
        # a group whose head dim differs: refused at handshake, naming the group and the field
        with reader(wide, 1) as r:
            with pytest.raises(KVCompatibilityError, match=r"KV group 1 \(full\): head_dim local 32 vs remote 16"):
                asyncio.run(r.puller.pull(owner.tickets["f"], local_ids))
            assert r.puller.peers.num_handshakes == 1
            assert all(bool((b == SENTINEL).all()) for b in r.caches[0].buffers)
        # a placeholder is range-checked like any id, though it would never be read
        with reader(hybrid_cfg(), 1) as r:
            forged = kv_pb2.TransferTicket()
            forged.CopyFrom(owner.tickets["f"])
            forged.groups[0].block_ids[0] = 10_000
            with pytest.raises(TicketError, match="not signed"):
                asyncio.run(r.puller.pull(forged, local_ids))
            with pytest.raises(TicketError, match=r"KV group 0 \(sliding_window 10\).*outside"):
                asyncio.run(r.puller.pull(_resigned(r, forged), local_ids))
            assert all(bool((b == SENTINEL).all()) for b in r.caches[0].buffers)
