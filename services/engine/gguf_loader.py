"""Read a GGUF checkpoint as a Hugging Face style config plus float32 tensors with HF names.

The rest of the engine knows one weight layout, Hugging Face's; this module is the only place that
knows GGUF's names, its quantized blocks and llama.cpp's reordering of the q/k projection rows.
The file is memory-mapped and each tensor is dequantized only when ``tensors()`` reaches it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from services.engine.tokenizer import GGUFMetadata, Tokenizer, open_gguf_reader


@dataclass(frozen=True)
class _Architecture:
    model_type: str
    hf_class: str
    # llama.cpp's converter reorders q/k rows of this architecture to suit GGML's rope.
    qk_rows_permuted: bool
    qkv_bias: bool
    qk_norm: bool


_ARCHITECTURES = {
    "llama": _Architecture("llama", "LlamaForCausalLM", qk_rows_permuted=True, qkv_bias=False, qk_norm=False),
    "qwen2": _Architecture("qwen2", "Qwen2ForCausalLM", qk_rows_permuted=False, qkv_bias=True, qk_norm=False),
    "qwen3": _Architecture("qwen3", "Qwen3ForCausalLM", qk_rows_permuted=False, qkv_bias=False, qk_norm=True),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_REQUIRED_LAYER_WEIGHTS = (
    "attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
)
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A parsed GGUF file: its config in HF ``config.json`` form and lazy access to its tensors."""

    path: Path
    config: dict
    reader: gguf.GGUFReader = field(repr=False, compare=False)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, float32 tensor shaped [out_features, in_features]) in file order."""
        num_heads = self.config["num_attention_heads"]
        num_kv_heads = self.config["num_key_value_heads"]
        permuted = _ARCHITECTURES[self.config["model_type"]].qk_rows_permuted
        for tensor in self.reader.tensors:
            hf_name = _hf_tensor_name(tensor.name)
            values = _dequantize(tensor, self.path)
            if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                values = _unpermute_rope_rows(values, num_heads)
            elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                values = _unpermute_rope_rows(values, num_kv_heads)
            yield hf_name, torch.from_numpy(values)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer stored in the same file."""
        return Tokenizer.from_gguf(self.reader)


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a GGUF model file and check it is complete and of a supported architecture.

    Raises FileNotFoundError if there is no such file and ValueError, naming the file, if it is not
    a GGUF file, is truncated, or describes a model this engine cannot run.
    """
    path = Path(path)
    reader = open_gguf_reader(path)
    _check_tensor_data_in_file(reader, path)
    meta = GGUFMetadata(reader)
    architecture = meta.require("general.architecture")
    spec = _ARCHITECTURES.get(architecture)
    if spec is None:
        raise ValueError(
            f"{path}: architecture {architecture!r} is not supported (supported: {sorted(_ARCHITECTURES)})"
        )
    shapes = {tensor.name: [int(n) for n in tensor.shape] for tensor in reader.tensors}
    config = _hf_config(meta, architecture, spec, shapes, path)
    _check_tensor_names(shapes, config, spec, path)
    return GGUFCheckpoint(path=path, config=config, reader=reader)


# --------------------------------------------------------------------------------------------------
# Config


def _hf_config(
    meta: GGUFMetadata, architecture: str, spec: _Architecture, shapes: dict[str, list[int]], path: Path
) -> dict:
    """The GGUF ``<arch>.*`` keys translated to Hugging Face config.json fields."""

    def require_int(key: str) -> int:
        value = meta.require(f"{architecture}.{key}")
        if not isinstance(value, int):
            raise ValueError(f"{path}: {architecture}.{key} should be one integer, got {value!r}")
        return value

    def optional(key: str) -> object:
        return meta.get(f"{architecture}.{key}")

    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    hidden_size = require_int("embedding_length")
    num_heads = require_int("attention.head_count")
    num_kv_heads = optional("attention.head_count_kv") or num_heads
    if "rope_freqs.weight" in shapes:
        raise ValueError(f"{path}: Llama 3 style rope factors (rope_freqs.weight) are not supported")
    config = {
        "model_type": spec.model_type,
        "architectures": [spec.hf_class],
        "hidden_size": hidden_size,
        "intermediate_size": require_int("feed_forward_length"),
        "num_hidden_layers": require_int("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": optional("attention.key_length") or hidden_size // num_heads,
        "rms_norm_eps": _float32_as_decimal(meta.require(f"{architecture}.attention.layer_norm_rms_epsilon")),
        # transformers 5's form: the base inside the rope dict (llama.cpp's default base is 10000).
        "rope_parameters": {
            "rope_theta": _float32_as_decimal(optional("rope.freq_base") or 10000.0),
            **(_rope_scaling(meta, architecture, path) or {"rope_type": "default"}),
        },
        "max_position_embeddings": require_int("context_length"),
        # The embedding's row count, not the tokenizer's: some models pad it past the vocabulary.
        "vocab_size": shapes["token_embd.weight"][1],
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_bias": spec.qkv_bias or "blk.0.attn_q.bias" in shapes,
        "torch_dtype": "float32",
    }
    if not isinstance(num_kv_heads, int) or num_heads % num_kv_heads:
        raise ValueError(f"{path}: {num_heads} attention heads cannot share {num_kv_heads!r} KV heads")
    return config


def _float32_as_decimal(value: float) -> float:
    """GGUF stores floats as float32; 1e-5 reads back as 9.9999997e-06. Recover the written decimal."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: GGUFMetadata, architecture: str, path: Path) -> dict | None:
    scaling_type = meta.get(f"{architecture}.rope.scaling.type")
    factor = meta.get(f"{architecture}.rope.scaling.factor")
    if scaling_type is None and meta.get(f"{architecture}.rope.scale_linear") is not None:
        scaling_type, factor = "linear", meta.get(f"{architecture}.rope.scale_linear")
    if scaling_type in (None, "none"):
        return None
    if scaling_type not in ("linear", "yarn"):
        raise ValueError(f"{path}: rope scaling type {scaling_type!r} is not supported")
    if factor is None:
        raise ValueError(f"{path}: rope scaling {scaling_type!r} has no {architecture}.rope.scaling.factor")
    scaling = {"rope_type": scaling_type, "factor": _float32_as_decimal(factor)}
    original_length = meta.get(f"{architecture}.rope.scaling.original_context_length")
    if original_length is not None:
        scaling["original_max_position_embeddings"] = original_length
    return scaling


