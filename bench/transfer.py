"""KV transfer throughput: per-layer vs cross-layer vs cross-layer with run merging, side by side.

Two processes: a synthetic owner (``services.kv.synthetic``: pattern-free KV of a real model
shape, handshake over gRPC, NIXL agent) and this process as the reader (``KVPuller``: handshake,
plan, READ). For each prompt length, every case moves the same bytes:

  per_layer         per-layer layout, fragmented pool (every other block): 2 * layers descriptors per block
  cross_layer       cross-layer layout, fragmented pool: one descriptor per block
  cross_layer_runs  cross-layer layout, contiguous blocks: adjacent blocks merged into runs
  raw               one NIXL READ of a single descriptor of the same size (the ceiling)

    python bench/transfer.py                    # CPU (DRAM), Llama-3.1-8B KV shape, bf16
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
from services.kv.puller import KVPuller, ReaderRank  # noqa: E402
from services.kv.synthetic import layout_for  # noqa: E402
from services.proto_gen.pdserve.v1 import kv_pb2  # noqa: E402

# Llama-3.1-8B KV shape: one 16-token block is 32 KiB per layer and K/V, 2 MiB across layers.
SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16, order="NHD")
CASES = {"per_layer": ("per_layer", 2), "cross_layer": ("cross_layer", 2), "cross_layer_runs": ("cross_layer", 1)}


def block_ids(num_blocks: int, stride: int) -> list[int]:
    return list(range(0, num_blocks * stride, stride))


def start_owner(kind: str, num_blocks: int, tokens: list[int], device: str) -> tuple[subprocess.Popen, dict]:
    requests = []
    for n in tokens:
        blocks = -(-n // SHAPE["block_size"])
        for stride in (1, 2):
            requests.append({"request_id": f"{n}-{stride}", "num_tokens": n, "block_ids": [block_ids(blocks, stride)]})
    cfg = {**SHAPE, "kind": kind, "num_blocks": num_blocks, "engine_id": f"bench-{kind}", "tp": 1, "reader_tp": 1,
           "seed": 0, "fill": "none", "device": device, "requests": requests}
    proc = subprocess.Popen([sys.executable, "-m", "services.kv.synthetic", json.dumps(cfg)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    while True:
        line = lines.get(timeout=120)
        if line.startswith("{"):
            return proc, json.loads(line)


def make_reader(kind: str, num_blocks: int, device: str) -> tuple[KVPuller, TransferAgent]:
    cfg = {**SHAPE, "kind": kind, "num_blocks": num_blocks}
    layout = layout_for(cfg, 1)
    cache = KVCache(layout, torch.device(device))
    agent = TransferAgent(f"bench-reader-{uuid.uuid4().hex[:6]}", device=device)
    compat = CompatInfo.of(compat_fields(architecture="llama", num_layers=SHAPE["num_layers"],
                                         num_kv_heads=SHAPE["num_kv_heads"], head_dim=SHAPE["head_dim"], layout=layout))
    puller = KVPuller(engine_id="bench-reader", compat=compat, num_kv_heads=SHAPE["num_kv_heads"],
                      ranks=[ReaderRank(agent, layout, cache.buffers)], transfer_timeout_s=120)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tokens", default="1024,4096,8192", help="prompt lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small prompts, one repeat (CI smoke run)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case per line")
    ap.add_argument("--json-out", default=None, help="also write the JSON lines to this file")
    args = ap.parse_args()
    tokens = [256, 1024] if args.quick else [int(t) for t in args.tokens.split(",")]
    repeats = 1 if args.quick else args.repeats
    num_blocks = 2 * -(-max(tokens) // SHAPE["block_size"]) + 1

    rows = []
    for case, (kind, stride) in CASES.items():
        proc, hello = start_owner(kind, num_blocks, tokens, args.device)
        try:
            puller, agent = make_reader(kind, num_blocks, args.device)
            for n in tokens:
                ticket = kv_pb2.TransferTicket.FromString(bytes.fromhex(hello["tickets"][f"{n}-{stride}"]))
                local = block_ids(-(-n // SHAPE["block_size"]), stride)
                r = asyncio.run(time_pull(puller, ticket, local, repeats))
                rows.append(dict(device=args.device, layout=case, tokens=n, bytes=r.num_bytes,
                                 descriptors=r.num_descriptors, seconds=r.seconds, gbps=r.num_bytes / r.seconds / 1e9))
                if case == "cross_layer_runs":
                    raw_s = asyncio.run(time_raw(puller, agent, ticket, r.num_bytes, repeats))
                    rows.append(dict(device=args.device, layout="raw", tokens=n, bytes=r.num_bytes, descriptors=1,
                                     seconds=raw_s, gbps=r.num_bytes / raw_s / 1e9))
            agent.close()
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)

    if emit_json(rows, args.json_out, args.json):
        return
    print(f"# KV transfer, {args.device}, Llama-3.1-8B KV shape (bf16, block 16), best of {repeats}")
    print(f"{'tokens':>7} {'layout':>17} {'MiB':>8} {'descs':>7} {'ms':>9} {'GB/s':>8} {'vs raw':>7}")
    raw = {r["tokens"]: r["seconds"] for r in rows if r["layout"] == "raw"}
    for r in sorted(rows, key=lambda r: (r["tokens"], list(CASES).index(r["layout"]) if r["layout"] in CASES else 9)):
        print(f"{r['tokens']:>7} {r['layout']:>17} {r['bytes'] / 2**20:>8.1f} {r['descriptors']:>7} "
              f"{r['seconds'] * 1e3:>9.2f} {r['gbps']:>8.2f} {r['seconds'] / raw[r['tokens']]:>6.1f}x")


if __name__ == "__main__":
    main()
