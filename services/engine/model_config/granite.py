"""Reading Granite-4.0-H configs (``GraniteMoeHybridForCausalLM``, dense or MoE) into ModelConfig fields.

Granite-4.0-H interleaves Mamba2 layers with attention layers (``layer_types``: ``mamba`` or
``linear_attention`` for a Mamba2 layer, ``attention`` or ``full_attention`` for an attention
layer). Two values have no counterpart in the Llama-shaped config:

* ``MambaSpec``: the Mamba2 mixer's shapes (heads, head dim, state size, groups, conv width,
  scan chunk) and which layers are Mamba2 layers. Those layers own no KV cache: each request keeps
  a fixed-size state per such layer instead (``kv_cache/state_pool.py``).
* ``GraniteSpec``: the multipliers Granite puts where Llama has none (residual branches scaled
  by ``residual_multiplier``, logits divided by ``logits_scaling``) and whether attention rotates
  at all (``position_embedding_type`` ``rope``; ``nope`` or null: no rotation).
* ``GraniteExpertsSpec``: the routed experts every layer has beside its shared MLP when
  ``num_local_experts`` > 0 (Granite-4.0-H-Tiny, -Small); 0 is the dense form (-Micro).

The embedding multiplier and the attention multiplier are ModelConfig's ``embed_scale`` and
``attention_scale``; ModelConfig's ``intermediate_size`` is the shared MLP's width
(``shared_intermediate_size``), while ``intermediate_size`` in config.json is each routed expert's.
``num_local_experts`` is read, not defaulted: transformers' default is 8 experts, not the dense form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from services.engine.model_config.layers import (
    LayerSpec,
    RopeSpec,
    config_field,
    read_rope,
    require_positive_ints,
    require_top_k_within,
    shared_fields,
)
from services.kv.spec.groups import AttentionKind, MambaShape

MAMBA_LAYER_TYPES = ("mamba", "linear_attention")
ATTENTION_LAYER_TYPES = ("attention", "full_attention")


@dataclass(frozen=True)
class MambaSpec:
    """Shapes of the Mamba2 mixer and the layers that have one (``layer_ids``).

    ``time_step_limit``: the softplus'ed time step is clamped to this range; the reader accepts only
    transformers' default ``(0, inf)``, which changes nothing.
    """

    layer_ids: tuple[int, ...]
    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    chunk_size: int
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    def __post_init__(self) -> None:
        require_positive_ints(self, ("num_heads", "head_dim", "d_state", "n_groups", "d_conv", "chunk_size"),
                              "config field mamba")
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba_n_heads ({self.num_heads}) must be a multiple of mamba_n_groups "
                             f"({self.n_groups})")
        if self.d_conv < 2:
            raise ValueError(f"mamba_d_conv must be >= 2, got {self.d_conv}")

    def state_shape(self, conv_dtype: str = "float32") -> MambaShape:
        """The state's shape and its TP split, as the KV library moves it (one definition for both)."""
        return MambaShape(self.num_heads, self.head_dim, self.n_groups, self.d_state, self.d_conv, conv_dtype)

    def for_rank(self, tp_size: int, tp_rank: int) -> MambaSpec:
        """The mixer one TP rank holds: its heads and their groups (``MambaShape.rank_heads``/``rank_groups``);
        ValueError when the heads or groups do not split."""
        if tp_size == 1:
            return self
        heads, groups = self.rank_channels(tp_size, tp_rank)
        return replace(self, num_heads=len(heads), n_groups=len(groups))

    def rank_channels(self, tp_size: int, tp_rank: int) -> tuple[range, range]:
        """(heads, groups) of the full mixer that rank ``tp_rank`` of ``tp_size`` holds, in order."""
        shape = self.state_shape()
        return shape.rank_heads(tp_size, tp_rank), shape.rank_groups(tp_size, tp_rank)

    @property
    def intermediate_size(self) -> int:
        """Width of the mixer's inner stream (``x`` and the gate ``z``): heads x head dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the causal conv runs over: ``x``, then B and C (one ``d_state`` row per group each)."""
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    @property
    def in_proj_width(self) -> int:
        """``in_proj`` output: the gate ``z``, the conv channels, one time step per head."""
        return self.intermediate_size + self.conv_dim + self.num_heads


@dataclass(frozen=True)
class GraniteExpertsSpec:
    """Granite's routed experts (transformers' ``GraniteMoeHybridMoE``), fields named as in config.json.

    Each token takes the ``num_experts_per_tok`` experts of highest router logit (``router.layer``: no
    bias, no groups) and weights their outputs by the softmax of those logits alone, i.e. the full
    softmax renormalised over the chosen experts. Every expert is a silu-gated MLP
    ``intermediate_size`` wide; the block's output is added to the shared MLP's.
    """

    num_local_experts: int
    num_experts_per_tok: int
    intermediate_size: int

    def __post_init__(self) -> None:
        require_positive_ints(self, ("num_local_experts", "num_experts_per_tok", "intermediate_size"))
        require_top_k_within(self.num_experts_per_tok, self.num_local_experts, "num_local_experts")

    def num_parameters(self, hidden: int) -> int:
        """Weights of one layer's routed experts and router (the shared MLP not counted)."""
        return self.num_local_experts * (3 * hidden * self.intermediate_size + hidden)


