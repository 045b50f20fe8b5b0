"""Model configuration: the architecture facts the engine needs, read from a HF config.json dict.

Only the fields that shape computation are kept, in one frozen value. Unknown architectures and
inconsistent shapes are rejected here, before any tensor is allocated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.kv.groups import AttentionKind

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional")

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# Keys a rope dict may carry, per rope type; anything else shapes the math in a way we do not
# implement, so it is an error rather than something to ignore.
_ROPE_KEYS = {
    "default": {"rope_theta"},
    "linear": {"rope_theta", "factor"},
    "llama3": {"rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "proportional": {"rope_theta", "factor", "partial_rotary_factor"},
}
_ROPE_REQUIRED = {
    "default": {"rope_theta"},
    "linear": {"rope_theta", "factor"},
    "llama3": _ROPE_KEYS["llama3"],
    "proportional": {"rope_theta"},
}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer: base, type and the type's parameters.

    ``proportional`` (Gemma-4 full layers) rotates only the first ``partial_rotary_factor`` of each
    half of the head and leaves the rest unrotated (zero frequency), with frequencies spaced over
    the whole head dim.
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if not self.theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer's attention looks like: the facts KV-cache groups are built from.

    ``kv_source`` is the earlier layer whose K/V this layer reads (Gemma-4's KV-shared layers);
    such a layer computes no K/V and owns no KV cache.
    """

    attention: AttentionKind
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec
    sliding_window: int | None = None
    kv_source: int | None = None

    def __post_init__(self) -> None:
        if (self.attention is AttentionKind.SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ValueError("a layer has a sliding_window exactly when its attention is sliding-window")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    Model-wide ``num_kv_heads``/``head_dim``/``rope``/``sliding_window`` describe the common layer;
    ``layers`` is the per-layer truth (filled from them when a config gives nothing per layer).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 always)
    o_proj_bias: bool = False  # bias on the attention output projection (Llama/Mistral attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layers: tuple[LayerSpec, ...] = ()

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
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or null, got {self.sliding_window}")
        if not self.layers:
            kind = AttentionKind.FULL if self.sliding_window is None else AttentionKind.SLIDING_WINDOW
            uniform = LayerSpec(kind, self.num_kv_heads, self.head_dim, self.rope, self.sliding_window)
            object.__setattr__(self, "layers", (uniform,) * self.num_layers)
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {self.num_layers} layers")
        for i, layer in enumerate(self.layers):
            if self.num_heads % layer.num_kv_heads:
                raise ValueError(
                    f"num_attention_heads ({self.num_heads}) must be a multiple of "
                    f"num_key_value_heads ({layer.num_kv_heads}) (layer {i})"
                )
            if layer.head_dim % 2:
                raise ValueError(f"head_dim must be even for RoPE, got {layer.head_dim} (layer {i})")
            if layer.kv_source is not None:
                src = layer.kv_source
                if not 0 <= src < i or self.layers[src].kv_source is not None:
                    raise ValueError(f"layer {i} reads KV of layer {src}, which is not an earlier KV-owning layer")
                source = self.layers[src]
                if (source.attention, source.sliding_window, source.num_kv_heads, source.head_dim) != (
                        layer.attention, layer.sliding_window, layer.num_kv_heads, layer.head_dim):
                    raise ValueError(f"layer {i} reads KV of layer {src}, whose attention differs")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_sharing(self) -> dict[int, int]:
        """``{layer: source layer}`` for every layer that reads another layer's KV."""
        return {i: layer.kv_source for i, layer in enumerate(self.layers) if layer.kv_source is not None}

    @property
    def kv_layer_ids(self) -> tuple[int, ...]:
        """The layers that compute and own KV."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.kv_source is None)

    @property
    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        total = 0
        for layer in self.layers:
            q, kv = self.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
            total += h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return total + embed + h

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; raises ValueError naming the field that is wrong."""
        arch = _architecture_of(d)
        hidden = _field(d, "hidden_size", int)
        heads = _field(d, "num_attention_heads", int)
        eos_ids = _field(d, "eos_token_id", lambda v: tuple(int(x) for x in (v if isinstance(v, list) else [v])), ())
        sliding = _field(d, "sliding_window", int, None)
        if arch in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            sliding = None  # Qwen2/3 configs carry a window they do not use unless asked
        if arch == "qwen2" and sliding is not None and d.get("max_window_layers") not in (None, 0):
            raise ValueError("config field 'max_window_layers' (windowed attention only in upper layers) "
                             "is not supported; set use_sliding_window to false")
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
            rms_norm_eps=_field(d, "rms_norm_eps", float),
            rope=read_rope(d),
            max_position_embeddings=_field(d, "max_position_embeddings", int),
            tie_word_embeddings=_field(d, "tie_word_embeddings", bool, False),
            attention_bias=arch == "qwen2" or bias,
            o_proj_bias=arch != "qwen2" and bias,
            mlp_bias=_field(d, "mlp_bias", bool, False),
            qk_norm=arch == "qwen3",
            sliding_window=sliding or None,
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


