"""Reading gpt-oss configs (gpt-oss-20b, gpt-oss-120b) into ModelConfig fields.

gpt-oss is Llama-shaped attention with biases on q/k/v/o, a learned sink logit per head, YaRN rope, and
``layer_types`` alternating sliding-window (128 tokens) and full attention: two KV-cache groups, as Gemma's.
Every layer's feed-forward block is a mixture of experts (``GptOssSpec``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.model_config.layers import LayerSpec, config_field, decoder_fields
from services.kv.spec.groups import AttentionKind

_LAYER_KINDS = {"sliding_attention": AttentionKind.SLIDING_WINDOW, "full_attention": AttentionKind.FULL}


@dataclass(frozen=True)
class GptOssSpec:
    """gpt-oss's experts: a router with a bias picks each token's ``num_experts_per_tok`` highest logits and
    softmaxes only those; each expert is ``down((up + 1) * g * sigmoid(alpha * g))`` with ``g = min(gate, limit)``
    and ``up`` clamped to ``[-limit, limit]``, every projection with a bias, gate and up interleaved in one
    checkpoint tensor (``gate_up_proj[..., ::2]`` / ``[..., 1::2]``)."""

    num_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"config field num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"num_local_experts ({self.num_experts})")
        if not self.swiglu_limit > 0:
            raise ValueError(f"config field swiglu_limit must be > 0, got {self.swiglu_limit}")

    def num_parameters(self, hidden: int, intermediate: int) -> int:
        """One layer's block: every expert's gate/up and down with their biases, and the router with its bias."""
        expert = hidden * 2 * intermediate + 2 * intermediate + intermediate * hidden + hidden
        return self.num_experts * (expert + hidden + 1)


def gpt_oss_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields of a gpt-oss config.json; ValueError naming what is wrong or unsupported."""
    act = config_field(d, "hidden_act", str, "silu")
    if act != "silu":
        raise ValueError(f"config field 'hidden_act' is {act!r}: gpt-oss experts use their clamped SwiGLU ('silu')")
    fields = decoder_fields(d, "gpt_oss")
    num_layers = fields["num_layers"]
    types = d.get("layer_types")
    if types is None:  # transformers' default: sliding first, then alternating
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"config field 'layer_types' must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted(set(types) - set(_LAYER_KINDS))
    if unknown:
        raise ValueError(f"config field 'layer_types': unsupported layer types {unknown}; "
                         f"supported: {', '.join(_LAYER_KINDS)}")
    window = config_field(d, "sliding_window", int) if "sliding_attention" in types else None
    layers = tuple(LayerSpec(_LAYER_KINDS[t], fields["num_kv_heads"], fields["head_dim"], fields["rope"],
                             window if t == "sliding_attention" else None) for t in types)
    bias = config_field(d, "attention_bias", bool, True)
    spec = GptOssSpec(
        num_experts=config_field(d, "num_local_experts", int),
        num_experts_per_tok=config_field(d, "num_experts_per_tok", int, None) or config_field(d, "experts_per_token",
                                                                                              int),
        swiglu_alpha=config_field(d, "swiglu_alpha", float, 1.702),
        swiglu_limit=config_field(d, "swiglu_limit", float, 7.0),
    )
    return dict(**fields, attention_bias=bias, o_proj_bias=bias, sliding_window=window, layers=layers, gpt_oss=spec)
