"""The model ``bench/router_overhead.py`` serves: a random 2-layer Llama (hidden 64, 131072 positions, bf16) with
the bundled SmolLM2 tokenizer and chat template, written as a Hugging Face directory.

The router then tokenizes real text with a real vocabulary, a 200 KB body (~100K tokens) fits the context, and
the worker's model costs next to nothing, so what the bench times is what sits around the model. Written with the
project's own pieces, no transformers: the config.json dict is read back by the engine's reader
(``ModelConfig.from_hf_dict``), the weights are the engine's seeded dummy tensors (``dummy_weights``) saved with
safetensors, and the tokenizer is the bundled one's ``backend_json()``. About 8 MB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from services.engine.loading.weights import dummy_weights
from services.engine.model_config.hf import ModelConfig
from services.engine.models import build_model
from services.engine.parallel import ParallelConfig
from services.text.default_model import default_model_path
from services.text.tokenizer import Tokenizer

MAX_POSITIONS = 131072


def overhead_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """The model's config.json: the dummy ``tiny`` preset's shape with the tokenizer's vocabulary and 128K positions."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tokenizer.vocab_size,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": MAX_POSITIONS, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": sorted(tokenizer.eos_token_ids),
    }


def _tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    def text(token_id: int | None) -> str | None:
        return tokenizer.id_to_token(token_id) if token_id is not None else None

    eos = sorted(tokenizer.eos_token_ids)
    return {"bos_token": text(tokenizer.bos_token_id), "eos_token": text(eos[0]) if eos else None,
            "add_bos_token": tokenizer.add_bos_token, "chat_template": tokenizer.chat_template}


def make_overhead_model(directory: str | Path, seed: int = 0) -> Path:
    """Write the model directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_gguf(default_model_path())
    config = overhead_config(tokenizer)
    model = build_model(ModelConfig.from_hf_dict(config), ParallelConfig(), torch.bfloat16, torch.device("cpu"))
    tensors = {name: tensor.contiguous() for name, tensor in dummy_weights(model, seed)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tokenizer.backend_json())
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tokenizer), indent=2) + "\n")
    return out
