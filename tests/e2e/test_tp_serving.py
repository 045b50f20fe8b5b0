"""End to end with tensor-parallel workers: every prefill/decode TP and block-size pair, both layouts.

Real worker processes (rank 0 each serving gRPC, follower ranks in their own processes over gloo,
one NIXL agent per rank) are driven the way the router drives them: ``Prefill`` on a prefill
worker (told the reader's TP size), then ``Generate`` with its ticket on a decode worker, whose
every rank pulls its own head slice. Greedy tokens must equal a colocated TP1 engine's, the pull
must really happen (no local recompute), and the prefill worker must free the request's blocks
once every reading rank has notified. A random Llama checkpoint with 2 KV heads covers the split
and the replicated sides; one with SmolLM2's 3 KV heads and 9 query heads covers an uneven TP3; a
Gemma-4-like checkpoint covers KV-cache groups (each sharded by its own head count) under TP.
Pairs that cannot work are refused with the reason: a worker that cannot shard the model does
not start, and a live worker no peer can pair with is named, with why, on the router's /health.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from itertools import product
from pathlib import Path

import grpc
import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.launch.spawn import Daemon, daemons, start_router, stop_router
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import hf_config
from tests.e2e.stack import http_client, info, metric_total

MAX_TOKENS = 6
TPS = (1, 2)
BLOCK_PAIRS = ((16, 16), (16, 64), (64, 16))  # (prefill, decode)
LAYOUTS = ("cross_layer", "per_layer")


def _worker_args(tp: int, block_size: int, layout: str, num_blocks: int = 96) -> tuple[str, ...]:
    return ("--tp", str(tp), "--device", "cpu", "--block-size", str(block_size), "--kv-layout", layout,
            "--num-kv-blocks", str(num_blocks), "--max-num-seqs", "8")


def _random_llama(tmp_path_factory, num_kv_heads: int, seed: int, num_heads: int = 4) -> str:
    """A random Llama checkpoint (``num_heads`` query heads of 16 dims) saved by transformers."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config("llama")
    config.num_key_value_heads, config.num_attention_heads = num_kv_heads, num_heads
    config.hidden_size, config.intermediate_size = 16 * num_heads, 32 * num_heads
    path = tmp_path_factory.mktemp(f"tp-llama-q{num_heads}-kv{num_kv_heads}")
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """2 KV heads: split over 2 ranks, whole on 1."""
    return _random_llama(tmp_path_factory, 2, seed=0)


def _colocated(model: str | None, prompts: list[list[int]]) -> list[list[int]]:
    return _colocated_cached(model, tuple(map(tuple, prompts)))


@functools.cache
def _colocated_cached(model: str | None, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """A fresh engine's greedy tokens, once per model and prompts (both layouts' TP pairs ask for the same)."""
    engine = LLMEngine(EngineConfig(model=model, device="cpu", num_kv_blocks=256))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in engine.generate([list(p) for p in prompts], params)]


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of 20-150 tokens: partial last blocks on both sides, several blocks of 16 and of 64."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(20, 150))] for _ in range(n)]


def _disaggregated(prefill: Daemon, decode: Daemon, prompt: list[int], request_id: str) -> list[int]:
    """The router's flow by hand: Prefill (told the reader's TP size and block size), then Generate with
    the ticket."""
    params = worker_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    reader = info(decode)
    with grpc.insecure_channel(prefill.address) as ch:
        answer = worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params, reader_tp_size=reader.tp_size,
            reader_block_size=reader.block_size), timeout=120)
    assert answer.ticket.digests, "the ticket carries the KV digest (on by default)"
    assert answer.HasField("ticket")
    tokens = []
    with grpc.insecure_channel(decode.address) as ch:
        stream = worker_pb2_grpc.DecodeWorkerStub(ch).Generate(worker_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params, ticket=answer.ticket), timeout=120)
        for chunk in stream:
            assert not chunk.recomputed_locally, f"{request_id}: the decode worker recomputed instead of pulling"
            tokens += chunk.token_ids
    return tokens


def _wait_unpinned(prefill: Daemon, timeout_s: float = 30.0) -> None:
    """Blocks are freed only after every reading rank's notification: wait for that, bounded."""
    deadline = time.monotonic() + timeout_s
    while info(prefill).kv_blocks_pinned:
        assert time.monotonic() < deadline, f"{info(prefill).kv_blocks_pinned} blocks still pinned"
        time.sleep(0.05)


def _by_key(started: list[Daemon], keys: list[tuple]) -> dict[tuple, Daemon]:
    return dict(zip(keys, started, strict=True))


