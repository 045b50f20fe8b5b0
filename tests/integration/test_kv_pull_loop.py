"""Large KV pulls over UCX's TCP transport must not hold the reader's event loop.

Over TCP (``UCX_TLS=tcp``; ``tcp,cuda_copy`` on a GPU) a READ's data moves inside NIXL's calls (the post,
the polls, or UCX's progress thread, which holds UCX's worker meanwhile), so a NIXL call the event loop makes
for a READ waits for that data: an H100 decode worker pulling 1 GiB parts this way missed the router's 1 s
health probe. Here two real owner processes and this reader process, all on TCP: the reader pulls two large
parts from one owner (read once before, as a pair probe does) while short pulls from the other keep coming,
with the reader's agent running UCX's progress thread as a device agent does. The loop's lag is measured,
every NIXL READ call the loop's thread makes is recorded (the real calls, passed through), and every pulled
byte is compared with its owner's pattern. ``PDSERVE_TEST_DEVICE=cuda`` runs the same on the GPU (KV in VRAM
on both sides, staged through host memory by ``cuda_copy``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from bench.kv_synthetic import identity_for, layout_for, pattern
from bench.transfer import Owner, stop_all
from services.engine.kv_cache.buffers import KVCache
from services.kv.nixl.agent import TransferAgent
from services.kv.ranks.kv_rank import LocalKVRank
from services.kv.reader.puller import KVPuller
from services.proto_gen.pdserve.v1 import kv_pb2

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
# Llama-like KV, 4 layers: 16 KiB per token, 256 KiB per block of 16 tokens, 64 MiB per part of 256 blocks.
# Block ids (the same on the reader): 0 the warm-up read from the large owner, then the parts, then the
# short pulls from the other owner.
CFG = dict(kind="cross_layer", order="NHD", num_kv_heads=8, head_dim=128, dtype="bfloat16", num_layers=4,
           block_size=16)
PART_BLOCKS, NUM_PARTS, NUM_SHORT = 256, 2, 24
NUM_BLOCKS = 1 + NUM_PARTS * PART_BLOCKS + NUM_SHORT
MAX_LOOP_LAG_S = 0.2
NIXL_READ_CALLS = ("make_prepped_xfer", "initialize_xfer", "transfer", "check_xfer_state", "send_notif")


def part_ids(part: int) -> list[int]:
    return list(range(1 + part * PART_BLOCKS, 1 + (part + 1) * PART_BLOCKS))


def short_ids(i: int) -> list[int]:
    return [1 + NUM_PARTS * PART_BLOCKS + i]


def owner_cfg(name: str, seed: int, requests: dict[str, list[int]]) -> dict:
    return {**CFG, "num_blocks": NUM_BLOCKS, "seed": seed, "engine_id": f"{name}-{uuid.uuid4().hex[:6]}", "tp": 1,
            "reader_tp": 1, "device": DEVICE,
            "requests": [{"request_id": rid, "num_tokens": len(ids) * CFG["block_size"], "block_ids": [ids]}
                         for rid, ids in requests.items()]}


def record_loop_calls(agent: TransferAgent, loop_thread: int) -> list[tuple[str, int, float]]:
    """Wrap the agent's NIXL READ calls (the real ones still run) to record each one made on the loop's thread:
    (name, other READs of the agent in flight at the call, seconds)."""
    calls: list[tuple[str, int, float]] = []
    nixl = agent._nixl

    def wrap(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != loop_thread:
                return call(*args, **kwargs)
            others = agent.num_in_flight - (name in ("transfer", "check_xfer_state"))  # not the READ itself
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                calls.append((name, others, time.perf_counter() - started))
        return recorded

    for name in NIXL_READ_CALLS:
        setattr(nixl, name, wrap(name, getattr(nixl, name)))
    return calls


async def loop_lag(stop: asyncio.Event, lags: list[float], period_s: float = 0.005) -> None:
    """How late each short sleep of the loop wakes up (what a gRPC health call would wait for)."""
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(period_s)
        lags.append(time.perf_counter() - started - period_s)


def tickets_of(owner: Owner) -> dict[str, kv_pb2.TransferTicket]:
    return {rid: kv_pb2.TransferTicket.FromString(bytes.fromhex(h)) for rid, h in owner.hello()["tickets"].items()}


def test_large_tcp_pulls_keep_the_loop_responsive(monkeypatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy" if DEVICE == "cuda" else "tcp")  # read when an agent is made
    large_cfg = owner_cfg("tcp-large", 5, {"warm": [0], **{f"part{p}": part_ids(p) for p in range(NUM_PARTS)}})
    short_cfg = owner_cfg("tcp-short", 6, {f"short{i}": short_ids(i) for i in range(NUM_SHORT)})
    owners = [Owner(large_cfg), Owner(short_cfg)]  # both start now, with this environment
    layout = layout_for(large_cfg, 1)
    cache = KVCache(layout, torch.device(DEVICE))
    for buffer in cache.buffers:
        buffer.zero_()
    # On host memory the agent runs no progress thread by default; a device agent does, and here it moves TCP data.
    agent = TransferAgent(f"tcp-reader-{uuid.uuid4().hex[:6]}", device="cuda" if DEVICE == "cuda" else "cpu",
                          progress_thread=True)
    try:
        # Synthetic owners' tickets of no real prompt (test_kv_transfer_tickets.py checks tickets).
        puller = KVPuller(engine_id="tcp-reader", identity=identity_for(large_cfg, layout),
                          ranks=[LocalKVRank(agent, layout, cache.buffers)], transfer_timeout_s=60, check_tickets=False)
        large, short = tickets_of(owners[0]), tickets_of(owners[1])

        async def run() -> tuple[list[float], list[tuple[str, int, float]], float]:
            # Handshakes, connections and a first READ from each owner, as the router's pair probes do.
            await puller.pull(large["warm"], [[0]])
            await puller.pull(short["short0"], [short_ids(0)])
            calls = record_loop_calls(agent, threading.get_ident())
            stop, lags = asyncio.Event(), []
            probe = asyncio.create_task(loop_lag(stop, lags))

            async def short_pulls() -> None:
                for i in range(1, NUM_SHORT):
                    await asyncio.sleep(0.02)
                    await puller.pull(short[f"short{i}"], [short_ids(i)])

            started = time.perf_counter()
            await asyncio.gather(short_pulls(), *(puller.pull(large[f"part{p}"], [part_ids(p)])
                                                  for p in range(NUM_PARTS)))
            seconds = time.perf_counter() - started
            stop.set()
            await probe
            return lags, calls, seconds

        lags, calls, seconds = asyncio.run(run())
    finally:
        agent.close()
        stop_all(owners)

    moved_mib = NUM_PARTS * PART_BLOCKS * layout.buffers()[0].block_stride_bytes >> 20
    busy = [(name, others, f"{s * 1e3:.1f} ms") for name, others, s in calls if others]
    assert not busy, f"NIXL READ calls on the event loop's thread while other READs were in flight: {busy[:6]}"
    assert max(lags) < MAX_LOOP_LAG_S, f"loop held {max(lags) * 1e3:.0f} ms ({moved_mib} MiB moved in {seconds:.1f} s)"
    for cfg, blocks in ((large_cfg, [0, *(b for p in range(NUM_PARTS) for b in part_ids(p))]),
                        (short_cfg, [b for i in range(NUM_SHORT) for b in short_ids(i)])):
        values = pattern(cfg)
        for layer, (k, v) in cache.views.items():
            for kv, view in enumerate((k, v)):
                assert torch.equal(view[blocks].cpu(), values[layer][kv, blocks]), f"{cfg['engine_id']} layer {layer}"
