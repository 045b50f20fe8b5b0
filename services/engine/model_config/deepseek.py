"""Reading DeepSeek-V3 configs (and V2-shaped ones under the V3 model type) into ModelConfig fields.

Two groups of fields have no counterpart in the Llama-shaped config and get a value of their own:

* ``MLASpec``: multi-head latent attention. Queries come through an optional low-rank bottleneck
  (``q_lora_rank``; None: one ``q_proj``, as DeepSeek-V2-Lite); keys and values come from one
  compressed latent of ``kv_lora_rank`` plus a ``qk_rope_head_dim`` key part shared by every head.
  The KV cache holds exactly that row per token and layer (``row_width``), so each layer's spec
  is one "KV head" of that width (``AttentionKind.MLA``).
* ``MoESpec``: DeepSeek's routed experts (sigmoid scores, a per-expert correction bias that only
  steers the choice, group-limited top-k) beside always-on shared experts; the first
  ``first_k_dense_replace`` layers have a dense MLP of ``intermediate_size`` instead.

As in ``gemma.py``, a field the math depends on is read, not defaulted, except where
transformers' default is the only value real checkpoints use (``rope_interleave``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.model_config.layers import (
    LayerSpec,
    config_field,
    read_rope,
    require_positive_ints,
    required_key,
    shared_fields,
    yarn_mscale,
)
from services.kv.spec.groups import AttentionKind


@dataclass(frozen=True)
class MLASpec:
    """Shapes of DeepSeek's multi-head latent attention (per query head unless said otherwise).

    ``rope_interleave``: the checkpoint's rope dims are pairs ``(x0, x1), (x2, x3) ...`` rotated
    together (DeepSeek's own layout, transformers' default) rather than the two halves.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        require_positive_ints(self, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"config field q_lora_rank must be a positive integer or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config field qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: the unrotated part, then the rotated one."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def row_width(self) -> int:
        """Elements one token caches per layer: the normalised latent, then the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def num_parameters(self, hidden: int, num_heads: int) -> int:
        """Weights of one layer's attention (projections and their norms; biases not counted)."""
        q = num_heads * self.qk_head_dim
        q_params = hidden * q if self.q_lora_rank is None else (hidden + q + 1) * self.q_lora_rank
        kv = hidden * self.row_width + self.kv_lora_rank * (1 + num_heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q_params + kv + num_heads * self.v_head_dim * hidden


@dataclass(frozen=True)
class MoESpec:
    """DeepSeek-V3's mixture of experts.

    Each token scores every routed expert with ``sigmoid(W_gate h)``. The choice adds
    ``e_score_correction_bias`` to the scores, keeps the ``topk_group`` of ``n_group`` expert groups
    whose two best scores sum highest, and takes the ``num_experts_per_tok`` best experts there; the
    chosen experts' *uncorrected* scores, renormalised when ``norm_topk_prob`` and then times
    ``routed_scaling_factor``, weight their outputs. ``n_shared_experts`` always-on experts form
    one MLP ``n_shared_experts * moe_intermediate_size`` wide. Layers before
    ``first_k_dense_replace`` are dense.
    """

    n_routed_experts: int
    n_shared_experts: int
    moe_intermediate_size: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int

    def __post_init__(self) -> None:
        require_positive_ints(self, ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "n_group",
                                     "topk_group"))
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("config fields n_shared_experts and first_k_dense_replace must be >= 0")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"config field n_routed_experts ({self.n_routed_experts}) must be a multiple of "
                             f"n_group ({self.n_group})")
        if self.experts_per_group < 2:
            raise ValueError(f"every expert group needs at least 2 experts (a group scores as its best two), got "
                             f"{self.experts_per_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"config field topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * self.experts_per_group:
            raise ValueError(f"config field num_experts_per_tok ({self.num_experts_per_tok}) exceeds the "
                             f"{self.topk_group * self.experts_per_group} experts of the {self.topk_group} kept groups")

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    def num_parameters(self, hidden: int) -> int:
        """Weights of one MoE layer's MLP: routed and shared experts, the router and its bias."""
        per_expert = 3 * hidden * self.moe_intermediate_size
        return (self.n_routed_experts + self.n_shared_experts) * per_expert + self.n_routed_experts * (hidden + 1)


def deepseek_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V3 config (``model_type`` ``deepseek_v3``).

    Every layer is an MLA layer; ``num_kv_heads`` 1 and ``head_dim`` the latent row's width describe
    what the KV cache holds, not the query heads. ``attention_scale`` is transformers':
    ``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN.
    Other routers than V3's are refused by field name.
    """
    activation = config_field(d, "hidden_act", str)
    if activation != "silu":
        raise ValueError(f"config field 'hidden_act': DeepSeek-V3's MLPs are silu-gated, got {activation!r}")
    for name, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if d.get(name) not in (None, supported):
            raise ValueError(f"config field {name!r} is {d[name]!r}: only DeepSeek-V3's router ({supported}) "
                             "is supported")
    if d.get("moe_layer_freq") not in (None, 1):
        raise ValueError(f"config field 'moe_layer_freq' is {d['moe_layer_freq']!r}: only every layer past "
                         "first_k_dense_replace being MoE (1) is supported")
    required_key(d, "q_lora_rank")  # null is meaningful (no query bottleneck), absence is not
    mla = MLASpec(
        q_lora_rank=config_field(d, "q_lora_rank", int, None),
        kv_lora_rank=config_field(d, "kv_lora_rank", int),
        qk_nope_head_dim=config_field(d, "qk_nope_head_dim", int),
        qk_rope_head_dim=config_field(d, "qk_rope_head_dim", int),
        v_head_dim=config_field(d, "v_head_dim", int),
        # transformers' default, and the layout of every DeepSeek checkpoint on the hub.
        rope_interleave=config_field(d, "rope_interleave", bool, True),
    )
    moe = MoESpec(
        n_routed_experts=config_field(d, "n_routed_experts", int),
        n_shared_experts=config_field(d, "n_shared_experts", int, 0),
        moe_intermediate_size=config_field(d, "moe_intermediate_size", int),
        num_experts_per_tok=config_field(d, "num_experts_per_tok", int),
        n_group=config_field(d, "n_group", int),
        topk_group=config_field(d, "topk_group", int),
        norm_topk_prob=config_field(d, "norm_topk_prob", bool),
        routed_scaling_factor=config_field(d, "routed_scaling_factor", float),
        first_k_dense_replace=config_field(d, "first_k_dense_replace", int),
    )
    num_layers = config_field(d, "num_hidden_layers", int)
    rope = read_rope(d)
    scale = mla.qk_head_dim**-0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    bias = config_field(d, "attention_bias", bool, False)
    return dict(
        architecture="deepseek_v3",
        **shared_fields(d),
        hidden_size=config_field(d, "hidden_size", int),
        intermediate_size=config_field(d, "intermediate_size", int),
        num_layers=num_layers,
        num_heads=config_field(d, "num_attention_heads", int),
        num_kv_heads=1,
        head_dim=mla.row_width,
        rope=rope,
        attention_bias=bias,
        o_proj_bias=bias,
        layers=(LayerSpec(AttentionKind.MLA, 1, mla.row_width, rope),) * num_layers,
        attention_scale=scale,
        mla=mla,
        moe=moe,
    )