@pytest.fixture(scope="module", params=LAYOUTS)
def llama_workers(request, llama: str) -> Iterator[tuple[str, dict[tuple, Daemon]]]:
    """Prefill and decode workers of every (tp, block size) in one layout: 8 workers, 12 processes."""
    layout = request.param
    keys = [(role, tp, bs) for role in ("prefill", "decode") for tp in TPS for bs in (16, 64)]
    with daemons(*[(role, llama, _worker_args(tp, bs, layout)) for role, tp, bs in keys]) as started:
        yield layout, _by_key(started, keys)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), list(product(TPS, TPS)))
def test_tp_pairs_equal_colocated_tp1(llama: str, llama_workers, prefill_tp: int, decode_tp: int) -> None:
    layout, workers = llama_workers
    prompts = _prompts(2, 320, seed=prefill_tp * 10 + decode_tp)
    expected = _colocated(llama, prompts)
    for p_bs, d_bs in BLOCK_PAIRS:
        prefill, decode = workers[("prefill", prefill_tp, p_bs)], workers[("decode", decode_tp, d_bs)]
        pulled = metric_total(decode, "pdserve_kv_transfer_bytes_total")
        for i, prompt in enumerate(prompts):
            rid = f"{layout}-p{prefill_tp}x{p_bs}-d{decode_tp}x{d_bs}-{i}"
            assert _disaggregated(prefill, decode, prompt, rid) == expected[i], rid
        assert metric_total(decode, "pdserve_kv_transfer_bytes_total") > pulled
        _wait_unpinned(prefill)


class PeerTPWorkers:
    """Prefill and decode workers of TP 1 and 2, each told the other role's TP size (as ``pdserve up`` tells
    them): 4 workers, 6 processes, started at the first ``live()``. A test that kills some (the dead-rank test)
    leaves them dead: the next ``live()`` starts a fresh set, so no test depends on running before or after that
    one. ``close()`` stops them (idle TP ranks still take CPU: they are not kept through other tests)."""

    def __init__(self, model: str) -> None:
        def args(tp: int, peer_tp: int) -> tuple[str, ...]:
            return ("--tp", str(tp), "--peer-tp-size", str(peer_tp), "--device", "cpu", "--block-size", "16",
                    "--num-kv-blocks", "96", "--max-num-seqs", "8")

        self.keys = [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)]
        self.specs = [(role, model, args(tp, 3 - tp)) for role, tp in self.keys]
        self.started = ExitStack()
        self.workers: dict[tuple[str, int], Daemon] = {}

    def live(self) -> dict[tuple[str, int], Daemon]:
        if not self.workers or any(d.proc.poll() is not None for d in self.workers.values()):
            self.close()
            self.workers = _by_key(self.started.enter_context(daemons(*self.specs)), self.keys)
        return self.workers

    def close(self) -> None:
        self.workers = {}
        self.started.close()


@pytest.fixture(scope="module")
def peer_tp_workers(llama: str) -> Iterator[PeerTPWorkers]:
    workers = PeerTPWorkers(llama)
    try:
        yield workers
    finally:
        workers.close()


def test_auto_layout_is_heads_outer_across_tp_sizes_and_equals_colocated_tp1(llama: str,
                                                                              peer_tp_workers: PeerTPWorkers) -> None:
    """Workers told the other role's TP size (as ``pdserve up`` tells them) pick the heads-outer KV layout
    when it differs: TP 1 -> 2 and 2 -> 1 pulls keep the greedy tokens, and each READ of consecutive blocks is
    one descriptor per head it reads (a head's plane holds every block), not one per block, layer and K/V."""
    prompts = _prompts(2, 320, seed=5)
    expected = _colocated(llama, prompts)
    workers = peer_tp_workers.live()
    for prefill_tp, decode_tp in ((1, 2), (2, 1)):
        prefill, decode = workers["prefill", prefill_tp], workers["decode", decode_tp]
        for i, prompt in enumerate(prompts):
            before = metric_total(decode, "pdserve_kv_transfer_descriptors_total")
            rid = f"auto-p{prefill_tp}-d{decode_tp}-{i}"
            assert _disaggregated(prefill, decode, prompt, rid) == expected[i], rid
            descriptors = metric_total(decode, "pdserve_kv_transfer_descriptors_total") - before
            # 2 READs (one per rank pair) of one head each: fresh pools hand out consecutive blocks on both
            # sides, so a head's plane is one run (a run per block and head before heads spanned the pool)
            assert descriptors == 2, rid
        _wait_unpinned(prefill)


