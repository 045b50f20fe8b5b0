"""Small random Hugging Face checkpoints, written with ``save_pretrained``, one per architecture."""

from __future__ import annotations

from pathlib import Path

import torch

# Shared small shape: GQA (4 query heads over 2 KV heads), 2 layers, a vocabulary small enough
# to be fast and large enough that greedy ties are rare. initializer_range is larger than HF's
# default so the logits are peaked and greedy decoding is robust to fp32 rounding.
_BASE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6,
)

ARCHITECTURES = ("llama", "llama_tied", "qwen2", "qwen3", "mistral")


def hf_config(arch: str):
    import transformers

    if arch == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        return transformers.LlamaConfig(**_BASE, rope_scaling=rope, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "llama_tied":
        return transformers.LlamaConfig(**_BASE, tie_word_embeddings=True, attention_bias=True)
    if arch == "qwen2":
        return transformers.Qwen2Config(**_BASE, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**{**_BASE, "head_dim": 32}, tie_word_embeddings=False)
    if arch == "mistral":
        # A window shorter than the test sequences, so the windowed mask is exercised.
        return transformers.MistralConfig(**_BASE, sliding_window=24, tie_word_embeddings=False)
    raise ValueError(arch)


def make_checkpoint(arch: str, directory: Path, seed: int = 0):
    """Create, save and return (directory, HF model in eval mode, fp32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch), attn_implementation="sdpa")
    model = model.float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model
