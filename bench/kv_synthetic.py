"""A synthetic KV owner: the prefill side of a transfer without a model, for tests and benchmarks.

A test and bench helper, not library code: it allocates through the engine, which ``services.kv``
must not import. Run from the repository root as ``python -m bench.kv_synthetic '<json config>'``.
It allocates one KV cache per
TP rank from the configured layout, fills it with a seeded pattern that depends only on
(layer, K/V, block, token, global head, element) — so replicated heads agree across ranks —
registers each rank with its own NIXL agent, serves Handshake over gRPC on 127.0.0.1, hands
out one ticket per configured request and prints, one JSON object per line:

    {"port": ..., "tickets": {request_id: hex(TransferTicket)}}
    {"released": request_id}            when every reading rank has notified

It exits when its stdin closes. Config keys: engine_id, tp, reader_tp, kind, order, num_blocks,
num_kv_heads (total), head_dim, dtype, num_layers, block_size, window (optional), seed, requests
[{request_id, num_tokens, block_ids: [[...] per group], reader_tp (optional, default the top-level
reader_tp), prompt (optional: the token ids the ticket's prompt hash is of, default ``prompt_of``)}], and
optionally epoch, port, token, lease_s (the tickets' lease: their deadline; nothing here frees blocks by it),
device ("cpu", "cuda" or "cuda:N"), devices (one device per rank, e.g. ["cuda:0", "cuda:1"]; rank i takes
entry i mod len; default: every rank on device), fill ("pattern", or "none" for benchmarks that need no
content) and kv_scales ({layer: [k_scale, v_scale]}: an FP8 KV dtype's per-layer scales, 1.0 where absent).

Hybrid models (several KV groups with their own shape, Gemma-3/4 style) add ``groups``: one
object per group, in group-id order, ``{"kind": "full" | "sliding_window", "layers": [...],
"window": W, "num_kv_heads": total, "head_dim": D, "block_size": B}`` where everything but kind
and layers defaults to the top-level value; and optionally ``kv_sharing`` ``{layer: source}``
(layers that read another layer's KV and are in no group). For example (Gemma-4-like: sliding
layers with 4 heads of 8, one full layer with 2 heads of 16)::

    "groups": [{"kind": "sliding_window", "window": 8, "layers": [0, 1, 3, 4]},
               {"kind": "full", "layers": [2], "num_kv_heads": 2, "head_dim": 16}]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import grpc
import torch

import services  # noqa: F401  (package init caps oneDNN; tests pass the env var too)
from services.engine.kv_cache.buffers import TORCH_DTYPES, KVCache, kv_groups_for
from services.engine.parallel import ParallelConfig
from services.kv.nixl.agent import TransferAgent
from services.kv.owner.exporter import KVExporter
from services.kv.owner.handshake import HandshakeServicer, add_handshake_service
from services.kv.ranks.kv_rank import LocalKVRank
from services.kv.spec.compat import DIGEST_SCHEME, KVIdentity
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.kv.spec.wire import prompt_hash

ARCHITECTURE = "llama"


def group_shapes(cfg: dict) -> list[dict]:
    """One dict per KV group with every key filled: kind, layers, window, num_kv_heads (total), head_dim,
    block_size."""
    if "groups" not in cfg:
        kind = "full" if cfg.get("window") is None else "sliding_window"
        groups = [{"kind": kind, "layers": list(range(cfg["num_layers"])), "window": cfg.get("window")}]
    else:
        groups = cfg["groups"]
    out = []
    for g in groups:
        full = g["kind"] == AttentionKind.FULL.value
        out.append({
            "kind": g["kind"], "layers": [int(x) for x in g["layers"]],
            "window": None if full else g.get("window", cfg.get("window")),
            "num_kv_heads": g.get("num_kv_heads", cfg["num_kv_heads"]), "head_dim": g.get("head_dim", cfg["head_dim"]),
            "block_size": g.get("block_size", cfg["block_size"]),
        })
    return out


def group_total_heads(cfg: dict) -> dict[int, int]:
    """The model's total KV heads per group id (what ``KVIdentity.of`` takes as ``group_kv_heads``)."""
    return {gid: g["num_kv_heads"] for gid, g in enumerate(group_shapes(cfg))}


def kv_sharing(cfg: dict) -> dict[int, int]:
    return {int(k): int(v) for k, v in cfg.get("kv_sharing", {}).items()}


def layout_for(cfg: dict, tp_size: int) -> KVLayoutSpec:
    parallel = ParallelConfig(tp_size, 0)
    if "groups" in cfg:
        groups = tuple(
            KVCacheGroupSpec(gid, AttentionKind(g["kind"]), tuple(g["layers"]), g["block_size"], g["window"],
                             parallel.num_local_kv_heads(g["num_kv_heads"]), g["head_dim"])
            for gid, g in enumerate(group_shapes(cfg))
        )
    else:
        groups = kv_groups_for(cfg["num_layers"], cfg["block_size"], cfg.get("window"))
    return KVLayoutSpec(
        kind=LayoutKind(cfg["kind"]),
        order=BlockOrder(cfg["order"]),
        num_blocks=cfg["num_blocks"],
        num_kv_heads=parallel.num_local_kv_heads(cfg["num_kv_heads"]),
        head_dim=cfg["head_dim"],
        dtype=cfg["dtype"],
        groups=groups,
    )


def identity_for(cfg: dict, layout: KVLayoutSpec) -> KVIdentity:
    """The KV identity an engine of this config (owner or reader) has; ``layout`` is one of its ranks'."""
    return KVIdentity.of(
        architecture=ARCHITECTURE, num_layers=cfg["num_layers"], num_kv_heads=cfg["num_kv_heads"],
        head_dim=cfg["head_dim"], layout=layout, kv_sharing=kv_sharing(cfg), group_kv_heads=group_total_heads(cfg),
        kv_digest=cfg.get("kv_digest", DIGEST_SCHEME),
        kv_scales=identity_scales(cfg),
    )


