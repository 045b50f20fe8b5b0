"""Tensor parallelism is real sharding: two gloo ranks on CPU reproduce the unsharded model.

Two spawned processes form a TP=2 group over gloo on 127.0.0.1. Each builds the model for its
rank, loads the full HF checkpoint (taking its shard), and runs the same prompt as two chunks
(a prefill, then a chunk that reads the first one's KV back) through a ``ModelRunner`` over a
KV cache holding only its own KV heads. Both ranks' logits must equal HF's, and the KV heads each
rank stores must equal the matching head slice of the TP=1 cache: the KV transfer between
differently sharded workers relies on that head-to-rank map. Two shapes: KV heads split
(2 heads, one per rank) and replicated (1 head, on both ranks).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from services.contract.sampling_params import SamplingParams
from services.engine.kv_cache.buffers import KVCache, kv_groups_for
from services.engine.loading.weights import iter_safetensors
from services.engine.model_config.hf import ModelConfig
from services.engine.models import build_model
from services.engine.parallel import ParallelConfig
from services.engine.request import Request
from services.engine.runner.model_runner import ModelRunner
from services.engine.sched.scheduler_output import ScheduledChunk
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind

TP_SIZE = 2
BLOCK_SIZE = 4
NUM_BLOCKS = 16
PROMPT = [(37 * i + 11) % 320 for i in range(21)]
CHUNKS = ((0, 13), (13, 8))  # (start, num_tokens): the second chunk attends to the first's KV
BLOCK_TABLE = [9, 2, 14, 5, 0, 7]  # scattered on purpose: ceil(21 / 4) blocks
PROCESS_TIMEOUT_S = 90  # for all ranks together; gloo's own timeout is below it
GROUP_TIMEOUT = timedelta(seconds=60)
KV_HEADS = {"kv_split": 2, "kv_replicated": 1}  # 4 query heads in both


def _prefill(checkpoint: Path, parallel: ParallelConfig) -> tuple[torch.Tensor, KVCache, ModelConfig]:
    """Run PROMPT in CHUNKS on this rank; return all its logits and the KV cache it filled."""
    config = ModelConfig.from_file(checkpoint / "config.json")
    model = build_model(config, parallel, torch.float32, torch.device("cpu"))
    model.load_weights(iter_safetensors(checkpoint))
    layout = KVLayoutSpec(
        kind=LayoutKind.CROSS_LAYER, order=BlockOrder.NHD, num_blocks=NUM_BLOCKS,
        num_kv_heads=parallel.num_local_kv_heads(config.num_kv_heads), head_dim=config.head_dim,
        dtype="float32", groups=kv_groups_for(config.num_layers, BLOCK_SIZE, None),
    )
    cache = KVCache(layout, torch.device("cpu"))
    runner = ModelRunner(model.eval(), cache, torch.device("cpu"))
    request = Request("tp", list(PROMPT), SamplingParams(max_tokens=1, return_logits=True))
    request.block_ids = [list(BLOCK_TABLE)]
    logits = [runner.execute([ScheduledChunk(request, start, n, samples=True)]).all_logits[0] for start, n in CHUNKS]
    return torch.cat(logits), cache, config


def _stored_kv(cache: KVCache, config: ModelConfig) -> torch.Tensor:
    """[layers, K/V, tokens, local heads, head_dim]: every prompt token's KV, read through the block table."""
    slots = torch.tensor([BLOCK_TABLE[p // BLOCK_SIZE] for p in range(len(PROMPT))])
    offsets = torch.arange(len(PROMPT)) % BLOCK_SIZE
    return torch.stack([
        torch.stack([cache.views[layer][kv][slots, offsets] for kv in (0, 1)])
        for layer in range(config.num_layers)
    ])


def _tp_worker(rank: int, port: int, checkpoints: dict[str, str], out_dir: str) -> None:
    """One TP rank: join the group, run every checkpoint, save logits and KV for the parent."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=TP_SIZE, timeout=GROUP_TIMEOUT)
        results = {}
        for name, path in checkpoints.items():
            logits, cache, config = _prefill(Path(path), ParallelConfig(TP_SIZE, rank))
            results[name] = {"logits": logits, "kv": _stored_kv(cache, config)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(checkpoints: dict[str, str], out_dir: Path) -> list[dict]:
    """Spawn the TP ranks, wait for them within a deadline, and load what each saved."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, port, checkpoints, str(out_dir))) for r in range(TP_SIZE)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"TP ranks {hung} still running after {PROCESS_TIMEOUT_S} s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = [f.read_text() for f in sorted(out_dir.glob("rank*.err"))]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * TP_SIZE
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(TP_SIZE)]


@dataclass
class Results:
    hf_logits: dict[str, torch.Tensor]
    tp1: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (logits, stored KV)
    ranks: list[dict]
    configs: dict[str, ModelConfig]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Results:
    import transformers

    from tests.checkpoints import hf_config

    root = tmp_path_factory.mktemp("tp")
    checkpoints, hf_logits, tp1, configs = {}, {}, {}, {}
    for name, kv_heads in KV_HEADS.items():
        torch.manual_seed(0)
        config = hf_config("llama")
        config.num_key_value_heads = kv_heads
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
        hf.save_pretrained(root / name, safe_serialization=True)
        checkpoints[name] = str(root / name)
        with torch.no_grad():
            hf_logits[name] = hf(torch.tensor([PROMPT])).logits[0].float()
        logits, cache, configs[name] = _prefill(root / name, ParallelConfig())
        tp1[name] = (logits, _stored_kv(cache, configs[name]))
    out_dir = root / "out"
    out_dir.mkdir()
    return Results(hf_logits, tp1, _run_ranks(checkpoints, out_dir), configs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", KV_HEADS)
def test_tp1_matches_hf(results: Results, name: str) -> None:
    assert _rel(results.tp1[name][0], results.hf_logits[name]) < 1e-4


@pytest.mark.parametrize("name", KV_HEADS)
@pytest.mark.parametrize("rank", range(TP_SIZE))
def test_each_rank_logits_match_hf(results: Results, name: str, rank: int) -> None:
    logits = results.ranks[rank][name]["logits"]
    assert logits.shape == results.hf_logits[name].shape
    assert _rel(logits, results.hf_logits[name]) < 1e-4


@pytest.mark.parametrize("name", KV_HEADS)
@pytest.mark.parametrize("rank", range(TP_SIZE))
def test_each_rank_stores_its_head_slice(results: Results, name: str, rank: int) -> None:
    config = results.configs[name]
    parallel = ParallelConfig(TP_SIZE, rank)
    start, end = parallel.kv_head_range(config.num_kv_heads)
    assert end - start == parallel.num_local_kv_heads(config.num_kv_heads)
    stored = results.ranks[rank][name]["kv"]
    full = results.tp1[name][1]
    assert stored.shape[3] == end - start
    assert _rel(stored, full[:, :, :, start:end]) < 1e-5
    # Split heads really are split: each rank's slice differs from the other's.
    if config.num_kv_heads >= TP_SIZE:
        other = results.ranks[1 - rank][name]["kv"]
        assert not torch.allclose(stored, other)


def test_kv_head_ownership() -> None:
    """Which KV heads each rank holds: split when they divide, else replicated in order."""
    assert [ParallelConfig(2, r).kv_head_range(2) for r in range(2)] == [(0, 1), (1, 2)]
    assert [ParallelConfig(2, r).kv_head_range(1) for r in range(2)] == [(0, 1), (0, 1)]
    assert [ParallelConfig(4, r).kv_head_range(2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [ParallelConfig(2, r).kv_head_range(4) for r in range(2)] == [(0, 2), (2, 4)]
