"""End to end: KV sent per prefill chunk between TP workers of different sizes, and with a prefix the prefill
worker serves from its host KV tier (real routers, workers and NIXL on the CPU).

TP: a TP1 prefill worker feeds a TP2 decode worker and a TP2 prefill worker a TP1 decode worker (each pair
behind its own router; the layouts and the coarser block differ in the two). Every rank of the reader pulls
its head slice of every part from the owner rank(s) holding it; the owner frees a part's blocks once every
reading rank has notified. Host tier: a prompt pushed out of the prefill worker's device pool comes back
as a host-tier hit; its one part (read from the device blocks the hit was loaded into) ends before the
host-tier prefix does, so its last part reads the rest of that prefix from the host tier and the prompt's
tail from the device.

Each request's greedy tokens must equal a colocated engine's, with exactly the expected part tickets and
one pull per ticket (a one-chunk prompt: one whole ticket, one pull), nothing recomputed, nothing pinned.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.launch.spawn import Daemon, daemons, start_router, stop_router
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import completion_tokens, info, metric_total, random_prompt, stack

pytestmark = pytest.mark.slow

CHUNK = 8
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("ckpt"))  # 2 KV heads: one per TP2 rank
    return str(directory)


def _reference(checkpoint: str, chunk: int = CHUNK) -> Callable[[list[int]], list[int]]:
    """Greedy tokens of a colocated TP1 engine prefilling in the prefill workers' chunks (the same KV bits)."""
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", dtype="float32", num_kv_blocks=256,
                                    max_num_batched_tokens=chunk, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return lambda prompt: engine.generate([prompt], params)[0].token_ids


def _served(url: str, prefill: Daemon, decode: Daemon, prompt: list[int], stream: bool) -> tuple[list[int], int, int]:
    """A completion through the router: its tokens, the part tickets the prefill worker issued for it and the
    tickets the decode worker read (one per pull, and the parts it read with a later one in the same pull)."""
    def read() -> float:
        return metric_total(decode, "pdserve_kv_transfer_seconds_count") + \
            metric_total(decode, "pdserve_kv_parts_coalesced_total")

    parts, tickets = metric_total(prefill, "pdserve_requests_total", 'outcome="kv_part"'), read()
    tokens = completion_tokens(url, prompt, MAX_TOKENS, stream)
    return tokens, int(metric_total(prefill, "pdserve_requests_total", 'outcome="kv_part"') - parts), \
        int(read() - tickets)


