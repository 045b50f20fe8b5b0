"""load_gguf on tiny Gemma-2 / Gemma-3 GGUF files, against transformers 5.23 loading the same file.

The files are written here as llama.cpp's converter would: Gemma's norm weights stored as 1 + w,
q/k rows in HF order, the sandwich norms under llama.cpp's names. Both have sliding-window layers
(window 8) and full ones, and the prompts are 20 tokens long, so the window really cuts. The
config, every tensor, the logits of every position (fp32, relative error < 1e-4) and 16 greedy
tokens match transformers'.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.loading.gguf import load_gguf
from services.engine.model_config.hf import ModelConfig
from tests.gguf_files import decoder_shapes, finish
from tests.parity import assert_matches, hf_greedy, run_to_completion

VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, WINDOW = 96, 64, 96, 2, 1, 8
NUM_TOKENS = 16
CONFIG_FIELDS = [
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
    "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id", "attention_bias",
    "hidden_activation", "query_pre_attn_scalar", "sliding_window", "layer_types",
    "attn_logit_softcapping", "final_logit_softcapping",
]
# transformers 5.23 reads no softcap, query scale or window pattern from a Gemma GGUF: it takes its
# config defaults (Gemma-2: caps 50 / 30, query_pre_attn_scalar 256; Gemma-3: pattern 6). The
# files below hold the values that make those defaults right, so the two loaders can agree.
GEMMA2 = dict(layers=4, head_dim=256, tied=True, attn_cap=50.0, final_cap=30.0)
# Gemma-3: 6 layers = 5 sliding + 1 full; head_dim 32 with attention.scale 1/16 = 256 ** -0.5.
GEMMA3 = dict(layers=6, head_dim=32, tied=False, scale=1 / 16)


def _write_gemma(path: Path, arch: str, *, layers: int, head_dim: int, tied: bool, attn_cap: float | None = None,
                 final_cap: float | None = None, scale: float | None = None, window: int | None = WINDOW,
                 pattern: int | list[bool] | None = None, rope_scale: float | None = None) -> Path:
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_block_count(layers)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6 if arch == "gemma3" else 1e4)
    writer.add_vocab_size(VOCAB)
    # Real Gemma files carry a SentencePiece ("llama") tokenizer (tested on its own in
    # tests/unit/text/test_gguf_sentencepiece.py); a small byte-level BPE one is enough here.
    tokens = [chr(c) for c in range(33, 33 + VOCAB - 2)] + ['!"', "#$"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(['! "', "# $"])
    writer.add_token_types([1] * VOCAB)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    if window is not None:
        writer.add_sliding_window(window)
    if attn_cap is not None:
        writer.add_attn_logit_softcapping(attn_cap)
    if final_cap is not None:
        writer.add_final_logit_softcapping(final_cap)
    if scale is not None:
        writer.add_float32(f"{arch}.attention.scale", scale)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    if rope_scale is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scale)

    shapes = decoder_shapes(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=head_dim,
                            intermediate=INTERMEDIATE, layers=layers, tied=tied, qk_norm=arch == "gemma3",
                            layer_norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"))
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            # llama.cpp's converter writes Gemma's w as 1 + w (the model computes x * (1 + w)).
            writer.add_tensor(name, (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32))
        else:
            values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            writer.add_tensor(name, values.astype(np.float16) if name != "token_embd.weight" else values)
    finish(writer)
    return path


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def files(request, tmp_path_factory):
    arch = request.param
    options = GEMMA2 if arch == "gemma2" else GEMMA3
    path = _write_gemma(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch, **options)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return arch, path, reference


def test_config_matches_transformers(files):
    arch, path, reference = files
    config = load_gguf(path).config
    for key in CONFIG_FIELDS:
        assert hasattr(reference.config, key), key
        expected = getattr(reference.config, key)
        if isinstance(expected, float):
            assert config[key] == pytest.approx(expected, rel=1e-6), key
        else:
            assert config[key] == expected, key
    kinds = set(config["layer_types"])
    assert kinds == {"sliding_attention", "full_attention"}
    parsed = ModelConfig.from_hf_dict(config)
    assert parsed.sliding_window == WINDOW and parsed.qk_norm == (arch == "gemma3")


def test_tensors_equal_transformers(files):
    _, path, reference = files
    checkpoint = load_gguf(path)
    expected = reference.state_dict()
    ours = dict(checkpoint.tensors())
    tied = {"lm_head.weight"} if checkpoint.config["tie_word_embeddings"] else set()
    assert set(ours) == set(expected) - tied
    for name, tensor in ours.items():
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name
    # The norms came back to HF's convention: around 0, not around 1.
    assert ours["model.norm.weight"].abs().mean() < 0.5


def test_engine_matches_transformers(files):
    _, path, reference = files
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (20, 17)]
    tokens, logits = hf_greedy(reference, prompts, NUM_TOKENS)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
    _, outputs = run_to_completion(engine, prompts, params)
    assert [o.num_cached_tokens for o in outputs] == [0, 0]  # so every position is checked
    assert_matches(tokens, logits, outputs)


# ------------------------------------------------------------------------------------------------
# Values transformers does not read, and missing ones


def test_values_read_from_the_file(tmp_path):
    path = _write_gemma(tmp_path / "g2.gguf", "gemma2", layers=2, head_dim=16, tied=True,
                        attn_cap=40.0, final_cap=20.0)
    config = load_gguf(path).config
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (40.0, 20.0)
    assert config["query_pre_attn_scalar"] == 16  # llama.cpp: head_dim unless a 27B
    assert config["layer_types"] == ["sliding_attention", "full_attention"]

    path = _write_gemma(tmp_path / "g3.gguf", "gemma3", layers=4, head_dim=16, tied=True,
                        pattern=[True, False, True, False], rope_scale=8.0)
    config = load_gguf(path).config
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["rope_parameters"] == {
        "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert config["query_pre_attn_scalar"] == 16
    assert config["attn_logit_softcapping"] is None and config["final_logit_softcapping"] is None
    ModelConfig.from_hf_dict(config)

    path = _write_gemma(tmp_path / "g3b.gguf", "gemma3", layers=2, head_dim=16, tied=True, pattern=2)
    assert load_gguf(path).config["layer_types"] == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize(
    "arch, options, missing",
    [
        ("gemma2", {"attn_cap": 50.0, "final_cap": 30.0, "window": None}, "gemma2.attention.sliding_window"),
        ("gemma3", {"window": None}, "gemma3.attention.sliding_window"),
        ("gemma2", {"final_cap": 30.0}, "gemma2.attn_logit_softcapping"),
        ("gemma2", {"attn_cap": 50.0}, "gemma2.final_logit_softcapping"),
    ],
)
def test_missing_values_are_errors(tmp_path, arch, options, missing):
    path = _write_gemma(tmp_path / "m.gguf", arch, layers=2, head_dim=16, tied=True, **options)
    with pytest.raises(ValueError, match=r"m\.gguf: no " + re.escape(missing)):
        load_gguf(path)
