"""KV transfer throughput: per-layer vs cross-layer vs run merging, and KV-cache groups (windows).

Two processes: a synthetic owner (``bench.kv_synthetic``: pattern-free KV of a real model
shape, handshake over gRPC, NIXL agent) and this process as the reader (``KVPuller``: handshake,
plan, READ). Each owner has a process of its own; ``--quick`` serves every owner of every scenario
from one (``bench.transfer_owners``), started before the first pull: there a process's start-up
takes seconds, its pulls milliseconds. Three scenarios (``--scenario``, default all):

``layouts``: Llama-3.1-8B KV shape; for each prompt length, every case moves the same bytes:

  per_layer         per-layer layout, fragmented pool (every other block): 2 * layers descriptors per block
  cross_layer       cross-layer layout, fragmented pool: one descriptor per block
  cross_layer_runs  cross-layer layout, contiguous blocks: adjacent blocks merged into runs
  raw               one NIXL READ of a single descriptor of the same size (the ceiling)

``groups``: hybrid models (sliding-window layers + full layers, each kind its own KV-cache group
with its own KV shape), cross-layer layout, a fragmented owner pool (its block table runs
backwards, so no two blocks merge: one descriptor per block and group):

  groups            the model's groups: sliding groups move only the blocks covering the window
  all_full          the same shapes with every layer full attention: every block of every layer
  ideal             computed, not pulled: full layers every block, sliding layers the blocks
                    covering the last window (first block: (tokens - window) // block_size)

``tp``: Llama-3.1-8B KV shape, one ``--tp-tokens`` prompt in contiguous blocks, read between a
prefill (P) and a decode (D) engine of different TP sizes (``--tp-pairs``: P:D, the homogeneous 1:1
always runs as the baseline), per KV layout (``--tp-layouts``) and block order (``--tp-orders``; the
heads-outer layout holds HND blocks only). Each side has one NIXL agent and one KV shard per TP rank;
the puller reads each local rank's heads from the remote ranks that hold them
(``services.kv.spec.topology.rank_reads``), one READ per (local rank, remote rank). Every pair must move
the prompt's whole KV, every head exactly once (asserted). The block ids run consecutively on both
sides, as the free-run allocators hand them out in service, and each pool holds one block more than
the prompt, so (as in service) no pull covers a whole pool. A head slice of a cross-layer block is one
descriptor per (token, layer, K/V) in NHD order and per (layer, K/V) in HND; in the heads-outer layout a
head's plane holds every block, so a READ is one descriptor per head it reads (4 for TP 1 -> 2), and
equal TP sizes take one per head too (8 at 1:1) where cross-layer takes one in all. Each row prints its
time and descriptors beside the same layout's 1:1 pull, and a summary compares each mixed pair's
heads-outer pull with cross-layer HND of the same pair and with cross-layer's 1:1 pull (equal TP
sizes, which ``--kv-layout auto`` serves cross-layer).

Devices: ``--device`` (cpu or cuda) puts every rank of both sides there; ``--owner-devices`` and
``--reader-devices`` (comma lists, rank i takes entry i mod len) place each rank, e.g. the owner on
GPU 0 and the reader on GPU 1, or TP 2 across both GPUs. Reading VRAM needs UCX's cuda_ipc GET
(``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``, set here for both processes unless already set).

    python bench/transfer.py                    # CPU (DRAM), every scenario, bf16
    python bench/transfer.py --scenario groups  # hybrid shapes only, 8k-token prompt
    python bench/transfer.py --scenario tp      # TP pairs, 8k-token prompt, cross-layer NHD/HND, heads-outer
    python bench/transfer.py --scenario tp --device cuda --tp-pairs 1:2,2:1 --tp-orders HND  # ranks share GPU 0
    python bench/transfer.py --device cuda      # VRAM, two processes on one GPU
    python bench/transfer.py --scenario tp --owner-devices cuda:0,cuda:1 --reader-devices cuda:1 --tp-pairs 2:1
    python bench/transfer.py --quick --json     # < 1 min on the CI machine, JSON lines
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: ``python -m bench.kv_synthetic`` runs there
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import services  # noqa: E402,F401,I001
from bench._common import emit_json  # noqa: E402
from bench.kv_synthetic import group_shapes, identity_for, layout_for  # noqa: E402
from services.engine.kv_cache.buffers import KVCache  # noqa: E402
from services.kv.nixl.agent import CUDA_IPC_GET_ENV, TransferAgent  # noqa: E402
from services.kv.nixl.errors import TransferError  # noqa: E402
from services.kv.ranks.kv_rank import LocalKVRank  # noqa: E402
from services.kv.reader.puller import KVPuller  # noqa: E402
from services.kv.spec.compat import KVIdentity  # noqa: E402
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec  # noqa: E402
from services.kv.spec.layout import BlockOrder, LayoutKind  # noqa: E402
from services.proto_gen.pdserve.v1 import kv_pb2  # noqa: E402

# Llama-3.1-8B KV shape: one 16-token block is 32 KiB per layer and K/V, 2 MiB across layers.
SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16, order="NHD")
CASES = {"per_layer": ("per_layer", 2), "cross_layer": ("cross_layer", 2), "cross_layer_runs": ("cross_layer", 1)}

# Hybrid shapes: (layers, period: one full layer after period - 1 sliding ones, window,
# (sliding KV heads, head dim), (full KV heads, head dim)). Gemma-3-12B: 48 layers, 5 sliding
# (window 1024) per full, 8 KV heads of 256 everywhere. The Gemma-4-like shape is illustrative:
# the same layout of layers, window 512, and full layers with fewer but twice as wide heads.
GROUP_SHAPES = {
    "gemma3-12b-like": dict(num_layers=48, period=6, window=1024, sliding=(8, 256), full=(8, 256)),
    "gemma4-like": dict(num_layers=48, period=6, window=512, sliding=(8, 256), full=(4, 512)),
}
QUICK_GROUP_SHAPES = {  # a tiny hybrid for the CI smoke run: per-group shapes, a window not a block multiple
    "tiny-gemma4-like": dict(num_layers=6, period=6, window=40, sliding=(2, 32), full=(1, 64)),
}
GROUP_BLOCK_SIZE = 16
TP_PAIRS = "1:1,2:2,1:2,2:1,4:4,1:4,4:1"  # P tp : D tp (8 KV heads: every TP size up to 8 shards evenly)
QUICK_TP_PAIRS = "1:1,2:2,1:2,2:1"
QUICK_TP_TOKENS = 256


def rank_devices(names: list[str], tp: int) -> list[str]:
    """The device of each of ``tp`` ranks: rank i takes ``names[i % len(names)]``."""
    return [names[rank % len(names)] for rank in range(tp)]


def make_ranks(layout, devices: list[str], prefix: str, staging_bytes: int = 0) -> list[LocalKVRank]:
    """One reader rank per device: its own KV cache and NIXL agent, allocated and registered on that device (and a
    KV staging area of ``staging_bytes``)."""
    ranks = []
    for device in map(torch.device, devices):
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device.index)  # the rank's allocation, CUDA context and NIXL registration
        cache = KVCache(layout, device)
        agent = TransferAgent(f"{prefix}-{uuid.uuid4().hex[:6]}", device=device.type)
        ranks.append(LocalKVRank(agent, layout, cache.buffers, staging_bytes=staging_bytes))  # kept alive by agent
    return ranks


def block_ids(num_blocks: int, stride: int) -> list[int]:
    return list(range(0, num_blocks * stride, stride))


def layout_owner_cfgs(num_blocks: int, tokens: list[int], devices: list[str]) -> list[dict]:
    """The synthetic owner of each layouts case, in ``CASES`` order: a ticket per prompt length and block stride."""
    requests = []
    for n in tokens:
        blocks = -(-n // SHAPE["block_size"])
        for stride in (1, 2):
            requests.append({"request_id": f"{n}-{stride}", "num_tokens": n, "block_ids": [block_ids(blocks, stride)]})
    return [{**SHAPE, "kind": kind, "num_blocks": num_blocks, "engine_id": f"bench-{case}", "tp": 1, "reader_tp": 1,
             "seed": 0, "fill": "none", "devices": devices, "requests": requests} for case, (kind, _) in CASES.items()]


class OwnerProcess:
    """A synthetic owner process serving one config (``bench.kv_synthetic``) or several
    (``bench.transfer_owners``), started at once; ``hello(engine_id)`` waits for that engine's first line."""

    def __init__(self, cfgs: list[dict]) -> None:
        module = "bench.kv_synthetic" if len(cfgs) == 1 else "bench.transfer_owners"
        arg = cfgs[0] if len(cfgs) == 1 else cfgs
        self.proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(arg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=ROOT)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self._lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self._engines = [cfg["engine_id"] for cfg in cfgs]
        self._hellos: dict[str, dict] = {}
        self._running = set(self._engines)

    def hello(self, engine_id: str) -> dict:
        while engine_id not in self._hellos:
            line = self._lines.get(timeout=120)
            if line.startswith("{") and "tickets" in (hello := json.loads(line)):  # not a "released" line
                self._hellos[self._engines[0] if len(self._engines) == 1 else engine_of(hello)] = hello
        return self._hellos[engine_id]

    def release(self, engine_id: str) -> bool:
        """True once: when the last engine it serves is released (the process may stop)."""
        if engine_id not in self._running:
            return False
        self._running.discard(engine_id)
        return not self._running


