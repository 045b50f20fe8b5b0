"""Reading Qwen3-MoE configs (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, -235B-A22B, Qwen3-Coder) into ModelConfig fields.

Attention is Qwen3's (per-head q/k RMSNorm before RoPE, no biases). The feed-forward block of a layer is sparse
(``Qwen3MoESpec``) unless the layer is listed in ``mlp_only_layers`` or is off the ``decoder_sparse_step`` beat;
a dense layer's MLP is ``intermediate_size`` wide, each expert ``moe_intermediate_size``. There is no shared
expert and no routing bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.model_config.layers import (
    config_field,
    decoder_fields,
    require_positive_ints,
    require_top_k_within,
)


@dataclass(frozen=True)
class Qwen3MoESpec:
    """Qwen3-MoE's experts: each token's router logits ``W_gate h`` are softmaxed over all ``num_experts`` (in
    float32), the ``num_experts_per_tok`` highest probabilities kept (renormalised to sum 1 when
    ``norm_topk_prob``) and, in the model's dtype, weight the chosen experts' outputs. Layer ``i`` is sparse when it
    is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        require_positive_ints(self, ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                     "decoder_sparse_step"))
        require_top_k_within(self.num_experts_per_tok, self.num_experts, "num_experts")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    def num_parameters(self, hidden: int) -> int:
        """Weights of one sparse layer's block: every expert's gate, up and down, and the router."""
        return self.num_experts * (3 * hidden * self.moe_intermediate_size + hidden)


def qwen3_moe_spec(d: dict[str, Any]) -> Qwen3MoESpec:
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"config field mlp_only_layers must be a list of layer indices, got {only!r}")
    return Qwen3MoESpec(
        # Qwen's checkpoints say num_experts; transformers 5 writes num_local_experts.
        num_experts=config_field(d, "num_experts", int, None) or config_field(d, "num_local_experts", int),
        num_experts_per_tok=config_field(d, "num_experts_per_tok", int),
        moe_intermediate_size=config_field(d, "moe_intermediate_size", int),
        norm_topk_prob=config_field(d, "norm_topk_prob", bool, False),
        decoder_sparse_step=config_field(d, "decoder_sparse_step", int, 1),
        mlp_only_layers=tuple(only),
    )


def qwen3_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields of a Qwen3-MoE config.json; ValueError naming what is wrong or unsupported."""
    if d.get("use_sliding_window", False):
        raise ValueError("config field 'use_sliding_window' is set: windowed Qwen3-MoE attention is not supported")
    if config_field(d, "attention_bias", bool, False):
        raise ValueError("config field 'attention_bias' is set: Qwen3-MoE attention has no biases here")
    return dict(**decoder_fields(d, "qwen3_moe"), qk_norm=True, qwen3_moe=qwen3_moe_spec(d))
