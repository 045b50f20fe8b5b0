"""Reading gpt-oss configs (gpt-oss-20b, gpt-oss-120b) into ModelConfig fields.

gpt-oss is Llama-shaped attention with biases on q/k/v/o, a learned sink logit per head, YaRN rope, and
``layer_types`` alternating sliding-window (128 tokens) and full attention: two KV-cache groups, as Gemma's.
Every layer's feed-forward block is a mixture of experts (``GptOssSpec``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.model_config.layers import (
    WINDOWED_LAYER_KINDS,
    LayerSpec,
    check_windowed_layer_types,
    config_field,
    decoder_fields,
    require_positive_ints,
    require_top_k_within,
)


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
        require_positive_ints(self, ("num_experts", "num_experts_per_tok"))
        require_top_k_within(self.num_experts_per_tok, self.num_experts, "num_local_experts")
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
    types = check_windowed_layer_types(types, num_layers)
    window = config_field(d, "sliding_window", int) if "sliding_attention" in types else None
    layers = tuple(LayerSpec(WINDOWED_LAYER_KINDS[t], fields["num_kv_heads"], fields["head_dim"], fields["rope"],
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
