"""A tiny HF-style model directory for router tests: a tokenizer and a chat template, no weights.

The tokenizer is byte-level BPE without merges (one token per byte), so any text tokenizes
without a real vocabulary and multi-byte characters span several tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def write_tiny_model_dir(directory: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = BackendTokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    backend.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "add_bos_token": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