def engine_of(hello: dict) -> str:
    """The engine a hello line is from: its tickets name it (one process may serve several engines)."""
    ticket = next(iter(hello["tickets"].values()))
    return kv_pb2.TransferTicket.FromString(bytes.fromhex(ticket)).engine_id


class Owner:
    """One synthetic owner engine: in a process of its own, started at once, or in ``process`` beside others.
    ``hello()`` waits for its first line; ``stop()`` ends its process once every engine there is stopped."""

    def __init__(self, cfg: dict, process: OwnerProcess | None = None) -> None:
        self.engine_id = cfg["engine_id"]
        self.process = process or OwnerProcess([cfg])

    def hello(self) -> dict:
        return self.process.hello(self.engine_id)

    def stop(self) -> None:
        stop_all([self])


class OwnerStarter:
    """Starts the synthetic owners a scenario asks for, each in a process of its own, or (``shared``: the CI
    smoke run, where a process's imports and NIXL start-up cost far more than its pulls) all in one.
    ``prestart`` starts every scenario's owners at once, so one start-up serves them all."""

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self._prestarted: dict[str, Owner] = {}

    def prestart(self, cfgs: list[dict]) -> None:
        self._prestarted.update((owner.engine_id, owner) for owner in self._launch(cfgs))

    def start(self, cfgs: list[dict]) -> list[Owner]:
        """An owner per config, in order: the prestarted as they are, the rest started before the first is
        waited for, so their start-ups overlap."""
        fresh = iter(self._launch([cfg for cfg in cfgs if cfg["engine_id"] not in self._prestarted]))
        return [self._prestarted.pop(cfg["engine_id"], None) or next(fresh) for cfg in cfgs]

    def _launch(self, cfgs: list[dict]) -> list[Owner]:
        if not (self.shared and cfgs):
            return [Owner(cfg) for cfg in cfgs]
        process = OwnerProcess(cfgs)
        return [Owner(cfg, process) for cfg in cfgs]


