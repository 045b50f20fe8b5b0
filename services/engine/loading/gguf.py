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

from services.text.tokenizer import GGUFMetadata, Tokenizer, open_gguf_reader


@dataclass(frozen=True)
class _Architecture:
    model_type: str
    hf_class: str
    # llama.cpp's converter reorders q/k rows of this architecture to suit GGML's rope.
    qk_rows_permuted: bool
    qkv_bias: bool
    qk_norm: bool
    # Gemma: the model computes x * (1 + w); llama.cpp's converter stores w + 1 in every *norm.weight.
    gemma: bool = False


_ARCHITECTURES = {
    "llama": _Architecture("llama", "LlamaForCausalLM", qk_rows_permuted=True, qkv_bias=False, qk_norm=False),
    "qwen2": _Architecture("qwen2", "Qwen2ForCausalLM", qk_rows_permuted=False, qkv_bias=True, qk_norm=False),
    "qwen3": _Architecture("qwen3", "Qwen3ForCausalLM", qk_rows_permuted=False, qkv_bias=False, qk_norm=True),
    "gemma2": _Architecture("gemma2", "Gemma2ForCausalLM", qk_rows_permuted=False, qkv_bias=False, qk_norm=False,
                            gemma=True),
    "gemma3": _Architecture("gemma3_text", "Gemma3ForCausalLM", qk_rows_permuted=False, qkv_bias=False,
                            qk_norm=True, gemma=True),
}
_SPEC_BY_MODEL_TYPE = {spec.model_type: spec for spec in _ARCHITECTURES.values()}

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
# Gemma's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP, which HF calls
# pre_feedforward_layernorm there (and post_attention_layernorm in Llama/Qwen).
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_REQUIRED_LAYER_WEIGHTS = (
    "attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
)
_GEMMA_REQUIRED_LAYER_WEIGHTS = (*_REQUIRED_LAYER_WEIGHTS, "post_attention_norm", "post_ffw_norm")
# llama.cpp sizes the query scale of the 27B Gemmas (told apart by their layer count) by
# hidden_size / num_heads, of the others by head_dim: query_pre_attn_scalar is not in the file.
_GEMMA_27B_LAYER_COUNT = {"gemma2": 46, "gemma3": 62}
# llama.cpp's fixed Gemma-3 layout: 5 sliding-window layers then a full one; their rope base 10000.
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_SLIDING_ROPE_BASE = 10000.0
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
        spec = _SPEC_BY_MODEL_TYPE[self.config["model_type"]]
        permuted = spec.qk_rows_permuted
        for tensor in self.reader.tensors:
            hf_name = _hf_tensor_name(tensor.name, spec)
            values = _dequantize(tensor, self.path)
            if spec.gemma and tensor.name.endswith("norm.weight"):
                values -= np.float32(1.0)  # llama.cpp stored 1 + w; HF's Gemma keeps w
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
    if spec.gemma:
        config = _gemma_config(config, meta, architecture, shapes, path)
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