def identity_scales(cfg: dict) -> dict[int, tuple[float, float]]:
    """The config's per-layer KV scales (``kv_scales``), as a checkpoint gives them."""
    return {int(layer): tuple(pair) for layer, pair in cfg.get("kv_scales", {}).items()}


def pattern(cfg: dict) -> dict[int, torch.Tensor]:
    """Per KV-owning layer: [2, num_blocks, block_size, total_heads, head_dim] seeded values in the KV
    dtype, in the shape of the layer's group (layers are drawn in order from one generator)."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    shape_of = {layer: g for g in group_shapes(cfg) for layer in g["layers"]}
    out = {}
    for layer in sorted(shape_of):
        g = shape_of[layer]
        shape = (2, cfg["num_blocks"], g["block_size"], g["num_kv_heads"], g["head_dim"])
        out[layer] = torch.randn(shape, generator=gen).to(TORCH_DTYPES[cfg["dtype"]])
    return out


def fill_rank(cache: KVCache, values: dict[int, torch.Tensor], tp_size: int, rank: int, cfg: dict) -> None:
    """Copy this rank's head slice of the pattern into every layer's K and V views."""
    heads_of = {layer: g["num_kv_heads"] for g in group_shapes(cfg) for layer in g["layers"]}
    for layer, (k, v) in cache.views.items():
        start, end = ParallelConfig(tp_size, rank).kv_head_range(heads_of[layer])
        layer_values = values[layer].to(cache.device)
        k.copy_(layer_values[0, :, :, start:end])
        v.copy_(layer_values[1, :, :, start:end])


def prompt_of(request: dict) -> list[int]:
    """The prompt a configured request's ticket is bound to: its ``prompt``, else tokens 0 .. num_tokens - 1."""
    return request.get("prompt") or list(range(request["num_tokens"]))


def rank_devices(cfg: dict) -> list[torch.device]:
    """Each rank's device: ``devices`` (rank i takes entry i mod len) or else ``device`` for all."""
    names = cfg.get("devices") or [cfg.get("device", "cpu")]
    return [torch.device(names[rank % len(names)]) for rank in range(cfg["tp"])]


async def serve(cfg: dict) -> None:
    layout = layout_for(cfg, cfg["tp"])
    values = pattern(cfg) if cfg.get("fill", "pattern") == "pattern" else None
    epoch = cfg.get("epoch") or time.time_ns()
    ranks = []
    for rank, device in enumerate(rank_devices(cfg)):
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device.index)  # the rank's allocation, CUDA context and NIXL registration
        cache = KVCache(layout, device)
        if values is not None:
            fill_rank(cache, values, cfg["tp"], rank, cfg)
        # Agent names are unique per life of the engine, so a reader never confuses a restarted peer.
        agent = TransferAgent(f"{cfg['engine_id']}-{epoch}-tp{rank}", device=device.type)
        ranks.append(LocalKVRank(agent, layout, cache.buffers, staging_bytes=cfg.get("staging_bytes", 0)))
    exporter = KVExporter(engine_id=cfg["engine_id"], model_name="pattern", identity=identity_for(cfg, layout),
                          ranks=ranks, epoch=epoch, lease_s=cfg.get("lease_s", 30.0),
                          checkpoint_kv_scales=identity_scales(cfg))
    server = grpc.aio.server()
    add_handshake_service(server, HandshakeServicer(exporter.describe, cfg.get("token")))
    port = server.add_insecure_port(f"127.0.0.1:{cfg.get('port', 0)}")
    await server.start()
    address = f"127.0.0.1:{port}"
    tickets, hand_out_s = {}, {}
    for r in cfg["requests"]:
        started = time.perf_counter()
        ticket = await exporter.hand_out(
            r["request_id"], r["block_ids"], num_tokens=r["num_tokens"], first_token_id=7,
            handshake_address=address, reader_tp_size=r.get("reader_tp", cfg["reader_tp"]),
            reader_block_size=cfg.get("reader_block_size", 0), prompt_hash=prompt_hash(prompt_of(r)),
            reader_compat_hash=cfg.get("reader_compat_hash", ""),
        )
        hand_out_s[r["request_id"]] = time.perf_counter() - started  # the owner's digest, and its gather if staged
        tickets[r["request_id"]] = ticket.SerializeToString().hex()
    print(json.dumps({"port": port, "epoch": exporter.epoch, "tickets": tickets, "hand_out_s": hand_out_s}),
          flush=True)

    stdin_closed = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    while not stdin_closed.done():
        for rid in exporter.released(exporter.collect_notifications()):
            print(json.dumps({"released": rid, "staged": exporter.num_staged,
                              "staging_free": [r.staging.free_bytes if r.staging else 0 for r in ranks]}), flush=True)
        await asyncio.sleep(0.01)
    await server.stop(0)
    for r in ranks:
        r.agent.close()


def serve_on_pipes(cfg: dict, stdin, stdout) -> None:
    """``serve(cfg)`` in a process forked from a server that imported this module already (tests start many
    owners; each fresh interpreter would spend ~2 s importing torch): ``stdin`` and ``stdout`` (the read
    end and the write end of two ``multiprocessing`` pipes) become its stdin and stdout."""
    os.dup2(stdin.fileno(), 0)
    os.dup2(stdout.fileno(), 1)
    stdin.close()
    stdout.close()
    sys.stdin, sys.stdout = open(0, closefd=False), open(1, "w", closefd=False)  # noqa: SIM115 - the process's own
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
