"""Model configuration: the architecture facts the engine needs, read from a HF config.json dict.

Only the fields that shape computation are kept, in one frozen value. Unknown architectures and
inconsistent shapes are rejected here, before any tensor is allocated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.engine.model_config.deepseek import MLASpec, MoESpec, deepseek_fields
from services.engine.model_config.gemma import gemma_fields
from services.engine.model_config.gpt_oss import GptOssSpec, gpt_oss_fields
from services.engine.model_config.granite import GraniteSpec, granite_hybrid_fields
from services.engine.model_config.layers import (
    SUPPORTED_ACTIVATIONS,
    SUPPORTED_ROPE_TYPES,
    YARN_ARCHITECTURES,
    LayerSpec,
    RopeSpec,
    config_field,
    decoder_fields,
    read_rope,
    require_positive_ints,
    rope_from_dict,
)
from services.engine.model_config.qwen3_moe import Qwen3MoESpec, qwen3_moe_fields
from services.kv.spec.groups import AttentionKind

__all__ = ["SUPPORTED_ROPE_TYPES", "LayerSpec", "ModelConfig", "RopeSpec", "preset", "read_rope", "rope_from_dict"]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "gemma4",
                           "deepseek_v3", "granitemoehybrid", "gpt_oss")
GEMMA_ARCHITECTURES = ("gemma2", "gemma3", "gemma4")

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "GptOssForCausalLM": "gpt_oss",
}
# config.json model_type -> our architecture, for the types whose name differs.
_ARCH_BY_MODEL_TYPE = {"gemma3_text": "gemma3", "gemma4_text": "gemma4"}
# Checkpoints of these types carry a vision (and audio) tower beside the text decoder.
_MULTIMODAL = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
}


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

    DeepSeek-V3 sets ``mla`` (latent attention shapes: every layer is ``AttentionKind.MLA``, one
    KV "head" of the cached row's width) and ``moe`` (its experts; ``intermediate_size`` is then
    the dense layers' MLP width); both are None for every other architecture.

    Granite-4.0-H sets ``granite`` (``model_config/granite.py``): its Mamba2 layers (``state_layer_ids``)
    own no KV but a fixed-size state per request; the other layers are full attention.

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
    mla: MLASpec | None = None
    moe: MoESpec | None = None
    granite: GraniteSpec | None = None
    qwen3_moe: Qwen3MoESpec | None = None
    gpt_oss: GptOssSpec | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if (self.qwen3_moe is not None) != (self.architecture == "qwen3_moe"):
            raise ValueError("a Qwen3-MoE spec goes with the qwen3_moe architecture, and only with it")
        if (self.gpt_oss is not None) != (self.architecture == "gpt_oss"):
            raise ValueError("a gpt-oss spec goes with the gpt_oss architecture, and only with it")
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
        require_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                     "num_kv_heads", "head_dim", "max_position_embeddings"))
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
            if (layer.attention is AttentionKind.MLA) != (self.mla is not None):
                raise ValueError(f"layer {i}: MLA layers are exactly those of a model with an MLA spec")
            if layer.rope.rope_type == "yarn" and self.architecture not in YARN_ARCHITECTURES:
                raise ValueError(f"rope type 'yarn' is supported for {', '.join(YARN_ARCHITECTURES)} only, "
                                 f"not {self.architecture!r}")
            if layer.head_dim % 2 and layer.attention is not AttentionKind.MLA:  # an MLA row is not rotated whole
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
    def state_layer_ids(self) -> tuple[int, ...]:
        """The layers that keep a fixed-size recurrent state per request instead of KV (Mamba2)."""
        return self.granite.mamba.layer_ids if self.granite is not None else ()

    @property
    def kv_layer_ids(self) -> tuple[int, ...]:
        """The layers that compute and own KV."""
        state = set(self.state_layer_ids)
        return tuple(i for i, layer in enumerate(self.layers) if layer.kv_source is None and i not in state)

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
        if self.mla is not None and self.moe is not None:
            for n in range(self.num_layers):
                mlp = self.moe.num_parameters(h) if self.moe.is_moe_layer(n) else 3 * h * self.intermediate_size
                total += self.mla.num_parameters(h, self.num_heads) + mlp + norms * h
            return total + v * h * (1 if self.tie_word_embeddings else 2) + h
        state = set(self.state_layer_ids)
        for n, layer in enumerate(self.layers):
            q, kv = self.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
            num_kv_proj = 0 if layer.kv_source is not None else 1 if self.layer_k_is_v(n) else 2
            mixer = self._mamba_parameters() if n in state else h * (q + num_kv_proj * kv) + q * h
            sparse = self.qwen3_moe is not None and self.qwen3_moe.is_moe_layer(n)
            mlp = self.qwen3_moe.num_parameters(h) if sparse else 3 * h * self.layer_intermediate_size(n)
            if self.gpt_oss is not None:  # experts in every layer; q/k/v/o biases and a sink per head
                mlp = self.gpt_oss.num_parameters(h, self.intermediate_size)
                mixer += q + 2 * kv + h + self.num_heads
            total += mixer + mlp + norms * h + (2 * layer.head_dim if self.qk_norm else 0)
        if self.granite is not None:
            total += self.num_layers * self.granite.routed_parameters(h)
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        p, n = self.hidden_size_per_layer_input, self.num_layers
        if p:  # table, model projection and its norm; per layer: gate, projection, norm
            total += self.vocab_size_per_layer_input * n * p + h * n * p + p + n * (2 * h * p + h)
        return total + embed + h

    def _mamba_parameters(self) -> int:
        """One Mamba2 mixer: in/out projections, depthwise conv, A_log, D, dt_bias, gated norm."""
        m = self.granite.mamba
        inner = m.intermediate_size
        return (self.hidden_size * m.in_proj_width + inner * self.hidden_size + m.conv_dim * (m.d_conv + 1)
                + 3 * m.num_heads + inner)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; raises ValueError naming the field that is wrong."""
        arch = _architecture_of(d)
        if arch in GEMMA_ARCHITECTURES:
            return cls(**gemma_fields(d, arch))
        if arch == "deepseek_v3":
            return cls(**deepseek_fields(d))
        if arch == "granitemoehybrid":
            return cls(**granite_hybrid_fields(d))
        if arch == "qwen3_moe":
            return cls(**qwen3_moe_fields(d))
        if arch == "gpt_oss":
            return cls(**gpt_oss_fields(d))
        sliding = config_field(d, "sliding_window", int, None)
        if arch in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            sliding = None  # Qwen2/3 configs carry a window they do not use unless asked
        if arch == "qwen2" and sliding is not None and d.get("max_window_layers") not in (None, 0):
            raise ValueError("config field 'max_window_layers' (windowed attention only in upper layers) "
                             "is not supported; set use_sliding_window to false")
        bias = config_field(d, "attention_bias", bool, False)
        return cls(
            **decoder_fields(d, arch),
            attention_bias=arch == "qwen2" or bias,
            o_proj_bias=arch != "qwen2" and bias,
            mlp_bias=config_field(d, "mlp_bias", bool, False),
            qk_norm=arch == "qwen3",
            sliding_window=sliding or None,
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

# DeepSeek presets, also config.json-shaped. deepseek-v2-lite has DeepSeek-V2-Lite's real shapes (27
# layers, no query bottleneck, 64 routed experts of 1408 + 2 shared, top-6, the first layer dense, YaRN
# x40) under V3's router: a shape for memory and speed, not V2's softmax routing. deepseek-v3-tiny keeps
# every V3 feature (query bottleneck, grouped routing, a dense first layer, YaRN with an mscale ratio)
# at test speed, with SmolLM2's vocabulary size like the other tiny presets.
_DEEPSEEK_COMMON = dict(model_type="deepseek_v3", hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                        attention_bias=False, rope_interleave=True)
_DEEPSEEK_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, first_k_dense_replace=1,
        rope_scaling={"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                      "beta_slow": 1, "original_max_position_embeddings": 4096},
        rope_theta=10000.0, max_position_embeddings=163840, bos_token_id=100000, eos_token_id=100001,
    ),
    "deepseek-v3-tiny": dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.5, "original_max_position_embeddings": 512},
        max_position_embeddings=2048, eos_token_id=2,
    ),
}
PRESETS.update({name: ModelConfig.from_hf_dict({**_DEEPSEEK_COMMON, **d}) for name, d in _DEEPSEEK_PRESETS.items()})

