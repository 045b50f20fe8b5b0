"""Engine vs Hugging Face transformers 5.23 on a small random gpt-oss checkpoint (``tests/checkpoints.py``).

Four layers alternating a 16-token sliding window and full attention (two KV-cache groups), learned sinks per head,
q/k/v/o biases, YaRN, 8 biased experts of 64 with top-2 routing and a SwiGLU clamped at 1.5 (so the clamps bite);
the sinks, biases and norms perturbed away from transformers' initial zeros and ones. Prompts of 5-40 tokens (longer
than the window), the last two sharing 16 tokens with the second, under a 24-token budget (chunked prefill) with
4-token blocks: every computed position's logits match transformers' (float32, max relative error < 1e-4) and 32
greedy tokens are identical; then with prefix-cache hits, at TP 2, and as an MXFP4 checkpoint against transformers
loading that checkpoint (its own dequantization), dequantized at load and kept as stored. The config reader and the
MXFP4 reader refuse what they do not run, by name.
"""

from __future__ import annotations

import os

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.loading.quant.mxfp4 import dequantize_mxfp4, mxfp4_tensors, parse_mxfp4, quantize_mxfp4
from services.engine.model_config.hf import ModelConfig, preset
from services.engine.models.gpt_oss import GptOssMoE, clamped_swiglu
from services.engine.parallel import ParallelConfig
from services.engine.start import start_engine
from services.kv.spec.groups import AttentionKind
from tests.checkpoints import hf_config, make_checkpoint
from tests.mxfp4_checkpoints import MXFP4_CONFIG, mxfp4_checkpoint
from tests.parity import Reference, assert_matches, reference_of, run_to_completion

NUM_TOKENS = 32
PROMPT_LENS = (5, 17, 33, 40)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> Reference:
    directory, hf = checkpoint
    return reference_of(directory, hf, PROMPT_LENS, NUM_TOKENS, seed=7, shared_from=1, shared_len=16)


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
                                  max_num_batched_tokens=24, **kw))


def test_chunked_batch_matches_hf(reference: Reference) -> None:
    engine = _engine(reference.checkpoint)
    model = engine.runtime.model
    assert all(isinstance(layer.mlp, GptOssMoE) for layer in model.layers)
    assert [g.kind for g in engine.kv_layout.groups] == [AttentionKind.SLIDING_WINDOW, AttentionKind.FULL]
    assert model.layers[0].self_attn.sinks.dtype == torch.float32
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
    """TP 2 (a follower rank in its own process, gloo on CPU): half the heads with their sinks, half of every
    expert's width with its gate/up biases, the down biases on rank 0 only."""
    config = EngineConfig(model=reference.checkpoint, device="cpu", dtype="float32", block_size=4,
                          num_kv_blocks=256, max_num_batched_tokens=24, parallel=ParallelConfig(2, 0))
    engine = start_engine(config, ["cpu", "cpu"])
    try:
        layer = engine.runtime.model.layers[0]
        assert layer.mlp.experts.down.shape[2] == 64 // 2 and layer.self_attn.sinks.shape == (2,)
        _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
        assert_matches(reference.tokens, reference.logits, outputs)
    finally:
        engine.close()


def test_mxfp4_checkpoint_matches_hf_loading_it(checkpoint, tmp_path) -> None:
    """gpt-oss as released: MXFP4 experts. transformers dequantizes the checkpoint with its own code; pdserve's
    tokens and logits equal that model's, and differ from the unquantized checkpoint's (the format is read)."""
    plain, hf_plain = checkpoint
    directory, hf = mxfp4_checkpoint(plain, tmp_path / "mxfp4")
    ref = reference_of(directory, hf, PROMPT_LENS[:3], 16, seed=3, shared_from=0, shared_len=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, return_logits=True)
    _, outputs = run_to_completion(_engine(ref.checkpoint), ref.prompts, params)
    assert_matches(ref.tokens, ref.logits, outputs)
    plain_ref = reference_of(plain, hf_plain, PROMPT_LENS[:3], 16, seed=3, shared_from=0, shared_len=4)
    assert plain_ref.tokens != ref.tokens


