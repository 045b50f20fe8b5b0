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

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma4")
GEMMA_ARCHITECTURES = ("gemma2", "gemma3", "gemma4")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional")

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
}
# config.json model_type -> our architecture, for the types whose name differs.
_ARCH_BY_MODEL_TYPE = {"gemma3_text": "gemma3", "gemma4_text": "gemma4"}
# Checkpoints of these types carry a vision (and audio) tower beside the text decoder.
_MULTIMODAL = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
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

    The fields after ``layers`` are the Gemma family's departures from Llama; their defaults are
    Llama's math, so a Llama-family config never sets them:

    * ``hidden_activation``: the MLP's gate activation, ``silu`` or ``gelu_pytorch_tanh``.
    * ``attention_scale``: scores are ``q.k * attention_scale`` (Gemma-2/3:
      ``query_pre_attn_scalar ** -0.5``; Gemma-4: 1.0); None means ``head_dim ** -0.5``.
    * ``attn_logit_softcapping`` / ``final_logit_softcapping``: ``cap * tanh(x / cap)`` on the
      attention scores / the output logits.
    * ``embed_scale``: token embeddings are multiplied by it (Gemma: ``sqrt(hidden_size)``).
    * ``norm_weight_offset``: RMSNorm computes ``x_normed * (offset + weight)`` (Gemma-2/3: 1).
    * ``sandwich_norms``: the attention and MLP outputs are normed before the residual add, and the
      MLP input has its own norm (``post_attention_layernorm`` is then on the attention output).
    * ``v_norm``: values get a weightless RMSNorm (Gemma-4).
    * ``hidden_size_per_layer_input`` / ``vocab_size_per_layer_input``: Gemma-4's per-layer
      inputs (PLE); 0 when absent.
    * ``attention_k_eq_v``: full-attention layers have no ``v_proj``; values are the raw keys.
    * ``use_double_wide_mlp``: KV-shared layers' MLPs are twice ``intermediate_size`` wide.

    Which layers read other layers' KV is per layer (``LayerSpec.kv_source``); Gemma-4's
    ``num_kv_shared_layers`` is the property of that name.
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
    hidden_activation: str = "silu"
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    embed_scale: float = 1.0
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    v_norm: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    attention_k_eq_v: bool = False
    use_double_wide_mlp: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.hidden_activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {self.hidden_activation!r}; "
                             f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "attention_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or null, got {value!r}")
        if (self.hidden_size_per_layer_input > 0) != (self.vocab_size_per_layer_input > 0):
            raise ValueError("hidden_size_per_layer_input and vocab_size_per_layer_input are set together")
        if self.hidden_size_per_layer_input < 0 or self.vocab_size_per_layer_input < 0:
            raise ValueError("hidden_size_per_layer_input and vocab_size_per_layer_input must be >= 0")
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
    def num_kv_shared_layers(self) -> int:
        """How many of the last layers all read other layers' KV (Gemma-4's trailing KV-shared run)."""
        n = 0
        while n < self.num_layers and self.layers[self.num_layers - 1 - n].kv_source is not None:
            n += 1
        return n

    def layer_intermediate_size(self, layer_id: int) -> int:
        """The MLP width of one layer (KV-shared layers are double-wide with ``use_double_wide_mlp``)."""
        double = self.use_double_wide_mlp and self.layers[layer_id].kv_source is not None
        return self.intermediate_size * (2 if double else 1)

    def layer_k_is_v(self, layer_id: int) -> bool:
        """Whether a layer's values are its raw keys (``attention_k_eq_v`` full-attention layers)."""
        return self.attention_k_eq_v and self.layers[layer_id].attention is AttentionKind.FULL

    @property
    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied; per-layer-input tables included)."""
        h, v = self.hidden_size, self.vocab_size
        norms = 4 if self.sandwich_norms else 2
        total = 0
        for n, layer in enumerate(self.layers):
            q, kv = self.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
            num_kv_proj = 0 if layer.kv_source is not None else 1 if self.layer_k_is_v(n) else 2
            total += h * (q + num_kv_proj * kv) + q * h + 3 * h * self.layer_intermediate_size(n) + norms * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        p, n = self.hidden_size_per_layer_input, self.num_layers
        if p:  # table, model projection and its norm; per layer: gate, projection, norm
            total += self.vocab_size_per_layer_input * n * p + h * n * p + p + n * (2 * h * p + h)
        return total + embed + h

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; raises ValueError naming the field that is wrong."""
        arch = _architecture_of(d)
        if arch in GEMMA_ARCHITECTURES:
            return cls(**_gemma_fields(d, arch))
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
    # A 'gemma3' config is read only when flat and text-only (no sub-configs, no vision class);
    # a 'gemma4' config is always the multimodal wrapper.
    towers = any(k in d for k in ("text_config", "vision_config", "audio_config"))
    multimodal = model_type == "gemma4" or (model_type == "gemma3" and towers)
    if multimodal or any(c in _MULTIMODAL.values() for c in classes):
        raise ValueError(
            f"multimodal checkpoints (model_type={model_type!r}, architectures={classes!r}) are not supported: "
            "only text-only Gemma checkpoints (model_type 'gemma3_text' / 'gemma4_text', *ForCausalLM)"
        )
    if model_type in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[model_type]
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