def rope_from_dict(params: Any, where: str) -> RopeSpec:
    """One rope dict in transformers 5's form (``rope_theta`` inside). Errors name ``where``."""
    if not isinstance(params, dict):
        raise ValueError(f"config field {where!r} must be an object, got {params!r}")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"config field {where!r}: unsupported rope type {rope_type!r}; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    keys = {k for k, v in params.items() if v is not None} - {"rope_type", "type"}
    unknown = sorted(keys - _ROPE_KEYS[rope_type])
    if unknown:
        raise ValueError(f"config field {where!r}: {', '.join(unknown)} not supported for rope type {rope_type!r}")
    missing = sorted(_ROPE_REQUIRED[rope_type] - keys)
    if missing:
        raise ValueError(f"config field {where!r}: rope type {rope_type!r} needs {', '.join(missing)}")

    def number(key: str, default: float) -> float:
        value = params.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config field {where}.{key} must be a number, got {value!r}")
        return float(value)

    original = params.get("original_max_position_embeddings")
    return RopeSpec(
        theta=number("rope_theta", 0.0),
        rope_type=rope_type,
        factor=number("factor", 1.0),
        low_freq_factor=number("low_freq_factor", 1.0),
        high_freq_factor=number("high_freq_factor", 4.0),
        original_max_position_embeddings=None if original is None else int(original),
        partial_rotary_factor=number("partial_rotary_factor", 1.0),
    )


def read_rope(d: dict[str, Any], layer_type: str | None = None) -> RopeSpec:
    """The rope of a config in either form, never a default base.

    transformers 5 writes ``rope_parameters`` (``rope_theta`` inside; for hybrids one dict per
    layer type, picked by ``layer_type``); transformers 4 wrote ``rope_theta`` beside an optional
    ``rope_scaling`` dict. A config with neither names what is missing.
    """
    params = d.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"config field 'rope_parameters' must be an object, got {params!r}")
        per_type = params and all(isinstance(v, dict) for v in params.values())
        if per_type:
            if layer_type is None:
                raise ValueError(f"config field 'rope_parameters' is given per layer type ({', '.join(params)}) "
                                 "but this architecture has one kind of layer")
            if layer_type not in params:
                raise ValueError(f"config field 'rope_parameters' has no entry for layer type {layer_type!r}")
            return rope_from_dict(params[layer_type], f"rope_parameters.{layer_type}")
        return rope_from_dict(params, "rope_parameters")
    if d.get("rope_theta") is None:
        raise ValueError("config has neither 'rope_parameters' nor 'rope_theta': the rope base is unknown")
    scaling = d.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ValueError(f"config field 'rope_scaling' must be an object, got {scaling!r}")
    return rope_from_dict({**scaling, "rope_theta": d["rope_theta"]}, "rope_scaling")


# Real shapes for `dummy:<preset>` models (seeded random weights), for benchmarks and tests.
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope=RopeSpec(100000.0),
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope=RopeSpec(1000000.0),
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True, eos_token_ids=(151645,),
    ),
    "llama-3.1-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope=RopeSpec(500000.0, "llama3", 8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    # A tiny shape for fast tests of the dummy path.
    "tiny": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope=RopeSpec(10000.0),
        max_position_embeddings=2048, tie_word_embeddings=True, eos_token_ids=(2,),
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown dummy preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None

