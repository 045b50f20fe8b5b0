"""Engine vs Hugging Face transformers 5.23 on a small random Qwen3-MoE checkpoint (``tests/checkpoints.py``).

Three layers, the second dense (``mlp_only_layers``), the others 8 experts of 32 with renormalised top-2 routing;
Qwen3's q/k norms; the router and the norms perturbed (transformers starts them at zero and one, which would hide a
router read wrong). Prompts of 5-40 tokens, the last two sharing 16 tokens with the second, run together under a
24-token budget (chunked prefill) with 4-token blocks: every computed position's logits match transformers'
(float32, max relative error < 1e-4) and 32 greedy tokens are identical; then with prefix-cache hits, at TP 2 (each
rank half of every expert's width), and as an FP8 block checkpoint against transformers on its dequantized weights.
The config reader refuses what it does not run, by field.
"""

from __future__ import annotations

import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.model_config.hf import ModelConfig, preset
from services.engine.models.moe import RoutedExperts
from services.engine.models.qwen3_moe import Qwen3MoeBlock
from services.engine.parallel import ParallelConfig
from services.engine.start import start_engine
from tests.checkpoints import hf_config, make_checkpoint
from tests.fp8_checkpoints import Fp8Options, fp8_checkpoint
from tests.parity import Reference, assert_matches, reference_of, run_to_completion

NUM_TOKENS = 32
PROMPT_LENS = (5, 17, 33, 40)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> Reference:
    directory, hf = checkpoint
    return reference_of(directory, hf, PROMPT_LENS, NUM_TOKENS, seed=7, shared_from=1, shared_len=16)


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
                                  max_num_batched_tokens=24, **kw))


def test_chunked_batch_matches_hf(reference: Reference) -> None:
    engine = _engine(reference.checkpoint)
    kinds = [type(layer.mlp).__name__ for layer in engine.runtime.model.layers]
    assert kinds == ["Qwen3MoeBlock", "MLP", "Qwen3MoeBlock"]
    _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
    assert_matches(reference.tokens, reference.logits, outputs)


def test_prefix_cache_hits_match_hf(reference: Reference) -> None:
    engine = _engine(reference.checkpoint)
    _, first = run_to_completion(engine, reference.prompts[1:2], GREEDY)
    assert_matches(reference.tokens[1:2], reference.logits[1:2], first)
    _, sharing = run_to_completion(engine, reference.prompts[2:], GREEDY)
    assert [o.num_cached_tokens for o in sharing] == [16, 16]
    assert_matches(reference.tokens[2:], reference.logits[2:], sharing)


def test_tensor_parallel_matches_hf(reference: Reference) -> None:
    """TP 2 (a follower rank in its own process, gloo on CPU): half the heads and half of every expert's width."""
    config = EngineConfig(model=reference.checkpoint, device="cpu", dtype="float32", block_size=4,
                          num_kv_blocks=256, max_num_batched_tokens=24, parallel=ParallelConfig(2, 0))
    engine = start_engine(config, ["cpu", "cpu"])
    try:
        block = engine.runtime.model.layers[0].mlp
        assert isinstance(block, Qwen3MoeBlock) and block.experts.down.shape[2] == 32 // 2
        _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
        assert_matches(reference.tokens, reference.logits, outputs)
    finally:
        engine.close()


def test_fp8_block_checkpoint_matches_hf_on_its_dequantized_weights(checkpoint, tmp_path) -> None:
    """Qwen3-30B-A3B-FP8's format, scaled down: 128 x 128 blocks everywhere (ragged), the router as stored."""
    plain, _ = checkpoint
    directory, hf = fp8_checkpoint(plain, tmp_path / "fp8", Fp8Options("fp8", block_size=(128, 128)))
    ref = reference_of(directory, hf, PROMPT_LENS[:3], 12, seed=3, shared_from=0, shared_len=4)
    _, outputs = run_to_completion(_engine(ref.checkpoint), ref.prompts,
                                   SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, return_logits=True))
    assert_matches(ref.tokens, ref.logits, outputs)


def test_presets_and_refusals() -> None:
    big = preset("qwen3-30b-a3b")
    assert 30.4e9 < big.num_parameters < 30.7e9 and big.qwen3_moe.num_experts == 128
    tiny = preset("qwen3-moe-tiny")
    assert [tiny.qwen3_moe.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    d = hf_config("qwen3_moe").to_dict()
    assert ModelConfig.from_hf_dict(d).qwen3_moe.mlp_only_layers == (1,)
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf_dict({**d, "use_sliding_window": True})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**d, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf_dict({**d, "mlp_only_layers": "all"})


def test_the_tiny_preset_runs_and_the_experts_path_is_the_loop_on_cpu() -> None:
    engine = LLMEngine(EngineConfig(model="dummy:qwen3-moe-tiny", device="cpu", dtype="float32", num_kv_blocks=64))
    experts = [m for m in engine.runtime.model.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) == 3 and all(m.path == "loop" for m in experts)
    (out,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 4