# ---- Gemma-2 / 3 / 4 (text) -------------------------------------------------------------------
_LAYER_KINDS = {"sliding_attention": AttentionKind.SLIDING_WINDOW, "full_attention": AttentionKind.FULL}


def _gemma_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig fields of a Gemma-2/3/4 text config (see ModelConfig for what each one does).

    A default transformers would fill in is taken only where it switches a feature off (no
    softcapping in Gemma-3/4, no KV sharing, no k=v, untied embeddings stated as such). A missing
    field whose default would be a number the math depends on -- ``query_pre_attn_scalar``,
    ``head_dim``, Gemma-2's softcaps, a rope base, Gemma-4's ``global_head_dim`` or
    ``hidden_size_per_layer_input`` -- is an error naming it.
    """
    if d.get("use_bidirectional_attention") not in (None, False):
        raise ValueError(f"config field 'use_bidirectional_attention' is {d['use_bidirectional_attention']!r}: "
                         "bidirectional attention is not supported (causal decoding only)")
    if arch == "gemma4" and d.get("enable_moe_block"):
        raise ValueError("config field 'enable_moe_block' is true: Gemma-4 mixture-of-experts is not supported "
                         "(dense checkpoints only)")
    num_layers = _field(d, "num_hidden_layers", int)
    hidden = _field(d, "hidden_size", int)
    kv_heads = _field(d, "num_key_value_heads", int)
    head_dim = _field(d, "head_dim", int)
    activation = _field(d, "hidden_activation", str)
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"config field 'hidden_activation': unsupported activation {activation!r}; "
                         f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    types = _gemma_layer_types(d, arch, num_layers)
    window = _field(d, "sliding_window", int) if "sliding_attention" in types else None
    ropes = _gemma_ropes(d, arch, types)
    if arch == "gemma4":
        shapes = _gemma4_layer_shapes(d, types, kv_heads, head_dim)
        sources = _gemma4_kv_sources(d, types)
    else:
        shapes = [(kv_heads, head_dim)] * num_layers
        sources = [None] * num_layers
    layers = tuple(
        LayerSpec(_LAYER_KINDS[t], heads, dim, ropes[t], window if t == "sliding_attention" else None, src)
        for t, (heads, dim), src in zip(types, shapes, sources, strict=True)
    )
    bias = _field(d, "attention_bias", bool, False)
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=_field(d, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=_field(d, "intermediate_size", int),
        num_layers=num_layers,
        num_heads=_field(d, "num_attention_heads", int),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_field(d, "rms_norm_eps", float),
        rope=layers[0].rope,
        max_position_embeddings=_field(d, "max_position_embeddings", int),
        # transformers' default (and PretrainedConfig's): a config that omits it is tied.
        tie_word_embeddings=_field(d, "tie_word_embeddings", bool, True),
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=arch != "gemma2",
        sliding_window=window,
        bos_token_id=_field(d, "bos_token_id", int, None),
        eos_token_ids=_field(d, "eos_token_id", lambda v: tuple(int(x) for x in (v if isinstance(v, list) else [v])),
                             ()),
        layers=layers,
        hidden_activation=activation,
        embed_scale=hidden**0.5,
        sandwich_norms=True,
    )
    if arch == "gemma4":
        _required_key(d, "hidden_size_per_layer_input")  # transformers' default is 256, not none
        per_layer = _field(d, "hidden_size_per_layer_input", int, 0)
        per_layer_vocab = _field(d, "vocab_size_per_layer_input", int) if per_layer else 0
        if per_layer and per_layer_vocab < fields["vocab_size"]:
            raise ValueError(f"config field 'vocab_size_per_layer_input' ({per_layer_vocab}) is smaller than "
                             f"vocab_size ({fields['vocab_size']}): token ids past it have no per-layer input")
        fields.update(
            attention_scale=1.0,
            final_logit_softcapping=_field(d, "final_logit_softcapping", float, None),
            v_norm=True,
            hidden_size_per_layer_input=per_layer,
            vocab_size_per_layer_input=per_layer_vocab,
            attention_k_eq_v=_field(d, "attention_k_eq_v", bool, False),
            use_double_wide_mlp=_field(d, "use_double_wide_mlp", bool, False),
        )
    else:
        fields.update(
            attention_scale=_field(d, "query_pre_attn_scalar", float) ** -0.5,
            norm_weight_offset=1.0,
        )
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if arch == "gemma2":
                _required_key(d, name)  # transformers' Gemma-2 default is a cap, not none
            fields[name] = _field(d, name, float, None)
        if arch == "gemma3":
            # Gemma-3 replaced score capping by q/k norms: transformers' Gemma-3 attention never
            # applies attn_logit_softcapping, whatever the config says, and neither do we.
            fields["attn_logit_softcapping"] = None
    return fields


def _required_key(d: dict[str, Any], name: str) -> Any:
    """``d[name]`` where null is a meaningful value but absence is not."""
    if name not in d:
        raise ValueError(f"config is missing required field {name!r}")
    return d[name]


def _gemma_layer_types(d: dict[str, Any], arch: str, num_layers: int) -> list[str]:
    """Each layer's ``sliding_attention`` / ``full_attention``.

    Without ``layer_types``: Gemma-2 alternates (sliding on even layers, its fixed pattern);
    Gemma-3 repeats ``sliding_window_pattern - 1`` sliding layers then a full one; Gemma-4 must
    say.
    """
    types = d.get("layer_types")
    if types is None:
        if arch == "gemma2":
            return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        if arch == "gemma4":
            raise ValueError("config is missing required field 'layer_types'")
        pattern = d.get("sliding_window_pattern")
        if pattern is None:
            raise ValueError("config has neither 'layer_types' nor 'sliding_window_pattern': "
                             "which layers are sliding-window is unknown")
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"config field 'sliding_window_pattern' must be a positive integer, got {pattern!r}")
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"config field 'layer_types' must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted({t for t in types if t not in _LAYER_KINDS}, key=str)
    if unknown:
        raise ValueError(f"config field 'layer_types': unsupported layer types {unknown}; "
                         f"supported: {', '.join(_LAYER_KINDS)}")
    if arch == "gemma4" and types[-1] != "full_attention":
        # transformers silently turns such a last layer into a full one; we refuse to guess.
        raise ValueError("config field 'layer_types': Gemma-4's last layer must be 'full_attention', "
                         f"got {types[-1]!r}")
    return list(types)


def _gemma_ropes(d: dict[str, Any], arch: str, types: list[str]) -> dict[str, RopeSpec]:
    """The rope of each layer type.

    Gemma-2 has one rope (either form). Gemma-3/4 in transformers 5's form give
    ``rope_parameters`` per layer type; Gemma-3's older form has ``rope_theta`` (+ ``rope_scaling``)
    for full layers and ``rope_local_base_freq`` for sliding ones.
    """
    if arch == "gemma2":
        rope = read_rope(d)
        return {t: rope for t in types}
    params = d.get("rope_parameters")
    if params is None and arch == "gemma3":
        ropes = {}
        if "full_attention" in types:
            ropes["full_attention"] = read_rope(d)
        if "sliding_attention" in types:
            base = _field(d, "rope_local_base_freq", float)
            ropes["sliding_attention"] = rope_from_dict({"rope_theta": base}, "rope_local_base_freq")
        return ropes
    if params is None:
        raise ValueError("config has no 'rope_parameters': the rope of each layer type is unknown")
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise ValueError("config field 'rope_parameters' must give one rope per layer type "
                         f"({', '.join(sorted(set(types)))}), got {params!r}")
    return {t: read_rope(d, t) for t in set(types)}


def _gemma4_layer_shapes(d: dict[str, Any], types: list[str], kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(KV heads, head dim) of each Gemma-4 layer.

    transformers 5.23 saves the per-layer overrides it derived as ``per_layer_config`` (zero-padded
    layer index -> ``head_dim`` / ``num_key_value_heads``); hub configs instead give
    ``global_head_dim`` for full layers and, only when ``attention_k_eq_v``,
    ``num_global_key_value_heads``. ``per_layer_config`` wins when both are present, as there.
    """
    shapes = [(kv_heads, head_dim)] * len(types)
    overrides = d.get("per_layer_config")
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise ValueError(f"config field 'per_layer_config' must be an object, got {overrides!r}")
        for key, layer in overrides.items():
            where = f"per_layer_config.{key}"
            try:
                index = int(key)
            except ValueError:
                raise ValueError(f"config field {where!r}: not a layer index") from None
            if not 0 <= index < len(types):
                raise ValueError(f"config field {where!r}: layer {index} is out of range")
            if not isinstance(layer, dict):
                raise ValueError(f"config field {where!r} must be an object, got {layer!r}")
            unknown = sorted(set(layer) - {"head_dim", "num_key_value_heads"})
            if unknown:
                raise ValueError(f"config field {where!r}: per-layer {', '.join(unknown)} not supported")
            try:
                heads = _field(layer, "num_key_value_heads", int, shapes[index][0])
                dim = _field(layer, "head_dim", int, shapes[index][1])
            except ValueError as e:
                raise ValueError(f"config field {where!r}: {e}") from None
            shapes[index] = (heads, dim)
        return shapes
    if "full_attention" not in types:
        return shapes
    global_dim = _field(d, "global_head_dim", int)
    global_heads = _field(d, "num_global_key_value_heads", int, None) if d.get("attention_k_eq_v") else None
    full = (global_heads or kv_heads, global_dim)
    return [full if t == "full_attention" else s for t, s in zip(types, shapes, strict=True)]


