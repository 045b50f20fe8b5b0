"""Per-layer attention facts (rope, KV shape, window, KV sharing) and how a config.json states them.

Torch-free, shared by every architecture's config reading. Values are read, never defaulted: a
field that shapes the math and is missing or unsupported is a ValueError that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from services.kv.spec.groups import AttentionKind

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional", "yarn")
# YaRN is read only for the architectures whose attention applies its magnitude scaling (the cos/sin
# factor and, for DeepSeek, the softmax scale): elsewhere it would be read and then computed wrong.
YARN_ARCHITECTURES = ("deepseek_v3", "gpt_oss")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# Keys a rope dict may carry, per rope type; anything else shapes the math in a way we do not
# implement, so it is an error rather than something to ignore.
_ROPE_KEYS = {
    "default": {"rope_theta"},
    "linear": {"rope_theta", "factor"},
    "llama3": {"rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "proportional": {"rope_theta", "factor", "partial_rotary_factor"},
    "yarn": {"rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"},
}
_ROPE_REQUIRED = {
    "default": {"rope_theta"},
    "linear": {"rope_theta", "factor"},
    "llama3": _ROPE_KEYS["llama3"],
    "proportional": {"rope_theta"},
    "yarn": {"rope_theta", "factor", "original_max_position_embeddings"},
}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer: base, type and the type's parameters.

    ``proportional`` (Gemma-4 full layers) rotates only the first ``partial_rotary_factor`` of each
    half of the head and leaves the rest unrotated (zero frequency), with frequencies spaced over
    the whole head dim.

    ``yarn`` (DeepSeek) blends interpolated and original frequencies between the ``beta_fast`` and
    ``beta_slow`` rotation counts over ``original_max_position_embeddings``, and scales cos/sin by
    ``cos_sin_scale``; ``mscale_all_dim`` also changes DeepSeek's softmax scale (``yarn_mscale``).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def cos_sin_scale(self) -> float:
        """What YaRN multiplies cos and sin by (so q.k of the rotated parts by its square); 1 otherwise.

        Given as ``attention_factor``, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
        when both are set (DeepSeek: 1.0 when they are equal), else ``mscale(factor)``.
        """
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times: ``0.1 * mscale * ln(factor) + 1``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


REQUIRED = object()


def config_field(d: dict[str, Any], name: str, convert: Any, default: Any = REQUIRED) -> Any:
    """``convert(d[name])``, or ``default`` when absent or null; errors name the field."""
    value = d.get(name)
    if value is None:
        if default is REQUIRED:
            raise ValueError(f"config is missing required field {name!r}")
        return default
    if isinstance(value, (dict, str)) and convert in (int, float):
        raise ValueError(f"config field {name!r} must be a number, got {value!r}")
    try:
        return convert(value)
    except (TypeError, ValueError):
        raise ValueError(f"config field {name!r} has the wrong type: {value!r}") from None


def require_positive_ints(spec: object, names: tuple[str, ...], what: str = "config field") -> None:
    """ValueError naming the first of ``spec``'s attributes ``names`` that is not a positive int (a bool is not)."""
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} {name} must be a positive integer, got {value!r}")


def require_top_k_within(top_k: int, num_experts: int, experts_field: str) -> None:
    """A router cannot pick more experts a token than there are: ValueError naming both fields."""
    if top_k > num_experts:
        raise ValueError(f"config field num_experts_per_tok ({top_k}) exceeds {experts_field} ({num_experts})")


# The attention kind of each ``layer_types`` entry of the sliding/full families (Gemma, gpt-oss).
WINDOWED_LAYER_KINDS = {"sliding_attention": AttentionKind.SLIDING_WINDOW, "full_attention": AttentionKind.FULL}


def check_windowed_layer_types(types: Any, num_layers: int) -> list[str]:
    """``layer_types`` as read: one ``WINDOWED_LAYER_KINDS`` key per layer, else a ValueError naming the field."""
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"config field 'layer_types' must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted({t for t in types if t not in WINDOWED_LAYER_KINDS}, key=str)
    if unknown:
        raise ValueError(f"config field 'layer_types': unsupported layer types {unknown}; "
                         f"supported: {', '.join(WINDOWED_LAYER_KINDS)}")
    return list(types)


def read_eos_token_ids(d: dict[str, Any]) -> tuple[int, ...]:
    """``eos_token_id`` as a tuple: configs hold one id or a list of them."""
    return config_field(d, "eos_token_id", lambda v: tuple(int(x) for x in (v if isinstance(v, list) else [v])), ())


def decoder_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """The ModelConfig fields of a Llama-shaped decoder's config.json: widths, depth, heads, head dim, rope, and
    ``shared_fields``' (a KV head count or head dim left out means the full attention's)."""
    hidden = config_field(d, "hidden_size", int)
    heads = config_field(d, "num_attention_heads", int)
    return dict(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=config_field(d, "intermediate_size", int),
        **shared_fields(d),
        num_layers=config_field(d, "num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=config_field(d, "num_key_value_heads", int, None) or heads,
        head_dim=config_field(d, "head_dim", int, None) or hidden // heads,
        rope=read_rope(d),
    )


def shared_fields(d: dict[str, Any], tie_default: bool = False) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way: vocabulary, norm epsilon, context, tied head,
    BOS and EOS ids (``tie_default``: what a config without ``tie_word_embeddings`` means for the family)."""
    return dict(vocab_size=config_field(d, "vocab_size", int),
                rms_norm_eps=config_field(d, "rms_norm_eps", float),
                max_position_embeddings=config_field(d, "max_position_embeddings", int),
                tie_word_embeddings=config_field(d, "tie_word_embeddings", bool, tie_default),
                bos_token_id=config_field(d, "bos_token_id", int, None),
                eos_token_ids=read_eos_token_ids(d))


def required_key(d: dict[str, Any], name: str) -> Any:
    """``d[name]`` where null is a meaningful value but absence is not."""
    if name not in d:
        raise ValueError(f"config is missing required field {name!r}")
    return d[name]


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

    def optional(key: str) -> float | None:
        return None if params.get(key) is None else number(key, 0.0)

    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"config field {where}.truncate must be true or false, got {truncate!r}")
    original = params.get("original_max_position_embeddings")
    return RopeSpec(
        theta=number("rope_theta", 0.0),
        rope_type=rope_type,
        factor=number("factor", 1.0),
        low_freq_factor=number("low_freq_factor", 1.0),
        high_freq_factor=number("high_freq_factor", 4.0),
        original_max_position_embeddings=None if original is None else int(original),
        partial_rotary_factor=number("partial_rotary_factor", 1.0),
        beta_fast=optional("beta_fast") or 32.0,  # null or 0 is the default, as in transformers
        beta_slow=optional("beta_slow") or 1.0,
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        truncate=truncate,
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
