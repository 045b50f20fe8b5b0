"""Where a KV pull's time goes: the in-service pull stage by stage, side by side with raw NIXL READs.

Two processes: a synthetic owner (``bench.kv_synthetic``: Llama-3.1-8B KV shape, cross-layer
layout, bf16, block 16, handshake over gRPC, its own NIXL agent) and this process as the reader.
For each placement, prompt length and pool, the same bytes move four ways, interleaved repeat by
repeat so that all four see the same machine:

  pull      ``KVPuller.pull`` as the decode worker calls it (handshake cached): ticket checks, block
            pieces (unit indices), indices into the descriptor lists prepared for the peer at its first
            pull (``services.kv.plan.read_lists``), the agent's READ with the request id as notification, and
            the KV digest of what arrived (on by default; its cost is printed as a ratio to the rest)
  agent     ``TransferAgent.read`` of the planner's rows: the agent alone, through the event loop
  raw_plan  NIXL alone on this thread, the planner's rows: descriptor lists, ``initialize_xfer``,
            ``transfer``, spinning on ``check_xfer_state``
  raw_prep  NIXL alone, descriptor lists prepared once per block (``prep_xfer_dlist``, both sides) and
            a request made from the pull's block ids (``make_prepped_xfer``, which merges adjacent ones)
  raw_1     NIXL alone, ONE descriptor of the same bytes (the ceiling the issue compares with)

Pools: ``contiguous`` (consecutive block ids on both sides: one merged descriptor) and
``fragmented`` (every other block on both sides: one descriptor per 2 MiB block; the owner stages such a
ticket, ``services.kv.plan.staging``, so the pull reads its span into the reader's staging area and scatters it,
``staged``/``p.descs``; ``--no-staging``: it reads the blocks). ``hand-out ms`` is the owner's ticket: its
digest, and its gather when staged. The raw variants read the blocks either way. The first pull of
each placement is reported on its own (``first``: handshake, peer connection, first READ).

Pull stages (``KVPuller.pull``'s ``PullResult.stages``): handshake (peer-cache lookup), check (the
ticket against the owner's handshake, its signature and digest entries), pieces (unit indices per
group), plan (indices into the prepared lists, every rank), and the agent's READ: submit (until a
thread posts it: the caller's for a short post, else the agent's worker thread), prepare
(``make_prepped_xfer``), post (``transfer``; on DRAM the copy runs inside it), complete (post
returned -> its end was seen), wake (-> the awaiting coroutine resumed), scatter (a staged span's, from the
reader's staging area into its blocks: queued on a GPU, where it runs before the digest). ``other`` is what the stages
do not cover. ``--no-prepared-lists`` measures the pull planned from scratch per READ instead.

    python bench/pull_path.py                                  # CPU (DRAM), 512/2k/8k tokens
    python bench/pull_path.py --device cuda                    # both processes on cuda:0
    python bench/pull_path.py --placements auto                # cuda:0 -> cuda:0, and cuda:0 -> cuda:1 if 2 GPUs
    python bench/pull_path.py --placements cuda:0/cuda:1       # owner/reader, comma-separated
    python bench/pull_path.py --engine-load                    # a busy "engine" thread in the reader process
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import services  # noqa: E402,F401,I001
from bench._common import emit_json  # noqa: E402
from bench.kv_synthetic import identity_for, layout_for  # noqa: E402
from bench.transfer import SHAPE, Owner, block_ids, device_list, make_ranks, stop_all  # noqa: E402
from services.kv.nixl.agent import CUDA_IPC_GET_ENV, TransferAgent, read_stages  # noqa: E402
from services.kv.reader.puller import KVPuller  # noqa: E402
from services.proto_gen.pdserve.v1 import kv_pb2  # noqa: E402

POOLS = {"contiguous": 1, "fragmented": 2}
VARIANTS = ("pull", "agent", "raw_plan", "raw_prep", "raw_1")
# Those a pull reports are printed (read.rows: older pullers); read and digest are the READ and the KV digest.
PULL_STAGES = ("handshake", "check", "pieces", "plan", "read.rows", "read.submit", "read.prepare", "read.post",
               "read.complete", "read.wake", "read.scatter", "read", "digest")
RAW_STAGES = ("prepare", "post", "complete")
TIMEOUT_S = 120.0


def parse_placements(text: str | None, owner: list[str], reader: list[str]) -> list[tuple[str, str]]:
    """``owner/reader`` pairs; ``auto``: cuda:0/cuda:0, plus cuda:0/cuda:1 when two GPUs are visible."""
    if text == "auto":
        if not torch.cuda.is_available():
            raise ValueError("--placements auto needs a GPU")
        return [("cuda:0", "cuda:0")] + ([("cuda:0", "cuda:1")] if torch.cuda.device_count() >= 2 else [])
    if not text:
        return [(owner[0], reader[0])]
    pairs = []
    for item in text.split(","):
        o, sep, r = item.strip().partition("/")
        if not sep:
            raise ValueError(f"placement {item!r}: want OWNER/READER, e.g. cuda:0/cuda:1")
        pairs.append((device_list(o, o)[0], device_list(r, r)[0]))
    return pairs


class EngineLoad:
    """A thread shaped like the decode engine's step loop: small torch ops (which drop the GIL) between
    stretches of pure Python (which hold it), so the pull path competes for the GIL as in service."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-load", daemon=True)
        self.steps = 0

    def _run(self) -> None:
        x = torch.ones(256, 256)
        while not self._stop.is_set():
            for _ in range(20):
                x = x * 1.0001
            sum(range(20_000))  # ~0.3 ms of Python holding the GIL
            self.steps += 1

    def __enter__(self) -> EngineLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def raw_read(agent: TransferAgent, peer: str, local: np.ndarray, remote: np.ndarray, mem_kind: str,
             remote_kind: str, prepped: tuple | None = None) -> dict[str, float]:
    """One READ on NIXL's API alone, on this thread: lists, initialize, post, spin until done. With
    ``prepped`` (local list, local indices, remote list, remote indices): ``make_prepped_xfer`` instead.
    Under the agent's lock, which every NIXL call of the agent takes (the agent is not thread-safe, and
    its own thread may still be sending the previous READ's notification)."""
    nixl = agent._nixl
    with agent._locked():
        t0 = time.perf_counter()
        if prepped is None:
            xfer = nixl.initialize_xfer("READ", nixl.get_xfer_descs(local, mem_kind),
                                        nixl.get_xfer_descs(remote, remote_kind), peer, b"raw")
        else:
            xfer = nixl.make_prepped_xfer("READ", *prepped, b"raw")
        t1 = time.perf_counter()
        state = nixl.transfer(xfer)
        t2 = time.perf_counter()
        deadline = t2 + TIMEOUT_S
        while state == "PROC" and time.perf_counter() < deadline:
            state = nixl.check_xfer_state(xfer)
        t3 = time.perf_counter()
        xfer.release()
    if state != "DONE":
        raise RuntimeError(f"raw READ ended {state}")
    return {"total": t3 - t0, "prepare": t1 - t0, "post": t2 - t1, "complete": t3 - t2}