def _wait_unpinned(prefill: Daemon, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (pinned := info(prefill).kv_blocks_pinned) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pinned


def _tp_args(tp: int, layout: str, block_size: int) -> tuple[str, ...]:
    return ("--tp", str(tp), "--device", "cpu", "--dtype", "float32", "--kv-layout", layout, "--block-size",
            str(block_size), "--num-kv-blocks", "128", "--max-num-seqs", "8")


def test_tp1_to_tp2_and_tp2_to_tp1_parts_equal_colocated(checkpoint: str) -> None:
    reference = _reference(checkpoint)
    chunked = ("--max-num-batched-tokens", str(CHUNK))
    # (prefill, decode): cross-layer 4 -> per-layer 8 and per-layer 8 -> cross-layer 4: parts end on multiples of 8.
    pairs = [((*_tp_args(1, "cross_layer", 4), *chunked), _tp_args(2, "per_layer", 8)),
             ((*_tp_args(2, "per_layer", 8), *chunked), _tp_args(1, "cross_layer", 4))]
    specs = [(role, checkpoint, args) for pair in pairs for role, args in zip(("prefill", "decode"), pair, strict=True)]
    with daemons(*specs) as (p1, d2, p2, d1):
        for seed, (prefill, decode) in enumerate(((p1, d2), (p2, d1))):
            router = start_router(checkpoint, [prefill.address], [decode.address])
            try:
                assert (info(prefill).tp_size, info(decode).tp_size) == ((1, 2) if seed == 0 else (2, 1))
                # 45 tokens: parts end at 8, ..., 40 (5), then the final ticket; 8 tokens: one chunk, one ticket.
                for prompt, num_parts, stream in ((random_prompt(10 * seed, 45), 5, False),
                                                  (random_prompt(10 * seed + 1, 45), 5, True),
                                                  (random_prompt(10 * seed + 2, CHUNK), 0, True)):
                    got = _served(router.url, prefill, decode, prompt, stream)
                    assert got == (reference(prompt), num_parts, num_parts + 1), (seed, len(prompt), got)
            finally:
                stop_router(router)
            assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0
            assert metric_total(decode, "pdserve_kv_transfer_failures_total") == 0
            assert _wait_unpinned(prefill) == 0  # every reading rank notified every part
            assert (info(decode).num_running, info(decode).num_waiting) == (0, 0)


# Ids below the checkpoint's vocabulary; the two prompts share no prefix. 285 tokens: 17 full blocks of 16, so a
# host-tier hit covers 272, which is not a multiple of the part alignment lcm(16, 32) = 32.
PROMPT = [(7 * i + 3) % 300 + 10 for i in range(285)]
OTHER = [(11 * i + 5) % 300 + 10 for i in range(285)]


def test_parts_of_a_prompt_the_prefill_worker_serves_from_its_host_tier(checkpoint: str) -> None:
    reference = _reference(checkpoint)
    # The prefill worker's device pool holds one such prompt (24 blocks of 16); the decode worker's too (12 of 32).
    prefill_args = ("--block-size", "16", "--num-kv-blocks", "24", "--kv-offload-gib", "0.02", "--dtype", "float32",
                    "--max-num-batched-tokens", str(CHUNK))
    decode_args = ("--block-size", "32", "--num-kv-blocks", "12", "--kv-layout", "per_layer", "--dtype", "float32")
    with stack(checkpoint, prefill_args=prefill_args, decode_args=decode_args) as s:
        (prefill,), (decode,) = s.prefill, s.decode
        # Cold: parts end at 32, ..., 256 (8), the final ticket has 256..284.
        assert _served(s.url, prefill, decode, PROMPT, False) == (reference(PROMPT), 8, 9)
        deadline = time.monotonic() + 20  # the host tier stores PROMPT's 17 blocks in the background
        while metric_total(prefill, "pdserve_kv_offload_spans", 'state="cached"') < 17:
            assert time.monotonic() < deadline, "PROMPT never reached the host tier"
            time.sleep(0.1)
        assert _served(s.url, prefill, decode, OTHER, True)[1:] == (8, 9)  # pushes PROMPT out of both device pools
        host_bytes = metric_total(decode, "pdserve_kv_transfer_source_bytes_total", 'source="host"')
        # Again: a host-tier hit up to token 272, loaded into device blocks, then tokens 272..279 computed. One
        # part (0..256, from those device blocks), then the last: 256..272 from the host tier, 272..284 the device.
        assert _served(s.url, prefill, decode, PROMPT, False) == (reference(PROMPT), 1, 2)
        host_hits = 'result="hit",role="prefill",tier="host"'  # labels as /metrics orders them
        assert metric_total(prefill, "pdserve_kv_prefix_lookups_total", host_hits) == 1
        assert metric_total(decode, "pdserve_kv_transfer_source_bytes_total", 'source="host"') > host_bytes
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0
        assert metric_total(decode, "pdserve_kv_transfer_failures_total") == 0
        # Nothing stays pinned on either tier: the parts' device blocks and the host spans are freed on notification.
        deadline = time.monotonic() + 20
        while metric_total(prefill, "pdserve_kv_blocks", 'state="pinned_for_transfer"') or \
                metric_total(prefill, "pdserve_kv_offload_spans", 'state="used"'):
            assert time.monotonic() < deadline, "blocks or host spans still pinned"
            time.sleep(0.1)
        assert metric_total(prefill, "pdserve_kv_lease_expiries_total") == 0
