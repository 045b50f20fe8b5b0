"""KV transfer throughput: per-layer vs cross-layer vs run merging, and KV-cache groups (windows).

Two processes: a synthetic owner (``services.kv.synthetic``: pattern-free KV of a real model
shape, handshake over gRPC, NIXL agent) and this process as the reader (``KVPuller``: handshake,
plan, READ). Two scenarios (``--scenario``, default both):

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

    python bench/transfer.py                    # CPU (DRAM), both scenarios, bf16
    python bench/transfer.py --scenario groups  # hybrid shapes only, 8k-token prompt
    python bench/transfer.py --device cuda      # VRAM, two processes on one GPU
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import services  # noqa: E402,F401,I001
from bench._common import emit_json  # noqa: E402
from services.engine.kv_cache import KVCache  # noqa: E402
from services.kv.agent import TransferAgent  # noqa: E402
from services.kv.compat import CompatInfo, compat_fields  # noqa: E402
from services.kv.groups import AttentionKind, KVCacheGroupSpec  # noqa: E402
from services.kv.puller import KVPuller  # noqa: E402
from services.kv.rank import LocalKVRank  # noqa: E402
from services.kv.synthetic import compat_for, group_shapes, layout_for  # noqa: E402
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


def block_ids(num_blocks: int, stride: int) -> list[int]:
    return list(range(0, num_blocks * stride, stride))


def start_owner(kind: str, num_blocks: int, tokens: list[int], device: str) -> Owner:
    requests = []
    for n in tokens:
        blocks = -(-n // SHAPE["block_size"])
        for stride in (1, 2):
            requests.append({"request_id": f"{n}-{stride}", "num_tokens": n, "block_ids": [block_ids(blocks, stride)]})
    cfg = {**SHAPE, "kind": kind, "num_blocks": num_blocks, "engine_id": f"bench-{kind}", "tp": 1, "reader_tp": 1,
           "seed": 0, "fill": "none", "device": device, "requests": requests}
    return Owner(cfg)


class Owner:
    """A synthetic owner process, started at once; ``hello()`` waits for its first line. Owners are
    started before the first is waited for, so their start-ups (imports, NIXL) overlap."""

    def __init__(self, cfg: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "services.kv.synthetic", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self._lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self._hello: dict | None = None

    def hello(self) -> dict:
        while self._hello is None:
            line = self._lines.get(timeout=120)
            if line.startswith("{"):
                self._hello = json.loads(line)
        return self._hello

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def make_reader(kind: str, num_blocks: int, device: str) -> tuple[KVPuller, TransferAgent]:
    cfg = {**SHAPE, "kind": kind, "num_blocks": num_blocks}
    layout = layout_for(cfg, 1)
    cache = KVCache(layout, torch.device(device))
    agent = TransferAgent(f"bench-reader-{uuid.uuid4().hex[:6]}", device=device)
    compat = CompatInfo.of(compat_fields(architecture="llama", num_layers=SHAPE["num_layers"],
                                         num_kv_heads=SHAPE["num_kv_heads"], head_dim=SHAPE["head_dim"], layout=layout))
    puller = KVPuller(engine_id="bench-reader", compat=compat, num_kv_heads=SHAPE["num_kv_heads"],
                      ranks=[LocalKVRank(agent, layout, cache.buffers)], transfer_timeout_s=120)
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


def run_groups(shapes: dict[str, dict], num_tokens: int, repeats: int, device: str) -> list[dict]:
    rows = []
    num_blocks = -(-num_tokens // GROUP_BLOCK_SIZE)
    for name, shape in shapes.items():
        measured, cfgs, owners = {}, {}, {}
        owner_ids = block_ids(num_blocks, 1)[::-1]  # backwards: no two blocks merge
        request = {"request_id": "g", "num_tokens": num_tokens, "block_ids": [owner_ids, owner_ids]}
        for variant in ("groups", "all_full"):
            cfgs[variant] = {**hybrid_cfg(shape, all_full=variant == "all_full"), "num_blocks": num_blocks + 1}
            owners[variant] = Owner({**cfgs[variant], "engine_id": f"bench-{name}-{variant}", "tp": 1,
                                     "reader_tp": 1, "seed": 0, "fill": "none", "device": device,
                                     "requests": [request]})
        for variant, cfg in cfgs.items():
            try:
                hello = owners[variant].hello()
                layout = layout_for(cfg, 1)
                cache = KVCache(layout, torch.device(device))
                agent = TransferAgent(f"bench-reader-{uuid.uuid4().hex[:6]}", device=device)
                puller = KVPuller(engine_id="bench-reader", compat=compat_for(cfg, layout),
                                  num_kv_heads=cfg["num_kv_heads"], ranks=[LocalKVRank(agent, layout, cache.buffers)],
                                  transfer_timeout_s=120)
                ticket = kv_pb2.TransferTicket.FromString(bytes.fromhex(hello["tickets"]["g"]))
                local = block_ids(num_blocks, 1)
                measured[variant] = asyncio.run(time_pull_groups(puller, ticket, [local, local], repeats))
                agent.close()
                del cache
            finally:
                owners[variant].stop()
        ideal_bytes, ideal_descs = ideal(hybrid_cfg(shape, all_full=False), shape["window"], num_tokens)
        full_bytes = measured["all_full"].num_bytes
        full_descs = measured["all_full"].num_descriptors
        for variant, r in (*measured.items(), ("ideal", None)):
            num_bytes = r.num_bytes if r else ideal_bytes
            descs = r.num_descriptors if r else ideal_descs
            rows.append(dict(
                scenario="groups", device=device, shape=name, layout=variant, tokens=num_tokens,
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


def print_groups(rows: list[dict], repeats: int) -> None:
    if not rows:
        return
    print(f"\n# KV transfer by KV-cache group, {rows[0]['device']}, cross-layer, bf16, block {GROUP_BLOCK_SIZE}, "
          f"fragmented owner pool, best of {repeats}")
    print(f"{'shape':>17} {'tokens':>7} {'window':>6} {'variant':>9} {'MiB':>9} {'descs':>6} {'ms':>8} {'GB/s':>6} "
          f"{'bytes/ideal':>11} {'descs/ideal':>11} {'bytes/all_full':>14}")
    for r in rows:
        ms = f"{r['seconds'] * 1e3:8.2f}" if r["seconds"] is not None else f"{'-':>8}"
        gbps = f"{r['gbps']:6.2f}" if r["gbps"] is not None else f"{'-':>6}"
        print(f"{r['shape']:>17} {r['tokens']:>7} {r['window']:>6} {r['layout']:>9} {r['bytes'] / 2**20:>9.1f} "
              f"{r['descriptors']:>6} {ms} {gbps} {r['bytes_vs_ideal']:>11.3f} {r['descriptors_vs_ideal']:>11.3f} "
              f"{r['bytes_vs_all_full']:>14.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tokens", default="1024,4096,8192", help="prompt lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenario", default="layouts,groups", help="comma-separated: layouts, groups")
    ap.add_argument("--group-tokens", type=int, default=8192, help="prompt length of the groups scenario")
    ap.add_argument("--quick", action="store_true", help="small prompts, one repeat (CI smoke run)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case per line")
    ap.add_argument("--json-out", default=None, help="also write the JSON lines to this file")
    args = ap.parse_args()
    tokens = [256, 1024] if args.quick else [int(t) for t in args.tokens.split(",")]
    repeats = 1 if args.quick else args.repeats
    num_blocks = 2 * -(-max(tokens) // SHAPE["block_size"]) + 1
    scenarios = set(args.scenario.split(","))
    if not scenarios <= {"layouts", "groups"}:
        ap.error(f"unknown scenario in {args.scenario!r}")

    rows = []
    owners = {case: start_owner(kind, num_blocks, tokens, args.device) for case, (kind, _) in CASES.items()} \
        if "layouts" in scenarios else {}
    for case, (kind, stride) in CASES.items() if "layouts" in scenarios else ():
        owner = owners[case]
        try:
            hello = owner.hello()
            puller, agent = make_reader(kind, num_blocks, args.device)
            for n in tokens:
                ticket = kv_pb2.TransferTicket.FromString(bytes.fromhex(hello["tickets"][f"{n}-{stride}"]))
                local = block_ids(-(-n // SHAPE["block_size"]), stride)
                r = asyncio.run(time_pull(puller, ticket, local, repeats))
                rows.append(dict(scenario="layouts", device=args.device, layout=case, tokens=n, bytes=r.num_bytes,
                                 descriptors=r.num_descriptors, seconds=r.seconds, gbps=r.num_bytes / r.seconds / 1e9))
                if case == "cross_layer_runs":
                    raw_s = asyncio.run(time_raw(puller, agent, ticket, r.num_bytes, repeats))
                    rows.append(dict(scenario="layouts", device=args.device, layout="raw", tokens=n,
                                     bytes=r.num_bytes, descriptors=1, seconds=raw_s, gbps=r.num_bytes / raw_s / 1e9))
            agent.close()
        finally:
            owner.stop()

    group_rows = []
    if "groups" in scenarios:
        shapes = QUICK_GROUP_SHAPES if args.quick else GROUP_SHAPES
        group_tokens = 512 if args.quick else args.group_tokens
        group_rows = run_groups(shapes, group_tokens, repeats, args.device)

    if emit_json(rows + group_rows, args.json_out, args.json):
        return
    print_layouts(rows, args.device, repeats)
    print_groups(group_rows, repeats)


def print_layouts(rows: list[dict], device: str, repeats: int) -> None:
    if not rows:
        return
    print(f"# KV transfer, {device}, Llama-3.1-8B KV shape (bf16, block 16), best of {repeats}")
    print(f"{'tokens':>7} {'layout':>17} {'MiB':>8} {'descs':>7} {'ms':>9} {'GB/s':>8} {'vs raw':>7}")
    raw = {r["tokens"]: r["seconds"] for r in rows if r["layout"] == "raw"}
    for r in sorted(rows, key=lambda r: (r["tokens"], list(CASES).index(r["layout"]) if r["layout"] in CASES else 9)):
        print(f"{r['tokens']:>7} {r['layout']:>17} {r['bytes'] / 2**20:>8.1f} {r['descriptors']:>7} "
              f"{r['seconds'] * 1e3:>9.2f} {r['gbps']:>8.2f} {r['seconds'] / raw[r['tokens']]:>6.1f}x")


if __name__ == "__main__":
    main()