class Case:
    """One (placement, tokens, pool): the ticket, the reader's block ids and the planner's rows."""

    def __init__(self, puller: KVPuller, agent: TransferAgent, ticket: kv_pb2.TransferTicket,
                 local_ids: list[int], block_lists: tuple) -> None:
        self.puller, self.agent, self.ticket, self.local_ids = puller, agent, ticket, local_ids
        (read,) = puller.planned_reads(ticket, [local_ids], prepared=False)  # rows, for the raw variants
        owner, rank = read.owner, read.rank
        self.remote_rows, self.local_rows = read.remote_rows, read.local_rows
        self.num_bytes, self.num_descriptors = read.num_bytes, read.num_descriptors
        self.peer = agent.add_peer(owner.agent_metadata)
        self.remote_kind, self.local_kind = owner.regions[0].kind, rank.regions[0].kind
        src0, dst0 = self.remote_rows[0], self.local_rows[0]
        self.remote_1 = np.array([[src0[0], self.num_bytes, src0[2]]], dtype=np.uint64)
        self.local_1 = np.array([[dst0[0], self.num_bytes, dst0[2]]], dtype=np.uint64)
        local_list, remote_list = block_lists
        self.prepped = (local_list, np.asarray(local_ids, dtype=np.int32), remote_list,
                        np.asarray(ticket.groups[0].block_ids, dtype=np.int32))

    def planning_warm(self, repeats: int = 50) -> float:
        """Seconds to check, map and plan the ticket (what ``pull`` does before its READ), warm: in a loop,
        no copy in between. On DRAM each copy evicts the CPU caches, which slows the pull's own planning
        2-5x; a device copy does not, so this is the planning cost a GPU pull sees."""
        self.puller.planned_reads(self.ticket, [self.local_ids])
        t = time.perf_counter()
        for _ in range(repeats):
            self.puller.planned_reads(self.ticket, [self.local_ids])
        return (time.perf_counter() - t) / repeats

    async def pull(self) -> dict[str, float]:
        r = await self.puller.pull(self.ticket, [self.local_ids])
        assert r.num_bytes == self.num_bytes, (r.num_bytes, self.num_bytes)
        return {"total": r.seconds, "descriptors": r.num_descriptors,
                **{k: v for k, v in r.stages.items() if k in PULL_STAGES}}

    async def agent_read(self) -> dict[str, float]:
        stages: dict[str, float] = {}
        read_stages.set(stages)
        t = time.perf_counter()
        await self.agent.read(self.peer, self.local_rows, self.remote_rows, b"agent", self.local_kind,
                              remote_mem_kind=self.remote_kind, timeout_s=TIMEOUT_S)
        return {"total": time.perf_counter() - t, **stages}

    def raw(self, one: bool = False, prepped: bool = False) -> dict[str, float]:
        local, remote = (self.local_1, self.remote_1) if one else (self.local_rows, self.remote_rows)
        return raw_read(self.agent, self.peer, local, remote, self.local_kind, self.remote_kind,
                        self.prepped if prepped else None)