def stop_all(owners: list[Owner]) -> None:
    """Stop every owner; close the stdin of each process they leave with no engine running first, then
    wait: their exits (NIXL teardown) overlap."""
    done = [owner.process for owner in owners if owner.process.release(owner.engine_id)]
    for process in done:
        process.proc.stdin.close()
    for process in done:
        process.proc.wait(timeout=60)


def make_reader(kind: str, num_blocks: int, devices: list[str]) -> tuple[KVPuller, TransferAgent]:
    cfg = {**SHAPE, "kind": kind, "num_blocks": num_blocks}
    layout = layout_for(cfg, 1)
    (rank,) = make_ranks(layout, rank_devices(devices, 1), "bench-reader")
    agent = rank.agent
    identity = KVIdentity.of(architecture="llama", num_layers=SHAPE["num_layers"], num_kv_heads=SHAPE["num_kv_heads"],
                             head_dim=SHAPE["head_dim"], layout=layout)
    # Each ticket is pulled again and again (the timing repeats): the ticket checks would refuse the second pull.
    puller = KVPuller(engine_id="bench-reader", identity=identity, ranks=[rank], transfer_timeout_s=120,
                      check_tickets=False)
    return puller, agent


async def time_pull(puller: KVPuller, ticket: kv_pb2.TransferTicket, local_ids: list[int], repeats: int) -> tuple:
    await puller.pull(ticket, [local_ids])  # handshake + warm-up
    best = None
    for _ in range(repeats):
        result = await puller.pull(ticket, [local_ids])
        if best is None or result.seconds < best.seconds:
            best = result
    return best


async def time_raw(puller: KVPuller, agent: TransferAgent, ticket: kv_pb2.TransferTicket, num_bytes: int,
                   repeats: int) -> float:
    remote = puller.peers.cached(ticket.engine_id, ticket.epoch)
    owner = remote.ranks[0]
    src = owner.regions[0]
    dst = agent.regions[0]
    peer = agent.add_peer(owner.agent_metadata)
    remote_rows = np.array([[src.address, num_bytes, src.device_id]], dtype=np.uint64)
    local_rows = np.array([[dst.addr, num_bytes, dst.device_id]], dtype=np.uint64)
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        await agent.read(peer, local_rows, remote_rows, b"", dst.mem_kind, remote_mem_kind=src.kind, timeout_s=120)
        best = min(best, time.perf_counter() - t)
    return best


# ---- groups scenario ---------------------------------------------------------------------------


def hybrid_cfg(shape: dict, all_full: bool) -> dict:
    """A synthetic-owner config of a hybrid shape: group 0 the sliding layers, group 1 the full ones
    (as the engine numbers groups by first layer). ``all_full`` makes the sliding group full attention."""
    period = shape["period"]
    layers = range(shape["num_layers"])
    sliding = [i for i in layers if i % period != period - 1]
    full = [i for i in layers if i % period == period - 1]
    (s_heads, s_dim), (f_heads, f_dim) = shape["sliding"], shape["full"]
    first = {"kind": "full"} if all_full else {"kind": "sliding_window", "window": shape["window"]}
    return {
        "num_layers": shape["num_layers"], "num_kv_heads": s_heads, "head_dim": s_dim, "dtype": "bfloat16",
        "block_size": GROUP_BLOCK_SIZE, "order": "NHD", "kind": "cross_layer",
        "groups": [{**first, "layers": sliding}, {"kind": "full", "layers": full, "num_kv_heads": f_heads,
                                                  "head_dim": f_dim}],
    }