def _gemma4_kv_sources(d: dict[str, Any], types: list[str]) -> list[int | None]:
    """The layer whose KV each layer reads: the last ``num_kv_shared_layers`` layers read the last
    earlier (non-shared) layer of their own type; the others their own (None)."""
    n = len(types)
    shared = _field(d, "num_kv_shared_layers", int, 0)
    if not 0 <= shared < n:
        raise ValueError(f"config field 'num_kv_shared_layers' must be in [0, {n}), got {shared}")
    first = n - shared
    sources: list[int | None] = [None] * n
    for i in range(first, n):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise ValueError(f"config field 'num_kv_shared_layers': layer {i} ({types[i]}) is KV-shared but no "
                             f"earlier layer of that type computes KV")
        sources[i] = owners[-1]
    return sources


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

# Gemma presets go through the config reader, from config.json-shaped dicts. Real shapes:
# google/gemma-2-2b, google/gemma-3-1b-pt, and the text decoder of google/gemma-4-E2B (35 layers,
# 4 sliding : 1 full, the last 20 layers KV-shared with double-wide MLPs, 256-wide per-layer
# inputs). The tiny ones (hidden 64; vocab 49152 so the bundled SmolLM2 tokenizer's ids fit)
# keep every feature of their family at test speed.
_GEMMA_COMMON = dict(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1,
                     tie_word_embeddings=True, attention_bias=False)
