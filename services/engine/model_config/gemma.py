"""Reading Gemma-2, Gemma-3 (text) and Gemma-4 (text, dense) configs into ModelConfig fields.

Per layer: attention kind from ``layer_types``, rope per layer type, Gemma-4's wider full-layer
heads (``per_layer_config`` or ``global_head_dim``) and its KV-shared trailing layers.
"""

from __future__ import annotations

from typing import Any

from services.engine.model_config.layers import (
    SUPPORTED_ACTIVATIONS,
    WINDOWED_LAYER_KINDS,
    LayerSpec,
    RopeSpec,
    check_windowed_layer_types,
    config_field,
    read_rope,
    required_key,
    rope_from_dict,
    shared_fields,
)


def gemma_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
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
    num_layers = config_field(d, "num_hidden_layers", int)
    hidden = config_field(d, "hidden_size", int)
    kv_heads = config_field(d, "num_key_value_heads", int)
    head_dim = config_field(d, "head_dim", int)
    activation = config_field(d, "hidden_activation", str)
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"config field 'hidden_activation': unsupported activation {activation!r}; "
                         f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    types = _gemma_layer_types(d, arch, num_layers)
    window = config_field(d, "sliding_window", int) if "sliding_attention" in types else None
    ropes = _gemma_ropes(d, arch, types)
    if arch == "gemma4":
        shapes = _gemma4_layer_shapes(d, types, kv_heads, head_dim)
        sources = _gemma4_kv_sources(d, types)
    else:
        shapes = [(kv_heads, head_dim)] * num_layers
        sources = [None] * num_layers
    layers = tuple(
        LayerSpec(WINDOWED_LAYER_KINDS[t], heads, dim, ropes[t], window if t == "sliding_attention" else None, src)
        for t, (heads, dim), src in zip(types, shapes, sources, strict=True)
    )
    bias = config_field(d, "attention_bias", bool, False)
    fields: dict[str, Any] = dict(
        architecture=arch,
        hidden_size=hidden,
        # transformers' default (and PretrainedConfig's): a config that omits tie_word_embeddings is tied.
        **shared_fields(d, tie_default=True),
        intermediate_size=config_field(d, "intermediate_size", int),
        num_layers=num_layers,
        num_heads=config_field(d, "num_attention_heads", int),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope=layers[0].rope,
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=arch != "gemma2",
        sliding_window=window,
        layers=layers,
        hidden_activation=activation,
        embed_scale=hidden**0.5,
        sandwich_norms=True,
    )
    if arch == "gemma4":
        required_key(d, "hidden_size_per_layer_input")  # transformers' default is 256, not none
        per_layer = config_field(d, "hidden_size_per_layer_input", int, 0)
        per_layer_vocab = config_field(d, "vocab_size_per_layer_input", int) if per_layer else 0
        if per_layer and per_layer_vocab < fields["vocab_size"]:
            raise ValueError(f"config field 'vocab_size_per_layer_input' ({per_layer_vocab}) is smaller than "
                             f"vocab_size ({fields['vocab_size']}): token ids past it have no per-layer input")
        fields.update(
            attention_scale=1.0,
            final_logit_softcapping=config_field(d, "final_logit_softcapping", float, None),
            v_norm=True,
            hidden_size_per_layer_input=per_layer,
            vocab_size_per_layer_input=per_layer_vocab,
            attention_k_eq_v=config_field(d, "attention_k_eq_v", bool, False),
            use_double_wide_mlp=config_field(d, "use_double_wide_mlp", bool, False),
        )
    else:
        fields.update(
            attention_scale=config_field(d, "query_pre_attn_scalar", float) ** -0.5,
            norm_weight_offset=1.0,
        )
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if arch == "gemma2":
                required_key(d, name)  # transformers' Gemma-2 default is a cap, not none
            fields[name] = config_field(d, name, float, None)
        if arch == "gemma3":
            # Gemma-3 replaced score capping by q/k norms: transformers' Gemma-3 attention never
            # applies attn_logit_softcapping, whatever the config says, and neither do we.
            fields["attn_logit_softcapping"] = None
    return fields


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
    types = check_windowed_layer_types(types, num_layers)
    if arch == "gemma4" and types[-1] != "full_attention":
        # transformers silently turns such a last layer into a full one; we refuse to guess.
        raise ValueError("config field 'layer_types': Gemma-4's last layer must be 'full_attention', "
                         f"got {types[-1]!r}")
    return types


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
            base = config_field(d, "rope_local_base_freq", float)
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
                heads = config_field(layer, "num_key_value_heads", int, shapes[index][0])
                dim = config_field(layer, "head_dim", int, shapes[index][1])
            except ValueError as e:
                raise ValueError(f"config field {where!r}: {e}") from None
            shapes[index] = (heads, dim)
        return shapes
    if "full_attention" not in types:
        return shapes
    global_dim = config_field(d, "global_head_dim", int)
    global_heads = config_field(d, "num_global_key_value_heads", int, None) if d.get("attention_k_eq_v") else None
    full = (global_heads or kv_heads, global_dim)
    return [full if t == "full_attention" else s for t, s in zip(types, shapes, strict=True)]


def _gemma4_kv_sources(d: dict[str, Any], types: list[str]) -> list[int | None]:
    """The layer whose KV each layer reads: the last ``num_kv_shared_layers`` layers read the last
    earlier (non-shared) layer of their own type; the others their own (None)."""
    n = len(types)
    shared = config_field(d, "num_kv_shared_layers", int, 0)
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