def ideal(cfg: dict, window: int, num_tokens: int) -> tuple[int, int]:
    """(bytes, descriptors) of the ideal pull: full layers every block, sliding layers the blocks covering
    the window; one descriptor per block and group (the owner's pool is fragmented)."""
    num_bytes = descriptors = 0
    for gid, g in enumerate(group_shapes(cfg)):
        spec = KVCacheGroupSpec(gid, AttentionKind.SLIDING_WINDOW, tuple(g["layers"]), g["block_size"], window)
        blocks = spec.num_blocks_for(num_tokens) - (spec.first_needed_block(num_tokens) if gid == 0 else 0)
        num_bytes += blocks * g["block_size"] * len(g["layers"]) * 2 * g["num_kv_heads"] * g["head_dim"] * 2
        descriptors += blocks
    return num_bytes, descriptors


def group_owner_cfgs(name: str, shape: dict, num_tokens: int, owner_devices: list[str]) -> dict[str, dict]:
    """The synthetic owner of each variant pulled of a hybrid shape, its pool fragmented."""
    num_blocks = -(-num_tokens // GROUP_BLOCK_SIZE)
    owner_ids = block_ids(num_blocks, 1)[::-1]  # backwards: no two blocks merge
    request = {"request_id": "g", "num_tokens": num_tokens, "block_ids": [owner_ids, owner_ids]}
    return {variant: {**hybrid_cfg(shape, all_full=variant == "all_full"), "num_blocks": num_blocks + 1,
                      "engine_id": f"bench-{name}-{variant}", "tp": 1, "reader_tp": 1, "seed": 0, "fill": "none",
                      "devices": owner_devices, "requests": [request]}
            for variant in ("groups", "all_full")}


def run_groups(shapes: dict[str, dict], num_tokens: int, repeats: int, device: str, owner_devices: list[str],
               reader_devices: list[str], starter: OwnerStarter) -> list[dict]:
    rows = []
    num_blocks = -(-num_tokens // GROUP_BLOCK_SIZE)
    for name, shape in shapes.items():
        measured = {}
        cfgs = group_owner_cfgs(name, shape, num_tokens, owner_devices)
        owners = dict(zip(cfgs, starter.start(list(cfgs.values())), strict=True))
        for variant, cfg in cfgs.items():
            try:
                hello = owners[variant].hello()
                layout = layout_for(cfg, 1)
                ranks = make_ranks(layout, rank_devices(reader_devices, 1), "bench-reader")
                puller = KVPuller(engine_id="bench-reader", identity=identity_for(cfg, layout),
                                  ranks=ranks, transfer_timeout_s=120, check_tickets=False)  # pulled repeatedly
                ticket = kv_pb2.TransferTicket.FromString(bytes.fromhex(hello["tickets"]["g"]))
                local = block_ids(num_blocks, 1)
                measured[variant] = asyncio.run(time_pull_groups(puller, ticket, [local, local], repeats))
                for rank in ranks:
                    rank.agent.close()
            finally:
                owners[variant].stop()
        ideal_bytes, ideal_descs = ideal(hybrid_cfg(shape, all_full=False), shape["window"], num_tokens)
        full_bytes = measured["all_full"].num_bytes
        full_descs = measured["all_full"].num_descriptors
        for variant, r in (*measured.items(), ("ideal", None)):
            num_bytes = r.num_bytes if r else ideal_bytes
            descs = r.num_descriptors if r else ideal_descs
            rows.append(dict(
                scenario="groups", device=device, owner_devices=owner_devices[:1], reader_devices=reader_devices[:1],
                shape=name, layout=variant, tokens=num_tokens,
                window=shape["window"], bytes=num_bytes, descriptors=descs,
                seconds=r.seconds if r else None, gbps=r.num_bytes / r.seconds / 1e9 if r else None,
                bytes_vs_ideal=num_bytes / ideal_bytes, descriptors_vs_ideal=descs / ideal_descs,
                bytes_vs_all_full=num_bytes / full_bytes, descriptors_vs_all_full=descs / full_descs,
            ))
    return rows


async def time_pull_groups(puller: KVPuller, ticket: kv_pb2.TransferTicket, local_ids: list[list[int]],
                           repeats: int):
    await puller.pull(ticket, local_ids)  # handshake + warm-up
    best = None
    for _ in range(repeats):
        result = await puller.pull(ticket, local_ids)
        if best is None or result.seconds < best.seconds:
            best = result
    return best


def placement(row: dict) -> str:
    """"cpu", or where each side's ranks sit when the devices were given per side: "cuda:0 -> cuda:1"."""
    owner, reader = row["owner_devices"], row["reader_devices"]
    return row["device"] if set(owner) | set(reader) == {row["device"]} else f"{','.join(owner)} -> {','.join(reader)}"


def print_groups(rows: list[dict], repeats: int) -> None:
    if not rows:
        return
    print(f"\n# KV transfer by KV-cache group, {placement(rows[0])}, cross-layer, bf16, block {GROUP_BLOCK_SIZE}, "
          f"fragmented owner pool, best of {repeats}")
    print(f"{'shape':>17} {'tokens':>7} {'window':>6} {'variant':>9} {'MiB':>9} {'descs':>6} {'ms':>8} {'GB/s':>6} "
          f"{'bytes/ideal':>11} {'descs/ideal':>11} {'bytes/all_full':>14}")
    for r in rows:
        ms = f"{r['seconds'] * 1e3:8.2f}" if r["seconds"] is not None else f"{'-':>8}"
        gbps = f"{r['gbps']:6.2f}" if r["gbps"] is not None else f"{'-':>6}"
        print(f"{r['shape']:>17} {r['tokens']:>7} {r['window']:>6} {r['layout']:>9} {r['bytes'] / 2**20:>9.1f} "
              f"{r['descriptors']:>6} {ms} {gbps} {r['bytes_vs_ideal']:>11.3f} {r['descriptors_vs_ideal']:>11.3f} "
              f"{r['bytes_vs_all_full']:>14.3f}")


# ---- tp scenario -------------------------------------------------------------------------------


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """"1:1,2:1" -> [(1, 1), (2, 1)] (P tp, D tp), the 1:1 baseline first and added when missing."""
    pairs = [tuple(int(x) for x in p.split(":")) for p in text.split(",") if p.strip()]
    if any(len(p) != 2 or min(p) < 1 or SHAPE["num_kv_heads"] % max(p) for p in pairs):
        raise ValueError(f"--tp-pairs {text!r}: want P:D pairs of TP sizes that divide {SHAPE['num_kv_heads']}")
    return [(1, 1)] + [p for p in dict.fromkeys(pairs) if p != (1, 1)]


def tp_kv_bytes(num_tokens: int) -> int:
    """The prompt's whole KV, every head of every layer once (whole blocks: the tokens fill them)."""
    blocks = -(-num_tokens // SHAPE["block_size"])
    return blocks * SHAPE["block_size"] * SHAPE["num_layers"] * 2 * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * 2


def tp_layouts(kinds: list[str], orders: list[str]) -> list[tuple[str, str]]:
    """(layout kind, block order) of the tp scenario: every kind with every order it can hold."""
    return [(kind, order) for kind in kinds for order in orders if BlockOrder(order) in LayoutKind(kind).orders]


def tp_cfgs(layouts: list[tuple[str, str]], num_tokens: int) -> dict[tuple[str, str], dict]:
    """The KV shape of each (layout kind, block order) of the tp scenario. One block more than the prompt: no
    pull covers a whole pool (which would merge a heads-outer pull's head planes into one run, a case service
    pools, far larger than a prompt, never see)."""
    num_blocks = -(-num_tokens // SHAPE["block_size"])
    return {(kind, order): {**SHAPE, "order": order, "kind": kind, "num_blocks": num_blocks + 1}
            for kind, order in layouts}


def tp_owner_cfgs(pairs: list[tuple[int, int]], layouts: list[tuple[str, str]], num_tokens: int,
                  owner_devices: list[str]) -> dict[tuple[str, str, int], dict]:
    """The synthetic owner of each (layout kind, block order, P tp): a ticket per D tp it is read into."""
    ids = block_ids(-(-num_tokens // SHAPE["block_size"]), 1)
    owner_cfgs = {}
    for (kind, order), cfg in tp_cfgs(layouts, num_tokens).items():
        for p_tp in dict.fromkeys(p for p, _ in pairs):
            requests = [{"request_id": f"d{d_tp}", "num_tokens": num_tokens, "block_ids": [ids], "reader_tp": d_tp}
                        for d_tp in dict.fromkeys(d for p, d in pairs if p == p_tp)]
            owner_cfgs[kind, order, p_tp] = {
                **cfg, "engine_id": f"bench-tp{p_tp}-{kind}-{order}", "tp": p_tp, "reader_tp": 1, "seed": 0,
                "fill": "none", "devices": rank_devices(owner_devices, p_tp), "requests": requests,
            }
    return owner_cfgs


def run_tp(pairs: list[tuple[int, int]], layouts: list[tuple[str, str]], num_tokens: int, repeats: int, device: str,
           owner_devices: list[str], reader_devices: list[str], starter: OwnerStarter) -> list[dict]:
    rows = []
    num_blocks = -(-num_tokens // SHAPE["block_size"])
    ids = block_ids(num_blocks, 1)  # consecutive on both sides, as in service: runs merge across blocks
    expected = tp_kv_bytes(num_tokens)
    cfgs = tp_cfgs(layouts, num_tokens)
    owner_cfgs = tp_owner_cfgs(pairs, layouts, num_tokens, owner_devices)  # (kind, order, P tp) -> config
    owners = dict(zip(owner_cfgs, starter.start(list(owner_cfgs.values())), strict=True))
    try:
        for (kind, order), cfg in cfgs.items():
            readers, agents = {}, []
            for d_tp in dict.fromkeys(d for _, d in pairs):
                layout = layout_for(cfg, d_tp)
                ranks = make_ranks(layout, rank_devices(reader_devices, d_tp), f"bench-reader-tp{d_tp}")
                agents += [rank.agent for rank in ranks]
                readers[d_tp] = KVPuller(engine_id=f"bench-reader-tp{d_tp}", identity=identity_for(cfg, layout),
                                         ranks=ranks, transfer_timeout_s=120, check_tickets=False)  # repeated
            base = None
            for p_tp, d_tp in pairs:
                row = dict(scenario="tp", device=device, layout=kind, order=order, tokens=num_tokens,
                           p_tp=p_tp, d_tp=d_tp, owner_devices=rank_devices(owner_devices, p_tp),
                           reader_devices=rank_devices(reader_devices, d_tp), kv_bytes=expected)
                hello = owners[kind, order, p_tp].hello()
                ticket = kv_pb2.TransferTicket.FromString(bytes.fromhex(hello["tickets"][f"d{d_tp}"]))
                try:
                    r = asyncio.run(time_pull(readers[d_tp], ticket, ids, repeats))
                except TransferError as exc:  # keep the other pairs' figures; main() exits non-zero
                    print(f"P tp{p_tp} -> D tp{d_tp} ({kind} {order}) failed: {exc}", file=sys.stderr)
                    rows.append({**row, "bytes": None, "descriptors": None, "reads": None, "seconds": None,
                                 "gbps": None, "gbps_vs_tp1": None, "seconds_vs_tp1": None, "tp1_descriptors": None,
                                 "error": str(exc)[:500]})
                    continue
                assert r.num_bytes == expected, (f"P tp{p_tp} -> D tp{d_tp} ({kind} {order}) moved {r.num_bytes} "
                                                 f"bytes, the prompt's KV is {expected}")
                gbps = r.num_bytes / r.seconds / 1e9
                if (p_tp, d_tp) == (1, 1):
                    base = r
                rows.append({**row, "bytes": r.num_bytes, "descriptors": r.num_descriptors, "reads": r.num_reads,
                             "seconds": r.seconds, "gbps": gbps,
                             "gbps_vs_tp1": gbps / (base.num_bytes / base.seconds / 1e9) if base else None,
                             "seconds_vs_tp1": r.seconds / base.seconds if base else None,
                             "tp1_descriptors": base.num_descriptors if base else None})
            for agent in agents:
                agent.close()
    finally:
        stop_all(list(owners.values()))
    return rows


def print_tp(rows: list[dict], repeats: int) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"\n# KV transfer across TP sizes, {r0['device']}, Llama-3.1-8B KV shape (8 KV heads, bf16, block 16), "
          f"{r0['tokens']} tokens ({r0['kv_bytes'] / 2**20:.1f} MiB), best of {repeats}; 'vs 1->1': the same "
          "layout's 1:1 pull")
    print(f"{'layout':>11} {'order':>5} {'P tp':>4} {'D tp':>4} {'P devices':>16} {'D devices':>16} {'MiB':>8} "
          f"{'descs':>8} {'1->1 descs':>10} {'reads':>5} {'ms':>9} {'GB/s':>7} {'ms vs 1->1':>10}")
    for r in rows:
        head = f"{r['layout']:>11} {r['order']:>5} {r['p_tp']:>4} {r['d_tp']:>4} {','.join(r['owner_devices']):>16} " \
               f"{','.join(r['reader_devices']):>16}"
        if r.get("error"):
            print(f"{head} failed: {r['error'][:120]}")
            continue
        ratio = f"{r['seconds_vs_tp1']:>9.2f}x" if r["seconds_vs_tp1"] is not None else f"{'-':>10}"
        base = r["tp1_descriptors"] if r["tp1_descriptors"] is not None else "-"
        print(f"{head} {r['bytes'] / 2**20:>8.1f} {r['descriptors']:>8} {base:>10} {r['reads']:>5} "
              f"{r['seconds'] * 1e3:>9.2f} {r['gbps']:>7.2f} {ratio}")
    print_tp_summary(rows)


def print_tp_summary(rows: list[dict]) -> None:
    """Per mixed pair: the heads-outer pull beside equal TP (1:1 of the same layout, and of cross-layer: what
    equal TP sizes are served with) and beside cross-layer HND's pull of the same pair."""
    ok = {(r["layout"], r["order"], r["p_tp"], r["d_tp"]): r for r in rows if not r.get("error")}
    mixed = sorted({(p, d) for _, _, p, d in ok if p != d})
    heads = [(p, d, ok.get(("heads_outer", "HND", p, d)), ok.get(("cross_layer", "HND", p, d))) for p, d in mixed]
    heads = [h for h in heads if h[2] is not None]
    if not heads:
        return
    equal = ok.get(("cross_layer", "HND", 1, 1)) or ok.get(("cross_layer", "NHD", 1, 1))
    print("\n# mixed TP: heads_outer vs equal TP (1:1: heads_outer, and cross_layer) and vs cross_layer HND, same pair")
    print(f"{'P tp':>4} {'D tp':>4} {'descs':>8} {'1->1 descs':>10} {'ms':>9} {'1->1 ms':>9} {'x 1->1':>7} "
          f"{'x cross 1->1':>12} {'cross descs':>11} {'cross ms':>9} {'cross/heads':>11}")
    for p, d, r, cross in heads:
        tp1 = r["seconds"] / r["seconds_vs_tp1"]
        x_equal = f"{r['seconds'] / equal['seconds']:>11.2f}x" if equal else f"{'-':>12}"
        c_descs = f"{cross['descriptors']:>11}" if cross else f"{'-':>11}"
        c_ms = f"{cross['seconds'] * 1e3:>9.2f}" if cross else f"{'-':>9}"
        c_ratio = f"{cross['seconds'] / r['seconds']:>10.1f}x" if cross else f"{'-':>11}"
        print(f"{p:>4} {d:>4} {r['descriptors']:>8} {r['tp1_descriptors']:>10} {r['seconds'] * 1e3:>9.2f} "
              f"{tp1 * 1e3:>9.2f} {r['seconds_vs_tp1']:>6.2f}x {x_equal} {c_descs} {c_ms} {c_ratio}")


def device_list(text: str | None, default: str) -> list[str]:
    names = [d.strip() for d in (text or default).split(",") if d.strip()]
    for name in names:
        try:
            kind = torch.device(name).type
        except RuntimeError:
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device {name!r}: only cpu, cuda and cuda:N")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--owner-devices", default=None,
                    help="comma list, one per owner (prefill) rank, rank i takes entry i mod len; default --device")
    ap.add_argument("--reader-devices", default=None,
                    help="comma list, one per reader (decode) rank, rank i takes entry i mod len; default --device")
    ap.add_argument("--tokens", default="1024,4096,8192", help="prompt lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenario", default="layouts,groups,tp", help="comma-separated: layouts, groups, tp")
    ap.add_argument("--group-tokens", type=int, default=8192, help="prompt length of the groups scenario")
    ap.add_argument("--tp-tokens", type=int, default=None,
                    help=f"prompt length of the tp scenario (default 8192, --quick {QUICK_TP_TOKENS})")
    ap.add_argument("--tp-pairs", default=None,
                    help=f"P:D TP sizes of the tp scenario, 1:1 always runs (default {TP_PAIRS}, "
                    f"--quick {QUICK_TP_PAIRS})")
    ap.add_argument("--tp-layouts", default="cross_layer,heads_outer",
                    help="KV layout kinds of the tp scenario (heads_outer runs with HND blocks only)")
    ap.add_argument("--tp-orders", default="NHD,HND", help="block orders of the tp scenario")
    ap.add_argument("--quick", action="store_true", help="small prompts, one repeat (CI smoke run)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case per line")
    ap.add_argument("--json-out", default=None, help="also write the JSON lines to this file")
    args = ap.parse_args()
    tokens = [256, 1024] if args.quick else [int(t) for t in args.tokens.split(",")]
    repeats = 1 if args.quick else args.repeats
    num_blocks = 2 * -(-max(tokens) // SHAPE["block_size"]) + 1
    scenarios = set(args.scenario.split(","))
    if not scenarios <= {"layouts", "groups", "tp"}:
        ap.error(f"unknown scenario in {args.scenario!r}")
    try:
        owner_devices = device_list(args.owner_devices, args.device)
        reader_devices = device_list(args.reader_devices, args.device)
        pairs = parse_pairs(args.tp_pairs or (QUICK_TP_PAIRS if args.quick else TP_PAIRS))
    except ValueError as exc:
        ap.error(str(exc))
    orders, kinds = args.tp_orders.split(","), args.tp_layouts.split(",")
    if not set(orders) <= {o.value for o in BlockOrder}:
        ap.error(f"unknown block order in {args.tp_orders!r}")
    if not set(kinds) <= {k.value for k in LayoutKind}:
        ap.error(f"unknown KV layout in {args.tp_layouts!r}")
    layouts = tp_layouts(kinds, orders)
    if "tp" in scenarios and not layouts:
        ap.error(f"no layout of --tp-layouts {args.tp_layouts} holds --tp-orders {args.tp_orders}")
    tp_tokens = args.tp_tokens or (QUICK_TP_TOKENS if args.quick else 8192)
    if tp_tokens < 1 or tp_tokens % SHAPE["block_size"]:
        ap.error(f"--tp-tokens must be a positive multiple of the block size {SHAPE['block_size']}")
    if any(torch.device(d).type == "cuda" for d in owner_devices + reader_devices):
        args.device = "cuda"  # the rows' device: VRAM on at least one side
        # Reading VRAM needs UCX's cuda_ipc GET (TransferAgent sets it too); set before the owners start.
        os.environ.setdefault(CUDA_IPC_GET_ENV, "y")

    shapes = QUICK_GROUP_SHAPES if args.quick else GROUP_SHAPES
    group_tokens = 512 if args.quick else args.group_tokens
    starter = OwnerStarter(shared=args.quick)
    if args.quick:  # every scenario's owners in one process, started before the first pull
        cfgs = layout_owner_cfgs(num_blocks, tokens, owner_devices) if "layouts" in scenarios else []
        if "groups" in scenarios:
            cfgs += [cfg for name, shape in shapes.items()
                     for cfg in group_owner_cfgs(name, shape, group_tokens, owner_devices).values()]
        if "tp" in scenarios:
            cfgs += tp_owner_cfgs(pairs, layouts, tp_tokens, owner_devices).values()
        starter.prestart(cfgs)

    rows = []
    owners = dict(zip(CASES, starter.start(layout_owner_cfgs(num_blocks, tokens, owner_devices)), strict=True)) \
        if "layouts" in scenarios else {}
    for case, (kind, stride) in CASES.items() if "layouts" in scenarios else ():
        owner = owners[case]
        try:
            hello = owner.hello()
            puller, agent = make_reader(kind, num_blocks, reader_devices)
            for n in tokens:
                ticket = kv_pb2.TransferTicket.FromString(bytes.fromhex(hello["tickets"][f"{n}-{stride}"]))
                local = block_ids(-(-n // SHAPE["block_size"]), stride)
                r = asyncio.run(time_pull(puller, ticket, local, repeats))
                rows.append(dict(scenario="layouts", device=args.device, owner_devices=owner_devices[:1],
                                 reader_devices=reader_devices[:1], layout=case, tokens=n, bytes=r.num_bytes,
                                 descriptors=r.num_descriptors, seconds=r.seconds, gbps=r.num_bytes / r.seconds / 1e9))
                if case == "cross_layer_runs":
                    raw_s = asyncio.run(time_raw(puller, agent, ticket, r.num_bytes, repeats))
                    rows.append(dict(scenario="layouts", device=args.device, owner_devices=owner_devices[:1],
                                     reader_devices=reader_devices[:1], layout="raw", tokens=n,
                                     bytes=r.num_bytes, descriptors=1, seconds=raw_s, gbps=r.num_bytes / raw_s / 1e9))
            agent.close()
        finally:
            owner.stop()

    group_rows = []
    if "groups" in scenarios:
        group_rows = run_groups(shapes, group_tokens, repeats, args.device, owner_devices, reader_devices, starter)

    tp_rows = run_tp(pairs, layouts, tp_tokens, repeats, args.device, owner_devices, reader_devices, starter) \
        if "tp" in scenarios else []

    failed = sum(1 for r in tp_rows if r.get("error"))
    if not emit_json(rows + group_rows + tp_rows, args.json_out, args.json):
        print_layouts(rows, repeats)
        print_groups(group_rows, repeats)
        print_tp(tp_rows, repeats)
    if failed:
        sys.exit(f"{failed} TP pair(s) failed")


def print_layouts(rows: list[dict], repeats: int) -> None:
    if not rows:
        return
    print(f"# KV transfer, {placement(rows[0])}, Llama-3.1-8B KV shape (bf16, block 16), best of {repeats}")
    print(f"{'tokens':>7} {'layout':>17} {'MiB':>8} {'descs':>7} {'ms':>9} {'GB/s':>8} {'vs raw':>7}")
    raw = {r["tokens"]: r["seconds"] for r in rows if r["layout"] == "raw"}
    for r in sorted(rows, key=lambda r: (r["tokens"], list(CASES).index(r["layout"]) if r["layout"] in CASES else 9)):
        print(f"{r['tokens']:>7} {r['layout']:>17} {r['bytes'] / 2**20:>8.1f} {r['descriptors']:>7} "
              f"{r['seconds'] * 1e3:>9.2f} {r['gbps']:>8.2f} {r['seconds'] / raw[r['tokens']]:>6.1f}x")


if __name__ == "__main__":
    main()
