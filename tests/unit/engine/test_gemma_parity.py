"""Engine vs Hugging Face transformers 5.23 on small random Gemma-2, Gemma-3 and Gemma-4 checkpoints.

Each checkpoint mixes sliding-window layers (window 16) with full ones and the prompts are 40-60
tokens, so the window really cuts. Prompts of different lengths run together under a small token
budget (chunked prefill), in the cross-layer and the per-layer KV layout, and again with
prefix-cache hits: the logits of every computed position match HF's (fp32, max relative error
< 1e-4) and 32 greedy tokens are identical. Gemma-4's prefill skip over its KV-shared layers
changes nothing. A transformers-saved SmolLM2 directory decodes like the GGUF it came from.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.kv.spec.layout import BlockOrder, LayoutKind
from tests.checkpoints import GEMMA_ARCHITECTURES, make_checkpoint
from tests.parity import Reference, assert_matches, hf_reference, run_to_completion

# The GPU machine may run this file with PDSERVE_TEST_DEVICE=cuda, as test_engine_parity.py.
DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
NUM_TOKENS = 32
PROMPT_LENS = (40, 52, 60)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
LAYOUTS = [(LayoutKind.CROSS_LAYER, BlockOrder.NHD), (LayoutKind.PER_LAYER, BlockOrder.HND)]


@pytest.fixture(scope="module", params=GEMMA_ARCHITECTURES)
def reference(request, tmp_path_factory) -> Reference:
    # The last two prompts start with the first one's first 24 tokens: prefix sharing in a batch.
    return hf_reference(request.param, tmp_path_factory.mktemp(request.param), PROMPT_LENS, NUM_TOKENS, seed=11,
                        shared_from=0, shared_len=24)


def _engine(checkpoint: str, kind: LayoutKind, order: BlockOrder, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=checkpoint, device=DEVICE, dtype="float32", block_size=4, kv_layout=kind, kv_block_order=order,
        num_kv_blocks=160, max_num_batched_tokens=24, **kw,
    ))


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return run_to_completion(engine, prompts, params)[1]


def _check(ref: Reference, outputs) -> None:
    assert_matches(ref.tokens, ref.logits, outputs)


@pytest.mark.parametrize(("kind", "order"), LAYOUTS, ids=lambda x: x.value)
def test_matches_hf_with_chunked_prefill_and_prefix_hits(reference: Reference, kind: LayoutKind,
                                                          order: BlockOrder) -> None:
    engine = _engine(reference.checkpoint, kind, order)
    assert len(engine.kv_layout.groups) == 2  # one sliding-window group, one full group
    _check(reference, _run(engine, reference.prompts))
    again = _run(engine, reference.prompts)  # the prefix cache now holds every prompt
    assert all(o.num_cached_tokens >= 16 for o in again), [o.num_cached_tokens for o in again]
    _check(reference, again)
    # Without return_logits only the sampled rows are needed: Gemma-4 then skips the others
    # through its KV-shared layers (with logits returned, every row is needed).
    plain = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in _run(engine, reference.prompts, plain)] == reference.tokens


def test_gemma4_kv_shared_prefill_skip_changes_nothing(tmp_path) -> None:
    """Same sampled logits with the skip on and off, while it really drops rows on the way.

    The batch mixes a prompt returning every position's logits (all rows kept) with sampling
    prompts whose prefill is chunked (mid-prefill chunks keep no row, the last keeps one).
    """
    directory, _ = make_checkpoint("gemma4", tmp_path / "gemma4")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (45, 58, 9)]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with_logits = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, return_logits=True)
    results = {}
    for skip in (True, False):
        engine = _engine(str(directory), LayoutKind.CROSS_LAYER, BlockOrder.NHD, kv_shared_prefill_skip=skip)
        engine.runner.kv_shared_prefill_skip = skip  # in case the engine does not pass the flag on
        assert engine.model.skips_to_tail
        rows, sampled = [], []
        forward, execute = engine.model.forward, engine.runner.execute

        def counting_forward(*args, _forward=forward, _rows=rows, **kw):
            hidden = _forward(*args, **kw)
            _rows.append((len(args[0]), hidden.shape[0]))
            return hidden

        def recording_execute(chunks, _execute=execute, _sampled=sampled):
            step = _execute(chunks)
            _sampled.append(step.sample_logits.clone())
            return step

        engine.model.forward = counting_forward
        engine.runner.execute = recording_execute
        requests = [engine.add_request(f"r{i}", p, with_logits if i == 2 else plain) for i, p in enumerate(prompts)]
        while engine.has_unfinished_requests():
            engine.step()
        results[skip] = ([r.output_token_ids for r in requests], sampled, rows)
    (tokens_on, sampled_on, rows_on), (tokens_off, sampled_off, rows_off) = results[True], results[False]
    assert tokens_on == tokens_off
    assert len(sampled_on) == len(sampled_off)
    for on, off in zip(sampled_on, sampled_off, strict=True):
        # A step that samples nothing may hand back [0] or [0, vocab] (the CUDA path's pipelined steps do).
        assert on.shape == off.shape or on.numel() == off.numel() == 0, (on.shape, off.shape)
        if on.numel():
            assert ((on - off).abs().max() / off.abs().max()) < 1e-5
    assert all(n_in == n_out for n_in, n_out in rows_off)  # no skip: every row comes out
    assert any(n_out < n_in for n_in, n_out in rows_on)  # skip: rows were dropped
    assert any(n_out == 0 for _, n_out in rows_on)  # a step where no row needed output


def test_smollm2_saved_by_transformers_decodes_like_the_gguf(tmp_path) -> None:
    """transformers 5.23's save_pretrained of the bundled GGUF (config with rope_parameters) ->
    the engine's greedy tokens equal the engine's on the GGUF itself."""
    import transformers

    from tests.unit._smollm2 import smollm2_path, smollm2_tokenizer, transformers_model

    # A GGUF-loaded model counts as quantized and will not save: the same weights in a plain model.
    gguf_model = transformers_model()
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)
    with torch.device("meta"):  # no random init of weights about to be replaced (~2 s): the GGUF's, assigned
        plain = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig.from_dict(config),
                                                              dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    directory = tmp_path / "smollm2"
    plain.save_pretrained(directory, safe_serialization=True)
    saved = json.loads((directory / "config.json").read_text())
    assert saved["rope_parameters"]["rope_theta"] == 100000.0 and "rope_theta" not in saved
    prompt = smollm2_tokenizer().encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
                                        add_special_tokens=False)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = []
    for model in (str(directory), str(smollm2_path())):
        engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=16))
        outputs.append(engine.generate([prompt], params)[0].token_ids)
    assert len(prompt) >= 16 and len(outputs[0]) == 24
    assert outputs[0] == outputs[1]