@dataclass(frozen=True)
class GraniteSpec:
    """Granite's departures from Llama's residual stream and head, its Mamba2 layers and its routed
    experts (None: the dense form, the shared MLP alone)."""

    mamba: MambaSpec
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    use_rope: bool = True
    experts: GraniteExpertsSpec | None = None

    def routed_parameters(self, hidden: int) -> int:
        """Weights of one layer's routed experts and router; 0 in the dense form."""
        return 0 if self.experts is None else self.experts.num_parameters(hidden)


def granite_hybrid_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a GraniteMoeHybrid config (dense, or with routed experts)."""
    act = config_field(d, "hidden_act", str, "silu")
    if act != "silu":
        raise ValueError(f"config field 'hidden_act' is {act!r}: only 'silu' is supported")
    num_layers = config_field(d, "num_hidden_layers", int)
    types = d.get("layer_types") or d.get("layers_block_type") or [MAMBA_LAYER_TYPES[0]] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"config field 'layer_types' has {len(types)} entries for {num_layers} layers")
    unknown = sorted({t for t in types if t not in MAMBA_LAYER_TYPES + ATTENTION_LAYER_TYPES})
    if unknown:
        raise ValueError(f"config field 'layer_types': unsupported layer types {', '.join(map(repr, unknown))}")
    hidden = config_field(d, "hidden_size", int)
    heads = config_field(d, "num_attention_heads", int)
    kv_heads = config_field(d, "num_key_value_heads", int, None) or heads
    head_dim = hidden // heads
    position = d.get("position_embedding_type")
    if position not in (None, "rope", "nope"):
        raise ValueError(f"config field 'position_embedding_type' is {position!r}: 'rope', 'nope' or null "
                         "are supported")
    rope = read_rope(d) if position == "rope" else RopeSpec(10000.0)  # unused without rope
    mamba_heads = config_field(d, "mamba_n_heads", int)
    mamba_head_dim = d.get("mamba_d_head", "auto")
    expand = config_field(d, "mamba_expand", int, 2)
    if mamba_head_dim in (None, "auto"):
        mamba_head_dim = expand * hidden // mamba_heads
    limit = d.get("time_step_limit") or (0.0, float("inf"))
    mamba = MambaSpec(
        layer_ids=tuple(i for i, t in enumerate(types) if t in MAMBA_LAYER_TYPES),
        num_heads=mamba_heads,
        head_dim=int(mamba_head_dim),
        d_state=config_field(d, "mamba_d_state", int),
        n_groups=config_field(d, "mamba_n_groups", int, 1),
        d_conv=config_field(d, "mamba_d_conv", int, 4),
        chunk_size=config_field(d, "mamba_chunk_size", int, 256),
        conv_bias=config_field(d, "mamba_conv_bias", bool, True),
        proj_bias=config_field(d, "mamba_proj_bias", bool, False),
        time_step_limit=(_json_float(limit[0]), _json_float(limit[1])),
    )
    if mamba.time_step_limit != (0.0, float("inf")):
        raise ValueError(f"config field 'time_step_limit' is {mamba.time_step_limit}: only (0, inf) is supported "
                         "(transformers clamps the time step in prefill but not in decode)")
    bias = config_field(d, "attention_bias", bool, False)
    return dict(
        architecture="granitemoehybrid",
        **shared_fields(d),
        hidden_size=hidden,
        intermediate_size=config_field(d, "shared_intermediate_size", int),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope=rope,
        attention_bias=bias,
        o_proj_bias=bias,
        # A Mamba2 layer gets a full-attention spec only so per-layer checks hold; it owns no KV
        # (ModelConfig.state_layer_ids keeps it out of every KV-cache group).
        layers=(LayerSpec(AttentionKind.FULL, kv_heads, head_dim, rope),) * num_layers,
        attention_scale=config_field(d, "attention_multiplier", float, 1.0),
        embed_scale=config_field(d, "embedding_multiplier", float, 1.0),
        granite=GraniteSpec(
            mamba=mamba,
            residual_multiplier=config_field(d, "residual_multiplier", float, 1.0),
            logits_scaling=config_field(d, "logits_scaling", float, 1.0),
            use_rope=position == "rope",
            experts=_read_experts(d),
        ),
    )


def _read_experts(d: dict[str, Any]) -> GraniteExpertsSpec | None:
    """The routed experts of a config, None for the dense form (``num_local_experts`` 0)."""
    num_experts = config_field(d, "num_local_experts", int)
    if num_experts < 0:
        raise ValueError(f"config field 'num_local_experts' must be >= 0, got {num_experts}")
    if not num_experts:
        return None
    return GraniteExpertsSpec(num_local_experts=num_experts,
                              num_experts_per_tok=config_field(d, "num_experts_per_tok", int),
                              intermediate_size=config_field(d, "intermediate_size", int))


def _json_float(value: Any) -> float:
    """A number of config.json, where transformers writes infinity as ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"config field 'time_step_limit' holds {value!r}, not a number") from None