# Granite-4.0-H presets, config.json-shaped. granite-4.0-h-tiny-shape has ibm-granite/granite-4.0-h-tiny's
# shapes (40 layers, attention at 5, 15, 25, 35; 64 routed experts, 6 per token, beside the shared MLP;
# ~6.9B parameters): a shape for memory and speed. granite-4.0-h-tiny keeps every feature of the dense form
# (Mamba2 groups, rope, every multiplier) at test speed; granite-4.0-h-moe-tiny adds routed experts to it.
_GRANITE_COMMON = dict(model_type="granitemoehybrid", hidden_act="silu", num_local_experts=0, mamba_conv_bias=True,
                       mamba_proj_bias=False, rms_norm_eps=1e-5, position_embedding_type="rope",
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
_GRANITE_PRESETS: dict[str, dict[str, Any]] = {
    "granite-4.0-h-tiny-shape": dict(
        vocab_size=100352, hidden_size=1536, shared_intermediate_size=1024, num_hidden_layers=40,
        num_local_experts=64, num_experts_per_tok=6, intermediate_size=512,
        num_attention_heads=12, num_key_value_heads=4, layer_types=[
            "attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
        mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=256, embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
        logits_scaling=6.0, max_position_embeddings=131072, tie_word_embeddings=True, eos_token_id=100257,
        position_embedding_type=None,
    ),
    "granite-4.0-h-tiny": dict(
        vocab_size=49152, hidden_size=64, shared_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "mamba"],
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, embedding_multiplier=12.0, attention_multiplier=0.25, residual_multiplier=0.5,
        logits_scaling=4.0, max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=2,
    ),
}
_GRANITE_PRESETS["granite-4.0-h-moe-tiny"] = dict(_GRANITE_PRESETS["granite-4.0-h-tiny"], num_local_experts=8,
                                                   num_experts_per_tok=2, intermediate_size=32)
PRESETS.update({name: ModelConfig.from_hf_dict({**_GRANITE_COMMON, **d}) for name, d in _GRANITE_PRESETS.items()})

# Qwen3-MoE presets, config.json-shaped: qwen3-30b-a3b has Qwen3-30B-A3B's shapes (48 layers, 128 experts of 768,
# 8 a token, ~30.5B parameters, ~3.3B active); qwen3-moe-tiny every feature (a dense layer among sparse ones,
# renormalised top-k) at test speed.
_QWEN3_MOE_COMMON = dict(model_type="qwen3_moe", hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                         attention_bias=False, norm_topk_prob=True, decoder_sparse_step=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
_QWEN3_MOE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        mlp_only_layers=[], max_position_embeddings=40960, eos_token_id=151645,
    ),
    "qwen3-moe-tiny": dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[0], max_position_embeddings=2048, eos_token_id=2,
    ),
}
PRESETS.update({name: ModelConfig.from_hf_dict({**_QWEN3_MOE_COMMON, **d})
                for name, d in _QWEN3_MOE_PRESETS.items()})


