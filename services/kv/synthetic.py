"""A synthetic KV owner: the prefill side of a transfer without a model, for tests and benchmarks.

Run as ``python -m services.kv.synthetic '<json config>'``. It allocates one KV cache per
TP rank from the configured layout, fills it with a seeded pattern that depends only on
(layer, K/V, block, token, global head, element) — so replicated heads agree across ranks —
registers each rank with its own NIXL agent, serves Handshake over gRPC on 127.0.0.1, hands
out one ticket per configured request and prints, one JSON object per line:

    {"port": ..., "tickets": {request_id: hex(TransferTicket)}}
    {"released": request_id}            when every reading rank has notified

It exits when its stdin closes. Config keys: engine_id, tp, reader_tp, kind, order, num_blocks,
num_kv_heads (total), head_dim, dtype, num_layers, block_size, window (optional), seed, requests
[{request_id, num_tokens, block_ids: [[...] per group]}], and optionally epoch, port, token,
device ("cpu" or "cuda") and fill ("pattern", or "none" for benchmarks that need no content).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc
import torch

import services  # noqa: F401  (package init caps oneDNN; tests pass the env var too)
from services.engine.kv_cache import TORCH_DTYPES, KVCache, kv_groups_for
from services.engine.parallel import ParallelConfig
from services.kv.agent import TransferAgent
from services.kv.exporter import KVExporter, OwnerRank
from services.kv.handshake import HandshakeServicer, add_handshake_service
from services.kv.layout import BlockOrder, KVLayoutSpec, LayoutKind


def layout_for(cfg: dict, tp_size: int) -> KVLayoutSpec:
    parallel = ParallelConfig(tp_size, 0)
    return KVLayoutSpec(
        kind=LayoutKind(cfg["kind"]),
        order=BlockOrder(cfg["order"]),
        num_blocks=cfg["num_blocks"],
        num_kv_heads=parallel.num_local_kv_heads(cfg["num_kv_heads"]),
        head_dim=cfg["head_dim"],
        dtype=cfg["dtype"],
        groups=kv_groups_for(cfg["num_layers"], cfg["block_size"], cfg.get("window")),
    )


def pattern(cfg: dict) -> torch.Tensor:
    """[layers, 2, num_blocks, block_size, total_heads, head_dim] seeded values in the KV dtype."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    shape = (cfg["num_layers"], 2, cfg["num_blocks"], cfg["block_size"], cfg["num_kv_heads"], cfg["head_dim"])
    return torch.randn(shape, generator=gen).to(TORCH_DTYPES[cfg["dtype"]])


def fill_rank(cache: KVCache, values: torch.Tensor, tp_size: int, rank: int, num_kv_heads: int) -> None:
    """Copy this rank's head slice of the pattern into every layer's K and V views."""
    start, end = ParallelConfig(tp_size, rank).kv_head_range(num_kv_heads)
    values = values.to(cache.device)
    for layer, (k, v) in cache.views.items():
        k.copy_(values[layer, 0, :, :, start:end])
        v.copy_(values[layer, 1, :, :, start:end])


async def serve(cfg: dict) -> None:
    layout = layout_for(cfg, cfg["tp"])
    device = cfg.get("device", "cpu")
    values = pattern(cfg) if cfg.get("fill", "pattern") == "pattern" else None
    epoch = cfg.get("epoch") or time.time_ns()
    ranks = []
    for rank in range(cfg["tp"]):
        cache = KVCache(layout, torch.device(device))
        if values is not None:
            fill_rank(cache, values, cfg["tp"], rank, cfg["num_kv_heads"])
        # Agent names are unique per life of the engine, so a reader never confuses a restarted peer.
        agent = TransferAgent(f"{cfg['engine_id']}-{epoch}-tp{rank}", device=device)
        ranks.append(OwnerRank(agent, layout, cache.buffers))
    exporter = KVExporter(
        engine_id=cfg["engine_id"], model_name="pattern", architecture="llama", num_layers=cfg["num_layers"],
        num_kv_heads=cfg["num_kv_heads"], head_dim=cfg["head_dim"], ranks=ranks, epoch=epoch,
    )
    server = grpc.aio.server()
    add_handshake_service(server, HandshakeServicer(exporter.describe, cfg.get("token")))
    port = server.add_insecure_port(f"127.0.0.1:{cfg.get('port', 0)}")
    await server.start()
    address = f"127.0.0.1:{port}"
    tickets = {
        r["request_id"]: exporter.hand_out(
            r["request_id"], r["block_ids"], num_tokens=r["num_tokens"], first_token_id=7,
            handshake_address=address, reader_tp_size=cfg["reader_tp"],
        ).SerializeToString().hex()
        for r in cfg["requests"]
    }
    print(json.dumps({"port": port, "epoch": exporter.epoch, "tickets": tickets}), flush=True)

    stdin_closed = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    while not stdin_closed.done():
        for rid in exporter.poll_released():
            print(json.dumps({"released": rid}), flush=True)
        await asyncio.sleep(0.01)
    await server.stop(0)
    for r in ranks:
        r.agent.close()


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