_GEMMA4_ROPES = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}
_GEMMA_PRESETS: dict[str, dict[str, Any]] = {
    "gemma2-2b": dict(
        model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=8192,
    ),
    "gemma3-1b": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, max_position_embeddings=32768,
        attn_logit_softcapping=None, final_logit_softcapping=None,
    ),
    "gemma4-e2b": dict(
        model_type="gemma4_text", vocab_size=262144, hidden_size=1536, intermediate_size=6144,
        num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, sliding_window=512,
        num_kv_shared_layers=20, use_double_wide_mlp=True, attention_k_eq_v=False,
        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, final_logit_softcapping=30.0,
        rope_parameters=_GEMMA4_ROPES, max_position_embeddings=131072,
    ),
    "gemma2-tiny": dict(
        model_type="gemma2", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=2048,
    ),
    "gemma3-tiny": dict(
        model_type="gemma3_text", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        max_position_embeddings=2048,
    ),
    "gemma4-tiny": dict(
        model_type="gemma4_text", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, sliding_window=16,
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=49152, final_logit_softcapping=30.0, rope_parameters=_GEMMA4_ROPES,
        max_position_embeddings=2048,
    ),
}
PRESETS.update({name: ModelConfig.from_hf_dict({**_GEMMA_COMMON, **d}) for name, d in _GEMMA_PRESETS.items()})


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown dummy preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None