# --------------------------------------------------------------------------------------------------
# Tensors


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"tensor {gguf_name!r} has no Hugging Face counterpart")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"


def _check_tensor_names(shapes: dict[str, list[int]], config: dict, spec: _Architecture, path: Path) -> None:
    """Every tensor must map to an HF name, and every layer must have all its weights."""
    unknown = []
    for name in shapes:
        try:
            _hf_tensor_name(name)
        except ValueError:
            unknown.append(name)
    if unknown:
        raise ValueError(f"{path}: tensors with no Hugging Face counterpart: {unknown[:5]}")
    required = [*_REQUIRED_LAYER_WEIGHTS]
    if spec.qk_norm:
        required += ["attn_q_norm", "attn_k_norm"]
    missing = [name for name in ("token_embd.weight", "output_norm.weight") if name not in shapes]
    for layer in range(config["num_hidden_layers"]):
        expected = [f"blk.{layer}.{kind}.weight" for kind in required]
        if spec.qkv_bias:
            expected += [f"blk.{layer}.{kind}.bias" for kind in ("attn_q", "attn_k", "attn_v")]
        missing += [name for name in expected if name not in shapes]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]} ({len(missing)} in all)")
    extra_layers = {int(m.group(1)) for m in map(_LAYER_TENSOR_NAME.fullmatch, shapes) if m}
    extra_layers -= set(range(config["num_hidden_layers"]))
    if extra_layers:
        raise ValueError(f"{path}: tensors for layers {sorted(extra_layers)} beyond block_count")


def _check_tensor_data_in_file(reader: gguf.GGUFReader, path: Path) -> None:
    file_size_bytes = path.stat().st_size
    for tensor in reader.tensors:
        end_bytes = int(tensor.data_offset) + int(tensor.n_bytes)
        if end_bytes > file_size_bytes or tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(
                f"{path}: truncated: tensor {tensor.name!r} ends at byte {end_bytes}, "
                f"the file has {file_size_bytes}"
            )


def _dequantize(tensor: gguf.ReaderTensor, path: Path) -> np.ndarray:
    """The tensor as a writable float32 array in numpy (row-major, HF) orientation."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"{path}: tensor {tensor.name!r}: {exc}") from exc
    expected_shape = tuple(int(n) for n in reversed(tensor.shape))
    if values.shape != expected_shape:
        values = values.reshape(expected_shape)
    if values.dtype != np.float32 or not values.flags.writeable or not values.flags.c_contiguous:
        # F32 tensors come back as read-only views of the memory map; torch wants memory it may write.
        values = np.array(values, dtype=np.float32, order="C")
    return values


def _unpermute_rope_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order, restoring Hugging Face's.

    Per head, HF orders the rows [first halves of the rotary pairs..., second halves...]; llama.cpp
    interleaves them (pair i's two rows adjacent), because GGML's default rope rotates adjacent
    elements::

        HF   rows of a head: x0 x1 ... x(d/2-1) | y0 y1 ... y(d/2-1)
        GGUF rows of a head: x0 y0 x1 y1 ... x(d/2-1) y(d/2-1)
    """
    rows = values.shape[0]
    half_head_dim = rows // num_heads // 2
    if num_heads * 2 * half_head_dim != rows:
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of rotary pairs")
    per_head = values.reshape(num_heads, half_head_dim, 2, *values.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(values.shape)