def block_lists(puller: KVPuller, agent: TransferAgent, ticket: kv_pb2.TransferTicket) -> tuple:
    """NIXL descriptor lists of every whole block (one descriptor each), prepared once on both sides."""
    owner = puller.peers.cached(ticket.engine_id, ticket.epoch).ranks[0]
    local, (remote,) = agent.regions[0], owner.regions  # the KV buffer (registered first; then the staging area)
    block = owner.layout.buffers()[0].block_stride_bytes
    idx = np.arange(owner.layout.num_blocks, dtype=np.uint64)
    nixl, peer = agent._nixl, agent.add_peer(owner.agent_metadata)
    out = []
    for name, addr, dev, kind in (("NIXL_INIT_AGENT", local.addr, local.device_id, local.mem_kind),
                                  (peer, remote.address, remote.device_id, remote.kind)):
        rows = np.stack([addr + idx * block, np.full(idx.size, block, np.uint64), np.full(idx.size, dev, np.uint64)],
                        axis=1)
        with agent._locked():
            out.append(nixl.prep_xfer_dlist(name, np.ascontiguousarray(rows, dtype=np.uint64), kind))
    return tuple(out)


def median_stages(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def run_placement(owner_device: str, reader_device: str, tokens: list[int], pools: list[str], repeats: int,
                  load: bool, prepared_lists: bool = True, staging: bool = True,
                  kv_dtype: str = "bfloat16") -> list[dict]:
    cfg = {**SHAPE, "dtype": kv_dtype, "kind": "cross_layer",
           "num_blocks": 2 * -(-max(tokens) // SHAPE["block_size"]) + 1}
    requests = [{"request_id": f"{n}-{pool}", "num_tokens": n,
                 "block_ids": [block_ids(-(-n // SHAPE["block_size"]), POOLS[pool])]}
                for n in tokens for pool in pools]
    # Staging areas that hold what a fragmented pool stages: the owner hands every ticket out at once, the reader
    # pulls one at a time. A contiguous pool's tickets are one run, never staged.
    block_bytes = layout_for(cfg, 1).block_bytes(0)
    staged_bytes = [-(-n // SHAPE["block_size"]) * block_bytes for n in tokens for pool in pools
                    if staging and POOLS[pool] > 1]
    owner = Owner({**cfg, "engine_id": f"pull-path-{uuid.uuid4().hex[:6]}", "tp": 1, "reader_tp": 1, "seed": 0,
                   "fill": "none", "devices": [owner_device], "requests": requests,
                   "staging_bytes": sum(staged_bytes) + 4096 * len(staged_bytes)})
    rows = []
    try:
        hello = owner.hello()
        layout = layout_for(cfg, 1)
        (rank,) = make_ranks(layout, [reader_device], "pull-path-reader", max(staged_bytes, default=0))
        # Each ticket is pulled again and again (the samples): the ticket checks would refuse the second pull.
        puller = KVPuller(engine_id="pull-path-reader", identity=identity_for(cfg, layout), ranks=[rank],
                          transfer_timeout_s=TIMEOUT_S, prepared_lists=prepared_lists, check_tickets=False)
        base = dict(scenario="pull_path", owner_device=owner_device, reader_device=reader_device, load=load,
                    kv_dtype=kv_dtype)
        prepared: list = []  # the prepared descriptor lists, released under the agent's lock at the end

        async def measure() -> None:
            first, lists = True, None
            for n in tokens:
                for pool in pools:
                    ticket = kv_pb2.TransferTicket.FromString(bytes.fromhex(hello["tickets"][f"{n}-{pool}"]))
                    local = block_ids(-(-n // SHAPE["block_size"]), POOLS[pool])
                    r = await puller.pull(ticket, [local])  # the first: handshake + connection; then warm-up
                    if first:
                        rows.append({**base, "tokens": n, "pool": pool, "variant": "first", "bytes": r.num_bytes,
                                     "descriptors": r.num_descriptors, "seconds": r.seconds, "stages": r.stages})
                        first = False
                    if lists is None:
                        lists = block_lists(puller, rank.agent, ticket)
                        prepared.extend(lists)
                    case = Case(puller, rank.agent, ticket, local, lists)
                    case.raw(one=True)  # warm-up of the raw path
                    samples: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
                    for _ in range(repeats):
                        samples["pull"].append(await case.pull())
                        samples["agent"].append(await case.agent_read())
                        samples["raw_plan"].append(case.raw())
                        samples["raw_prep"].append(case.raw(prepped=True))
                        samples["raw_1"].append(case.raw(one=True))
                    warm = case.planning_warm()
                    for variant, s in samples.items():
                        med = median_stages(s)
                        own = variant == "pull"  # its own descriptors (a staged span's), the others the blocks'
                        rows.append({**base, "tokens": n, "pool": pool, "variant": variant, "bytes": case.num_bytes,
                                     "descriptors": 1 if variant == "raw_1" else
                                     int(med.pop("descriptors")) if own else case.num_descriptors,
                                     "staged": bool(ticket.staged_offsets) if own else False,
                                     "hand_out_seconds": hello["hand_out_s"][f"{n}-{pool}"],
                                     "seconds": med.pop("total"), "best_seconds": min(x["total"] for x in s),
                                     "stages": med, **({"planning_warm_seconds": warm} if variant == "pull" else {})})

        if load:
            with EngineLoad():
                asyncio.run(measure())
        else:
            asyncio.run(measure())
        with rank.agent._locked():
            for handle in prepared:
                handle.release()
        rank.agent.close()
    finally:
        stop_all([owner])
    return rows


def print_dtype_ratios(rows: list[dict]) -> None:
    """The pull of each KV dtype against the first one's (bf16 by default) on the same prompt and pool."""
    pulls = [r for r in rows if r["variant"] == "pull"]
    dtypes = list(dict.fromkeys(r["kv_dtype"] for r in pulls))
    if len(dtypes) < 2:
        return
    by = {(r["owner_device"], r["reader_device"], r["tokens"], r["pool"], r["kv_dtype"]): r for r in pulls}
    print(f"\n# the pull by KV dtype, against {dtypes[0]} (median ms; bytes include no scales: they are in the "
          "handshake)")
    print(f"{'placement':>15} {'tokens':>6} {'pool':>10} " + " ".join(f"{d + ' ms':>16}" for d in dtypes)
          + " " + " ".join(f"{d + '/' + dtypes[0]:>24}" for d in dtypes[1:]) + f" {'bytes ratio':>11}")
    for (o, d, n, pool, dt), base in by.items():
        if dt != dtypes[0]:
            continue
        others = [by.get((o, d, n, pool, x)) for x in dtypes[1:]]
        if None in others:
            continue
        cells = " ".join(f"{r['seconds'] * 1e3:>16.3f}" for r in [base, *others])
        ratios = " ".join(f"{r['seconds'] / base['seconds']:>24.3f}" for r in others)
        print(f"{o + '/' + d:>15} {n:>6} {pool:>10} {cells} {ratios} {others[-1]['bytes'] / base['bytes']:>11.3f}")


def print_rows(rows: list[dict], repeats: int) -> None:
    by = {(r["owner_device"], r["reader_device"], r["kv_dtype"], r["tokens"], r["pool"], r["variant"]): r
          for r in rows}
    placements = list(dict.fromkeys((r["owner_device"], r["reader_device"], r["kv_dtype"]) for r in rows))
    for o, d, dt in placements:
        load = " with a busy engine-like thread" if rows[0]["load"] else ""
        print(f"\n# KV pull vs raw NIXL READ, P {o} -> D {d}{load}: Llama-3.1-8B KV (cross-layer, {dt}, block 16), "
              f"median of {repeats}")
        print(f"{'tokens':>6} {'pool':>10} {'MiB':>7} {'descs':>5} {'raw_1 ms':>9} {'GB/s':>7} {'raw_plan':>9} "
              f"{'raw_prep':>9} {'agent':>8} {'pull ms':>8} {'GB/s':>7} {'pull/raw_1':>10} {'staged':>6} "
              f"{'p.descs':>7} {'hand-out ms':>11}")
        keys = [k for k in by if k[:3] == (o, d, dt) and k[5] == "pull"]
        for _, _, _, n, pool, _ in keys:
            p, r1, rp, ag, pp = (by[o, d, dt, n, pool, v] for v in ("pull", "raw_1", "raw_plan", "agent", "raw_prep"))
            print(f"{n:>6} {pool:>10} {p['bytes'] / 2**20:>7.0f} {rp['descriptors']:>5} {r1['seconds'] * 1e3:>9.3f} "
                  f"{r1['bytes'] / r1['seconds'] / 1e9:>7.1f} {rp['seconds'] * 1e3:>9.3f} {pp['seconds'] * 1e3:>9.3f} "
                  f"{ag['seconds'] * 1e3:>8.3f} "
                  f"{p['seconds'] * 1e3:>8.3f} {p['bytes'] / p['seconds'] / 1e9:>7.1f} "
                  f"{r1['seconds'] / p['seconds']:>10.2f} {'yes' if p['staged'] else 'no':>6} {p['descriptors']:>7} "
                  f"{p['hand_out_seconds'] * 1e3:>11.3f}")
        print("\n  KV digest (the reader's check of every pulled byte, inside the pull), median: its cost as a "
              "ratio to the pull without it")
        print(f"  {'tokens':>6} {'pool':>10} {'digest ms':>10} {'GB/s':>7} {'pull ms':>8} {'digest/pull':>11}")
        for _, _, _, n, pool, _ in keys:
            p = by[o, d, dt, n, pool, "pull"]
            dig = p["stages"].get("digest", 0.0)
            print(f"  {n:>6} {pool:>10} {dig * 1e3:>10.3f} {p['bytes'] / max(dig, 1e-9) / 1e9:>7.1f} "
                  f"{(p['seconds'] - dig) * 1e3:>8.3f} {dig / (p['seconds'] - dig):>11.3f}")
        stages = [s for s in PULL_STAGES if any(s in by[k]["stages"] for k in keys) and s not in ("read", "digest")]
        names = [s.removeprefix("read.") for s in stages]
        print(f"\n  pull stages but the digest, us (median): {' '.join(f'{s:>8}' for s in names)} {'other':>8} | "
              f"raw_1: "
              f"{' '.join(f'{s:>8}' for s in RAW_STAGES)} | planning warm")
        for _, _, _, n, pool, _ in keys:
            p, r1 = by[o, d, dt, n, pool, "pull"], by[o, d, dt, n, pool, "raw_1"]
            other = p["seconds"] - p["stages"].get("digest", 0.0) - sum(p["stages"].get(s, 0.0) for s in stages)
            cells = " ".join(f"{p['stages'].get(s, 0.0) * 1e6:>8.0f}" for s in stages)
            raw = " ".join(f"{r1['stages'][s] * 1e6:>8.0f}" for s in RAW_STAGES)
            print(f"  {n:>6} {pool:>17}: {cells} {other * 1e6:>8.0f} |        {raw} | "
                  f"{p['planning_warm_seconds'] * 1e6:>8.0f}")
        firsts = [r for r in rows if (r["owner_device"], r["reader_device"], r["kv_dtype"]) == (o, d, dt)
                  and r["variant"] == "first"]
        for f in firsts:
            st = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in f["stages"].items() if v >= 1e-4)
            print(f"\n  first pull ({f['tokens']} tokens, {f['pool']}): {f['seconds'] * 1e3:.1f} ms ({st} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--owner-devices", default=None, help="the owner's (prefill) device; default --device")
    ap.add_argument("--reader-devices", default=None, help="the reader's (decode) device; default --device")
    ap.add_argument("--placements", default=None,
                    help="OWNER/READER pairs, comma-separated (cuda:0/cuda:1), or 'auto' (cuda:0/cuda:0 and, with two "
                    "GPUs, cuda:0/cuda:1); overrides the device flags")
    ap.add_argument("--tokens", default="512,2048,8192", help="prompt lengths")
    ap.add_argument("--pools", default="contiguous,fragmented", help=f"of {list(POOLS)}")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--engine-load", action="store_true", help="run a busy engine-like thread in the reader")
    ap.add_argument("--no-prepared-lists", action="store_true",
                    help="plan every pull from scratch (KVPuller(prepared_lists=False)), as before prepared lists")
    ap.add_argument("--no-staging", action="store_true",
                    help="no KV staging areas (services/kv/plan/staging.py): a fragmented pool's pull reads each block")
    ap.add_argument("--kv-dtypes", default="bfloat16",
                    help="KV cache dtypes, comma-separated (e.g. bfloat16,fp8_e4m3: each pulled, then side by side)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row on stdout, no tables")
    ap.add_argument("--json-out", default=None, help="also write the JSON lines to this file")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    pools = args.pools.split(",")
    if not set(pools) <= set(POOLS) or any(t < 1 for t in tokens) or args.repeats < 1:
        ap.error("bad --pools, --tokens or --repeats")
    try:
        placements = parse_placements(args.placements, device_list(args.owner_devices, args.device),
                                      device_list(args.reader_devices, args.device))
    except ValueError as exc:
        ap.error(str(exc))
    if any(torch.device(d).type == "cuda" for pair in placements for d in pair):
        os.environ.setdefault(CUDA_IPC_GET_ENV, "y")  # before any agent (and the owners) start
    rows = []
    for owner_device, reader_device in placements:
        for kv_dtype in args.kv_dtypes.split(","):
            rows += run_placement(owner_device, reader_device, tokens, pools, args.repeats, args.engine_load,
                                  not args.no_prepared_lists, not args.no_staging, kv_dtype)
    if not emit_json(rows, args.json_out, args.json):
        print_rows(rows, args.repeats)
        print_dtype_ratios(rows)


if __name__ == "__main__":
    main()