def _gemma_config(
    config: dict, meta: GGUFMetadata, architecture: str, shapes: dict[str, list[int]], path: Path
) -> dict:
    """Complete a Gemma-2/3 config with the fields HF's Gemma2Config / Gemma3TextConfig add.

    Read from the file where llama.cpp stores them (window, softcaps, optional query scale and
    window pattern); otherwise what llama.cpp itself fixes for the architecture: the GELU (tanh)
    activation, Gemma-2's alternating layers, Gemma-3's 5:1 pattern and 10000 sliding rope base,
    and the query scale rule below. A stored value llama.cpp requires but the file lacks is an error.
    """
    if architecture == "gemma2" and "output.weight" in shapes:
        # llama.cpp's gemma2 has no output tensor (it always reuses the embedding); transformers
        # would drop it too. Rather than pick one reading, refuse the file.
        raise ValueError(f"{path}: a gemma2 file has no output.weight in llama.cpp's format (the embedding "
                         "is the output matrix)")
    num_layers = config["num_hidden_layers"]
    num_heads = config["num_attention_heads"]
    q_rows = shapes.get("blk.0.attn_q.weight", [0, 0])[1]
    head_dim = meta.get(f"{architecture}.attention.key_length")
    if head_dim is None:
        head_dim = q_rows // num_heads
    if q_rows and q_rows != num_heads * head_dim:
        raise ValueError(f"{path}: attn_q has {q_rows} rows, not {num_heads} heads x head_dim {head_dim}")
    config["head_dim"] = head_dim

    window = meta.get(f"{architecture}.attention.sliding_window")
    if window is None:
        raise ValueError(f"{path}: no {architecture}.attention.sliding_window: the attention window is unknown")

    scale = meta.get(f"{architecture}.attention.scale")
    if scale is not None:
        if not scale > 0:
            raise ValueError(f"{path}: {architecture}.attention.scale must be positive, got {scale!r}")
        query_pre_attn_scalar = _float32_as_decimal(float(np.float32(scale)) ** -2)
        if abs(query_pre_attn_scalar - round(query_pre_attn_scalar)) < 1e-3 * query_pre_attn_scalar:
            query_pre_attn_scalar = round(query_pre_attn_scalar)
    elif num_layers == _GEMMA_27B_LAYER_COUNT[architecture]:
        query_pre_attn_scalar = config["hidden_size"] // num_heads
    else:
        query_pre_attn_scalar = head_dim

    rope = config["rope_parameters"]
    if architecture == "gemma2":
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        caps = {}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = meta.get(f"{architecture}.{key}")
            if value is None:
                raise ValueError(f"{path}: no {architecture}.{key}: Gemma-2's softcap is unknown")
            caps[key] = _float32_as_decimal(value)
    else:
        layer_types = _gemma3_layer_types(meta.get(f"{architecture}.attention.sliding_window_pattern"),
                                          num_layers, architecture, path)
        # Gemma-3 has no softcapping; rope scaling applies to the full layers only (as in llama.cpp).
        caps = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
        rope = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_SLIDING_ROPE_BASE},
        }
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=query_pre_attn_scalar,
        sliding_window=window,
        layer_types=layer_types,
        rope_parameters=rope,
        attention_bias=False,
        **caps,
    )
    return config


def _gemma3_layer_types(pattern: object, num_layers: int, architecture: str, path: Path) -> list[str]:
    key = f"{architecture}.attention.sliding_window_pattern"
    if pattern is None:
        pattern = _GEMMA3_SLIDING_WINDOW_PATTERN
    if isinstance(pattern, list):  # one flag per layer, true = sliding window
        if len(pattern) != num_layers or not all(isinstance(flag, bool) for flag in pattern):
            raise ValueError(f"{path}: {key} must hold {num_layers} booleans, got {pattern!r}")
        return ["sliding_attention" if flag else "full_attention" for flag in pattern]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"{path}: {key} must be a positive integer, got {pattern!r}")
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


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


def _hf_tensor_name(gguf_name: str, spec: _Architecture) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = _GEMMA_LAYER_TENSORS if spec.gemma else _LAYER_TENSORS
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_tensors:
        raise ValueError(f"tensor {gguf_name!r} has no Hugging Face counterpart")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{layer_tensors[kind]}.{suffix}"


def _check_tensor_names(shapes: dict[str, list[int]], config: dict, spec: _Architecture, path: Path) -> None:
    """Every tensor must map to an HF name, and every layer must have all its weights."""
    unknown = []
    for name in shapes:
        try:
            _hf_tensor_name(name, spec)
        except ValueError:
            unknown.append(name)
    if unknown:
        raise ValueError(f"{path}: tensors with no Hugging Face counterpart: {unknown[:5]}")
    required = [*(_GEMMA_REQUIRED_LAYER_WEIGHTS if spec.gemma else _REQUIRED_LAYER_WEIGHTS)]
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