# gpt-oss presets, config.json-shaped: gpt-oss-20b-bf16 / -120b-bf16 have openai/gpt-oss-20b's and -120b's shapes (24
# and 36 layers alternating 128-token windows and full attention, 32 and 128 experts of 2880, 4 a token; ~20.9B and
# ~116.8B parameters) with unquantized experts; the MXFP4 presets below are them as released. gpt-oss-tiny keeps
# every feature (sinks, both layer kinds, biased experts, YaRN) at test speed, its widths multiples of 32 for MXFP4.
_GPT_OSS_COMMON = dict(model_type="gpt_oss", hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
                       attention_bias=True, swiglu_limit=7.0, num_experts_per_tok=4, head_dim=64,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "truncate": False,
                                        "original_max_position_embeddings": 4096})
_GPT_OSS_PRESETS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b-bf16": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                             num_attention_heads=64, num_key_value_heads=8, num_local_experts=32, sliding_window=128,
                             max_position_embeddings=131072, eos_token_id=200002),
    "gpt-oss-tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                         num_experts_per_tok=2, sliding_window=16, max_position_embeddings=2048, eos_token_id=2),
}
_GPT_OSS_PRESETS["gpt-oss-120b-bf16"] = dict(_GPT_OSS_PRESETS["gpt-oss-20b-bf16"], num_hidden_layers=36,
                                             num_local_experts=128)
PRESETS.update({name: ModelConfig.from_hf_dict({**_GPT_OSS_COMMON, **d}) for name, d in _GPT_OSS_PRESETS.items()})

# Quantized presets: a preset above (the same dummy weights) quantized at load by the given quantization_config, as
# the checkpoints of these models store them: DeepSeek / Qwen3-FP8's 128 x 128 blocks, fbgemm's per-row scales,
# gpt-oss's MXFP4 experts.
_FP8_BLOCKS = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
_MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}
QUANTIZED_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.1-8b-fp8": ("llama-3.1-8b", _FP8_BLOCKS),
    "llama-3.1-8b-fp8-channel": ("llama-3.1-8b", {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}),
    "deepseek-v2-lite-fp8": ("deepseek-v2-lite", _FP8_BLOCKS),
    "qwen3-0.6b-fp8": ("qwen3-0.6b", _FP8_BLOCKS),  # every projection whole 128 x 128 blocks: the GPU tests' size
    "qwen3-30b-a3b-fp8": ("qwen3-30b-a3b", _FP8_BLOCKS),  # Qwen/Qwen3-30B-A3B-FP8's format
    "tiny-fp8": ("tiny", {**_FP8_BLOCKS, "weight_block_size": [16, 16]}),
    # gpt-oss as released: MXFP4 experts, everything else as stored.
    "gpt-oss-20b": ("gpt-oss-20b-bf16", _MXFP4),
    "gpt-oss-120b": ("gpt-oss-120b-bf16", _MXFP4),
    "gpt-oss-tiny-mxfp4": ("gpt-oss-tiny", _MXFP4),
}


def preset_quantization(name: str) -> dict[str, Any] | None:
    """The ``quantization_config`` a dummy preset's weights are quantized by (None: kept in --dtype)."""
    return QUANTIZED_PRESETS[name][1] if name in QUANTIZED_PRESETS else None


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[QUANTIZED_PRESETS[name][0] if name in QUANTIZED_PRESETS else name]
    except KeyError:
        raise ValueError(f"unknown dummy preset {name!r}; presets: "
                         f"{', '.join(sorted([*PRESETS, *QUANTIZED_PRESETS]))}") from None