def test_mxfp4_experts_kept_as_stored_match_hf(checkpoint, tmp_path) -> None:
    """``--quantization mxfp4``: the experts stay MXFP4 in the model (a quarter of the bytes) and every step's
    grouped GEMMs read them (on CPU the torch reference of ``ops.mxfp4_moe``); TP 1 and TP 2 (each rank its rows of
    gate/up, its 32-value groups of down) give transformers' tokens and logits on the checkpoint."""
    plain, _ = checkpoint
    directory, hf = mxfp4_checkpoint(plain, tmp_path / "mxfp4")
    ref = reference_of(directory, hf, PROMPT_LENS[:3], 12, seed=5, shared_from=0, shared_len=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, return_logits=True)
    engine = _engine(ref.checkpoint, quantization="mxfp4")
    experts = engine.runtime.model.layers[0].mlp.experts
    assert experts.mxfp4 and experts.gate_up is None and experts.gate_up_blocks.dtype == torch.uint8
    _, outputs = run_to_completion(engine, ref.prompts, params)
    assert_matches(ref.tokens, ref.logits, outputs)
    config = EngineConfig(model=ref.checkpoint, device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
                          max_num_batched_tokens=24, quantization="mxfp4", parallel=ParallelConfig(2, 0))
    tp = start_engine(config, ["cpu", "cpu"])
    try:
        assert tp.runtime.model.layers[0].mlp.experts.down_scales.shape == (8, 64, 1)  # 2 groups, one a rank
        _, outputs = run_to_completion(tp, ref.prompts, params)
        assert_matches(ref.tokens, ref.logits, outputs)
    finally:
        tp.close()
    with pytest.raises(ValueError, match="no MXFP4 quantization_config"):
        _engine(str(plain), quantization="mxfp4")


def test_mxfp4_codes_scales_and_refusals() -> None:
    blocks = torch.tensor([[[0x21, 0xF8] + [0] * 14]], dtype=torch.uint8)  # codes 1, 2 | 8 (-0), 15 (-6)
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2 ** 1
    values = dequantize_mxfp4(blocks, scales, torch.float32)
    assert values.shape == (1, 32) and values[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]
    weights = torch.randn(3, 5, 64)
    packed, exps = quantize_mxfp4(weights)
    assert packed.shape == (3, 5, 2, 16) and exps.shape == (3, 5, 2)
    back = dequantize_mxfp4(packed, exps, torch.float32)
    assert ((back - weights).abs() <= weights.abs().amax() / 6).all()  # within half the coarsest e2m1 step
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(back), torch.float32), back)  # e2m1 values are fixed points
    scheme = parse_mxfp4(MXFP4_CONFIG)
    name = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(ValueError, match="has no .*_scales"):
        list(mxfp4_tensors([(name + "_blocks", packed)], scheme))
    with pytest.raises(ValueError, match="expected uint8"):
        list(mxfp4_tensors([(name + "_blocks", packed.int())], scheme))
    with pytest.raises(ValueError, match=r"\[\.\.\., G, 16\]"):
        list(mxfp4_tensors([(name + "_blocks", packed), (name + "_scales", exps[..., :1])], scheme))
    with pytest.raises(ValueError, match="modules_to_not_convert"):
        list(mxfp4_tensors([("model.layers.0.self_attn.q_proj.weight_blocks", packed)], scheme))
    ((out_name, out),) = mxfp4_tensors([(name + "_blocks", packed), (name + "_scales", exps)], scheme)
    assert out_name == name and out.shape == (3, 64, 5) and out.dtype == torch.bfloat16  # HF's [E, in, out]


