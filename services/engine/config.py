"""Model configuration: the architecture facts the engine needs, read from a HF config.json dict.

Only the fields that shape computation are kept, in one frozen value. Unknown architectures and
inconsistent shapes are rejected here, before any tensor is allocated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (``rope_type`` default, linear or llama3)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama family)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 always)
    o_proj_bias: bool = False  # bias on the attention output projection (Llama/Mistral attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or null, got {self.sliding_window}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; raises ValueError naming the field that is wrong."""
        arch = _architecture_of(d)
        hidden = _field(d, "hidden_size", int)
        heads = _field(d, "num_attention_heads", int)
        eos_ids = _field(d, "eos_token_id", lambda v: tuple(int(x) for x in (v if isinstance(v, list) else [v])), ())
        sliding = _field(d, "sliding_window", int, None)
        if arch == "qwen2" and not d.get("use_sliding_window", False):
            sliding = None  # Qwen2 configs carry a window they do not use unless asked
        bias = _field(d, "attention_bias", bool, False)
        return cls(
            architecture=arch,
            vocab_size=_field(d, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_field(d, "intermediate_size", int),
            num_layers=_field(d, "num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=_field(d, "num_key_value_heads", int, None) or heads,
            head_dim=_field(d, "head_dim", int, None) or hidden // heads,
            rms_norm_eps=_field(d, "rms_norm_eps", float, 1e-6),
            rope_theta=_field(d, "rope_theta", float, 10000.0),
            max_position_embeddings=_field(d, "max_position_embeddings", int, 2048),
            tie_word_embeddings=_field(d, "tie_word_embeddings", bool, False),
            attention_bias=arch == "qwen2" or bias,
            o_proj_bias=arch != "qwen2" and bias,
            mlp_bias=_field(d, "mlp_bias", bool, False),
            qk_norm=arch == "qwen3",
            sliding_window=sliding or None,
            rope_scaling=_rope_scaling(d.get("rope_scaling")),
            bos_token_id=_field(d, "bos_token_id", int, None),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: config.json is not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path}: config.json must hold a JSON object, got {type(d).__name__}")
        return cls.from_hf_dict(d)


_REQUIRED = object()


def _field(d: dict[str, Any], name: str, convert: Any, default: Any = _REQUIRED) -> Any:
    """``convert(d[name])``, or ``default`` when absent or null; errors name the field."""
    value = d.get(name)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"config is missing required field {name!r}")
        return default
    if isinstance(value, (dict, str)) and convert in (int, float):
        raise ValueError(f"config field {name!r} must be a number, got {value!r}")
    try:
        return convert(value)
    except (TypeError, ValueError):
        raise ValueError(f"config field {name!r} has the wrong type: {value!r}") from None


def _architecture_of(d: dict[str, Any]) -> str:
    model_type = d.get("model_type")
    classes = d.get("architectures") or []
    if model_type in SUPPORTED_ARCHITECTURES:
        return model_type
    for c in classes:
        if c in _ARCH_BY_CLASS:
            return _ARCH_BY_CLASS[c]
    raise ValueError(
        f"unsupported architecture (model_type={model_type!r}, architectures={classes!r}); "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope_scaling(d: dict[str, Any] | None) -> RopeScaling | None:
    if not d:
        return None
    rope_type = d.get("rope_type") or d.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return None
    return RopeScaling(
        rope_type=rope_type,
        factor=float(d.get("factor", 1.0)),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
    )


# Real shapes for `dummy:<preset>` models (seeded random weights), for benchmarks and tests.
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True, eos_token_ids=(151645,),
    ),
    "llama-3.1-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    # A tiny shape for fast tests of the dummy path.
    "tiny": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=2048, tie_word_embeddings=True, eos_token_ids=(2,),
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown dummy preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None

