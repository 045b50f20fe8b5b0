"""Engine vs Hugging Face transformers on small random checkpoints of every architecture.

For a batch of prompts of different lengths run together (chunked prefill under a small token
budget), in every KV layout, with and without prefix-cache hits and across forced preemption:
the logits of every computed position match HF's (fp32, max relative error < 1e-4) and 32 greedy
tokens are identical.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.kv.spec.layout import BlockOrder, LayoutKind
from tests.checkpoints import ARCHITECTURES
from tests.parity import Reference, assert_matches, hf_reference, run_to_completion

# The GPU machine runs this file once with PDSERVE_TEST_DEVICE=cuda (see bench/RESULTS.md).
DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
NUM_TOKENS = 32
PROMPT_LENS = (5, 17, 33, 40)
LAYOUTS = [(k, o) for k in LayoutKind for o in BlockOrder if o in k.orders]  # heads-outer holds HND only
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def reference(request, tmp_path_factory) -> Reference:
    # The last two prompts share their first 16 tokens with the second: in-batch prefix sharing.
    return hf_reference(request.param, tmp_path_factory.mktemp(request.param), PROMPT_LENS, NUM_TOKENS, seed=7,
                        shared_from=1, shared_len=16)


def _engine(ref: Reference, kind: LayoutKind, order: BlockOrder, num_kv_blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ref.checkpoint, device=DEVICE, dtype="float32", block_size=4, kv_layout=kind,
        kv_block_order=order, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=24,
    ))


@pytest.mark.parametrize(("kind", "order"), LAYOUTS, ids=lambda x: x.value)
def test_batch_matches_hf(reference: Reference, kind: LayoutKind, order: BlockOrder) -> None:
    engine = _engine(reference, kind, order, num_kv_blocks=256)
    _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
    assert_matches(reference.tokens, reference.logits, outputs)


@pytest.mark.parametrize(("kind", "order"), LAYOUTS, ids=lambda x: x.value)
def test_prefix_cache_hits_match_hf(reference: Reference, kind: LayoutKind, order: BlockOrder) -> None:
    engine = _engine(reference, kind, order, num_kv_blocks=256)
    run_to_completion(engine, reference.prompts, GREEDY)  # warm the prefix cache
    _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
    assert all(o.num_cached_tokens > 0 for o in outputs[1:]), "second run should hit the prefix cache"
    assert_matches(reference.tokens, reference.logits, outputs)


@pytest.mark.parametrize(("kind", "order"), LAYOUTS, ids=lambda x: x.value)
def test_preemption_matches_hf(reference: Reference, kind: LayoutKind, order: BlockOrder) -> None:
    # 40 blocks of 4 tokens cannot hold all four sequences at full length (~225 tokens). A sliding-
    # window model (Mistral) frees blocks that left the window, so it needs a smaller pool to preempt.
    config = json.loads((Path(reference.checkpoint) / "config.json").read_text())
    num_blocks = 20 if config.get("sliding_window") else 40
    engine = _engine(reference, kind, order, num_kv_blocks=num_blocks)
    requests, outputs = run_to_completion(engine, reference.prompts, GREEDY)
    assert sum(r.num_preemptions for r in requests) > 0, "the pool is too small not to preempt"
    assert_matches(reference.tokens, reference.logits, outputs)
    assert engine.kv_manager.pool(0).num_free_blocks == num_blocks