def test_clamped_swiglu() -> None:
    gate_up = torch.tensor([[10.0, -3.0, 10.0, -9.0]])  # gates (10, -3), ups (10, -9)
    out = clamped_swiglu(gate_up, 1.702, 7.0)
    expected = [(7 + 1) * 7 * torch.sigmoid(torch.tensor(7 * 1.702)), (-7 + 1) * -3 * torch.sigmoid(
        torch.tensor(-3 * 1.702))]
    assert torch.allclose(out[0], torch.stack(expected))


def test_presets_and_refusals() -> None:
    small, big = preset("gpt-oss-20b"), preset("gpt-oss-120b")
    assert 20.8e9 < small.num_parameters < 21.0e9 and 116.7e9 < big.num_parameters < 116.9e9
    assert small.gpt_oss.num_experts == 32 and big.gpt_oss.num_experts == 128
    assert [layer.sliding_window for layer in small.layers[:2]] == [128, None]
    d = hf_config("gpt_oss").to_dict()
    config = ModelConfig.from_hf_dict(d)
    assert config.architecture == "gpt_oss" and config.attention_bias and config.o_proj_bias
    assert config.rope.rope_type == "yarn" and not config.rope.truncate
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict({**d, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict({**d, "layer_types": ["sliding_attention"]})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict({**d, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**d, "num_experts_per_tok": 9})


def test_the_tiny_mxfp4_preset_runs() -> None:
    """``dummy:gpt-oss-tiny-mxfp4``: the dummy weights quantized to MXFP4 and read back through the loader,
    dequantized or kept as stored (the same values either way)."""
    outs = {}
    for name, quantization in (("gpt-oss-tiny", "auto"), ("gpt-oss-tiny-mxfp4", "auto"),
                               ("gpt-oss-tiny-mxfp4", "mxfp4")):
        engine = LLMEngine(EngineConfig(model=f"dummy:{name}", device="cpu", dtype="float32", num_kv_blocks=64,
                                        quantization=quantization))
        (out,) = engine.generate([[5, 6, 7, 8] * 6], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                                   return_logits=True))
        assert len(out.token_ids) == 6
        outs[name, quantization] = torch.cat([chunk for _, chunk in out.logits])
    dequantized, kept = outs["gpt-oss-tiny-mxfp4", "auto"], outs["gpt-oss-tiny-mxfp4", "mxfp4"]
    assert not torch.equal(outs["gpt-oss-tiny", "auto"], dequantized)  # the experts rounded
    assert ((kept - dequantized).abs().max() / dequantized.abs().max()) < 1e-5  # the same values, kept as stored


@pytest.mark.skipif(os.environ.get("PDSERVE_TEST_DEVICE") != "cuda", reason="needs PDSERVE_TEST_DEVICE=cuda")
def test_cuda_engine_matches_hf(checkpoint, tmp_path) -> None:
    """On CUDA in float32: the Triton attention kernel with sinks (paged and split; the dense half is 16-bit only:
    ``test_attention_backends``), decode CUDA graphs, and the experts as MXFP4 through the Triton grouped GEMM or
    dequantized, against transformers on the MXFP4 checkpoint (CPU)."""
    plain, _ = checkpoint
    directory, hf = mxfp4_checkpoint(plain, tmp_path / "mxfp4")
    ref = reference_of(directory, hf, (5, 40, 300), 16, seed=11, shared_from=0, shared_len=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, return_logits=True)
    for quantization in ("auto", "none"):
        engine = LLMEngine(EngineConfig(model=ref.checkpoint, device="cuda", dtype="float32", block_size=16,
                                        num_kv_blocks=256, quantization=quantization))
        assert engine.runtime.model.layers[0].mlp.experts.mxfp4 == (quantization == "auto")
        _, outputs = run_to_completion(engine, ref.prompts, params)
        for out in outputs:
            out.logits = [(start, chunk.cpu()) for start, chunk in out.logits]
        assert_matches(ref.tokens, ref.logits, outputs, rel_tol=1e-3)