def _children(pid: int) -> list[int]:
    """Follower ranks of a daemon: its multiprocessing children (not the resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_a_dead_rank_takes_the_worker_down_and_a_dead_worker_takes_its_ranks(peer_tp_workers: PeerTPWorkers) -> None:
    """SIGKILL a follower rank: the daemon stops serving and exits non-zero (it logs which rank).
    SIGKILL a daemon: its follower ranks notice the closed pipe and exit (no orphans). (The TP-2 workers of the
    auto-layout test, which is done with them: any TP-2 worker's ranks go down the same way.)"""
    workers = peer_tp_workers.live()
    decode, prefill = workers["decode", 2], workers["prefill", 2]
    (rank1,) = _children(decode.proc.pid)
    os.kill(rank1, signal.SIGKILL)
    assert decode.proc.wait(timeout=60) == 1
    (orphan,) = _children(prefill.proc.pid)
    prefill.proc.kill()
    prefill.proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while not _gone(orphan):
        assert time.monotonic() < deadline, "a follower rank outlived its daemon"
        time.sleep(0.1)
    peer_tp_workers.close()  # the TP-1 ones too: nothing else uses them


@pytest.fixture(scope="module")
def smol_shaped_llama(tmp_path_factory) -> str:
    """3 KV heads and 9 query heads (SmolLM2's shape): one KV head per rank at TP3, no split at TP2."""
    return _random_llama(tmp_path_factory, 3, seed=3, num_heads=9)


def test_uneven_tp3_pairs_equal_colocated(smol_shaped_llama: str) -> None:
    """3 KV heads and 9 query heads (SmolLM2's shape), so TP3 (one KV head per rank) against TP1, both ways, and
    with itself."""
    model = smol_shaped_llama
    keys = [("prefill", 1), ("prefill", 3), ("decode", 1), ("decode", 3)]
    specs = [(role, model, _worker_args(tp, 16, "cross_layer", num_blocks=64)) for role, tp in keys]
    prompts = _prompts(1, 320, seed=3)
    expected = _colocated(model, prompts)
    with daemons(*specs) as started:
        workers = dict(zip(keys, started, strict=True))
        for p_tp, d_tp in ((3, 1), (1, 3), (3, 3)):  # TP1 -> TP1 is every other test's case
            prefill, decode = workers[("prefill", p_tp)], workers[("decode", d_tp)]
            for i, prompt in enumerate(prompts):
                rid = f"smol-p{p_tp}-d{d_tp}-{i}"
                assert _disaggregated(prefill, decode, prompt, rid) == expected[i], rid
            _wait_unpinned(prefill)


def test_worker_that_cannot_shard_the_model_refuses_to_start(smol_shaped_llama: str) -> None:
    """SmolLM2's shape over 2 ranks: 3 KV heads (and 9 query heads) do not split in two; no rank starts. (The
    bundled SmolLM2 itself is refused the same way through `pdserve up` in test_up.py.)"""
    result = subprocess.run([sys.executable, "-m", "services.cli", "decode", "--model", smol_shaped_llama, "--tp",
                             "2", "--device", "cpu", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "3 KV heads over 2 ranks" in result.stderr
    assert "9 attention heads over 2 ranks" in result.stderr


@pytest.mark.parametrize("llama_workers", ["cross_layer"], indirect=True)
def test_router_pairs_tp_workers_and_names_a_worker_nobody_can_pair_with(llama: str, llama_workers) -> None:
    """Router + P tp2 (block size 16) + D tp1 (block size 64), the cross-layer workers above, and a decode worker
    whose KV page layout (HND) no prefill worker shares: requests go through the supported pair; /health names the
    odd worker and says why."""
    _, workers = llama_workers
    prefill, decode = workers[("prefill", 2, 16)], workers[("decode", 1, 64)]
    prompts = _prompts(3, 320, seed=31)  # a seed no other test's prompts use: nothing cached anywhere
    expected = _colocated(llama, prompts)
    pulled = metric_total(decode, "pdserve_kv_transfer_bytes_total")
    with daemons(("decode", llama, (*_worker_args(1, 16, "cross_layer"), "--kv-block-order", "HND"))) as (odd,):
        router = start_router(llama, [prefill.address], [decode.address, odd.address])
        try:
            with http_client(timeout=120) as client:
                for prompt, tokens in zip(prompts, expected, strict=True):
                    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                            "logprobs": 0, "return_tokens_as_token_ids": True}
                    answer = client.post(f"{router.url}/v1/completions", json=body)
                    answer.raise_for_status()
                    got = [int(t.removeprefix("token_id:")) for t in answer.json()["choices"][0]["logprobs"]["tokens"]]
                    assert got == tokens
                health = client.get(f"{router.url}/health").json()
        finally:
            stop_router(router)
        assert metric_total(odd, "pdserve_requests_total") == 0  # never paired, never given work
        assert metric_total(decode, "pdserve_kv_transfer_bytes_total") > pulled
        _wait_unpinned(prefill)
    listed = {w["address"]: w for w in health["workers"]}
    assert listed[prefill.address]["tp_size"] == 2
    assert "unpaired_reason" not in listed[decode.address]
    reason = listed[odd.address]["unpaired_reason"]
    assert "kv_layout" in reason and "NHD" in reason and "HND" in reason, reason


@pytest.fixture(scope="module")
def mqa_llama(tmp_path_factory) -> str:
    """One KV head: at TP2 both ranks hold it (replicated)."""
    return _random_llama(tmp_path_factory, 1, seed=1)


def test_replicated_kv_head_is_read_once(mqa_llama: str) -> None:
    """TP above the KV head count replicates the head; a pull still moves each head once: a TP2
    reader or owner moves exactly the bytes a TP1 pair moves, and the tokens stay the same."""
    keys = [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)]
    specs = [(role, mqa_llama, _worker_args(tp, 16, "cross_layer")) for role, tp in keys]
    pairs = ((1, 1), (2, 1), (1, 2), (2, 2))
    rng = random.Random(21)  # one prompt per pair (no prefix hits), all of one length (equal KV)
    prompts = [[rng.randrange(3, 320) for _ in range(57)] for _ in pairs]
    expected = _colocated(mqa_llama, prompts)
    with daemons(*specs) as started:
        workers = dict(zip(keys, started, strict=True))
        pulled = {}
        for (p_tp, d_tp), prompt, tokens in zip(pairs, prompts, expected, strict=True):
            prefill, decode = workers[("prefill", p_tp)], workers[("decode", d_tp)]
            before = metric_total(decode, "pdserve_kv_transfer_bytes_total")
            assert _disaggregated(prefill, decode, prompt, f"mqa-p{p_tp}-d{d_tp}") == tokens
            pulled[(p_tp, d_tp)] = metric_total(decode, "pdserve_kv_transfer_bytes_total") - before
            _wait_unpinned(prefill)
    # a TP2 reader's ranks each hold the head, so each reads it: that is two copies by design,
    # one per rank that needs it; every other pair moves the TP1 bytes exactly
    assert pulled[(2, 1)] == pulled[(1, 1)] > 0
    assert pulled[(1, 2)] == pulled[(2, 2)] == 2 * pulled[(1, 1)]


def test_hybrid_groups_under_tp_with_block_size_ratios(tmp_path_factory) -> None:
    """Gemma-4-like: a sliding-window group and a full group whose layers have different KV head
    counts and head dims, plus KV-shared layers. Each group is sharded by its own heads; pulls
    across TP sizes and block-size ratios (both directions, both layouts) keep the greedy tokens."""
    import json

    from tests.checkpoints import make_checkpoint

    directory, _ = make_checkpoint("gemma4", tmp_path_factory.mktemp("tp-gemma4"))
    model = str(directory)
    window = int(json.loads((directory / "config.json").read_text())["sliding_window"])
    keys = [("prefill", 2, 16, "cross_layer"), ("prefill", 1, 64, "per_layer"),
            ("decode", 1, 64, "per_layer"), ("decode", 2, 16, "cross_layer")]
    specs = [(role, model, _worker_args(tp, bs, layout)) for role, tp, bs, layout in keys]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(3 * window + 5 + 11 * i)] for i in range(3)]
    expected = _colocated(model, prompts)
    with daemons(*specs) as started:
        workers = {key[:2]: d for key, d in zip(keys, started, strict=True)}
        pairs = (((("prefill", 2), ("decode", 1)), prompts[0]), ((("prefill", 1), ("decode", 2)), prompts[1]),
                 ((("prefill", 2), ("decode", 2)), prompts[2]))
        for ((p_key, d_key), prompt), tokens in zip(pairs, expected, strict=True):
            prefill, decode = workers[p_key], workers[d_key]
            assert _disaggregated(prefill, decode, prompt, f"gemma4-p{p_key[1]}-d{d_key[1]}") == tokens
            _wait_unpinned(prefill)
