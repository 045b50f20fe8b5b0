"""Reading Gemma-2/3/4 config.json: per-layer attention, ropes, KV sharing, and refusals by field name.

The configs are the ones transformers 5.23 writes (``save_pretrained``) and the older hub forms
(``rope_theta``/``rope_local_base_freq``, ``global_head_dim``); anything the math depends on
that is missing or unsupported is a ValueError naming the field.
"""

from __future__ import annotations

import copy
import json

import pytest

from services.engine.model_config.hf import PRESETS, ModelConfig, RopeSpec
from services.kv.spec.groups import AttentionKind

S, F = AttentionKind.SLIDING_WINDOW, AttentionKind.FULL

GEMMA2 = dict(
    model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=320, hidden_size=64,
    intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, max_position_embeddings=512, sliding_window=16,
    query_pre_attn_scalar=24, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0,
)
GEMMA3 = dict(
    GEMMA2, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], num_hidden_layers=6,
    sliding_window_pattern=3, rope_theta=1000000.0, rope_local_base_freq=10000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0}, attn_logit_softcapping=None, final_logit_softcapping=None,
)
GEMMA4 = dict(
    model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], vocab_size=320, hidden_size=64,
    intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6, max_position_embeddings=512, sliding_window=16,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
    use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=320,
    final_logit_softcapping=30.0, enable_moe_block=False, use_bidirectional_attention=None,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
)


def _edit(base: dict, **changes) -> dict:
    d = copy.deepcopy(base)
    for key, value in changes.items():
        if value is ...:
            d.pop(key, None)
        else:
            d[key] = value
    return d


def test_gemma2_alternates_sliding_and_full_with_softcaps() -> None:
    c = ModelConfig.from_hf_dict(GEMMA2)
    assert c.architecture == "gemma2"
    assert [layer.attention for layer in c.layers] == [S, F, S, F]  # sliding on even layers
    assert {layer.sliding_window for layer in c.layers} == {16, None}
    assert c.attention_scale == pytest.approx(24**-0.5)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    assert c.embed_scale == pytest.approx(8.0) and c.norm_weight_offset == 1.0 and c.sandwich_norms
    assert c.tie_word_embeddings and not c.qk_norm and c.hidden_activation == "gelu_pytorch_tanh"


def test_gemma3_old_form_ropes_per_layer_type() -> None:
    c = ModelConfig.from_hf_dict(GEMMA3)
    assert [layer.attention for layer in c.layers] == [S, S, F, S, S, F]
    assert c.layers[0].rope == RopeSpec(10000.0)
    assert c.layers[2].rope == RopeSpec(1000000.0, "linear", 8.0)  # rope_scaling is for full layers
    assert c.qk_norm and c.attn_logit_softcapping is None and c.final_logit_softcapping is None
    # transformers' Gemma-3 attention never applies a score cap, even one the config sets.
    capped = ModelConfig.from_hf_dict(_edit(GEMMA3, attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    assert capped.attn_logit_softcapping is None and capped.final_logit_softcapping == 30.0


def test_gemma4_per_layer_shapes_and_kv_sharing() -> None:
    c = ModelConfig.from_hf_dict(GEMMA4)
    assert c.architecture == "gemma4"
    assert [(layer.num_kv_heads, layer.head_dim) for layer in c.layers] == [(2, 16), (2, 16), (1, 32)] * 2
    assert c.kv_sharing == {4: 3, 5: 2}  # the last layer of the same kind before the shared ones
    assert c.kv_layer_ids == (0, 1, 2, 3)
    assert c.layers[2].rope == RopeSpec(1000000.0, "proportional", partial_rotary_factor=0.25)
    assert [c.layer_intermediate_size(i) for i in range(6)] == [128] * 4 + [256] * 2
    assert [c.layer_k_is_v(i) for i in range(6)] == [False, False, True] * 2
    assert c.attention_scale == 1.0 and c.norm_weight_offset == 0.0 and c.v_norm
    assert (c.hidden_size_per_layer_input, c.vocab_size_per_layer_input) == (8, 320)


def test_gemma4_per_layer_config_as_transformers_saves_it(tmp_path) -> None:
    """5.23 writes the derived overrides as ``per_layer_config`` (no ``global_head_dim``): same result."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma4TextConfig(**{k: v for k, v in GEMMA4.items() if k not in ("model_type", "architectures")})
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "per_layer_config" in saved and "global_head_dim" not in saved
    assert ModelConfig.from_hf_dict(saved).layers == ModelConfig.from_hf_dict(GEMMA4).layers
    # Without attention_k_eq_v the global KV-head count does not apply (as in transformers).
    c = ModelConfig.from_hf_dict(_edit(GEMMA4, attention_k_eq_v=False))
    assert c.layers[2].num_kv_heads == 2 and not c.layer_k_is_v(2)


def test_saved_gemma2_and_gemma3_configs_read_back(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.checkpoints import hf_config

    for arch in ("gemma2", "gemma3"):
        hf_config(arch).save_pretrained(tmp_path / arch)
        d = json.loads((tmp_path / arch / "config.json").read_text())
        c = ModelConfig.from_hf_dict(d)
        hf = transformers.AutoConfig.from_pretrained(tmp_path / arch)
        assert [layer.attention is S for layer in c.layers] == [t == "sliding_attention" for t in hf.layer_types]


@pytest.mark.parametrize(("base", "changes", "field"), [
    # the rope base
    (GEMMA2, dict(rope_theta=...), "rope_theta"),
    (GEMMA3, dict(rope_local_base_freq=...), "rope_local_base_freq"),
    (GEMMA4, dict(rope_parameters=...), "rope_parameters"),
    # an unsupported rope type
    (GEMMA2, dict(rope_theta=..., rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "yarn"),
    (GEMMA4, dict(rope_parameters={**GEMMA4["rope_parameters"],
                                   "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6}}), "dynamic"),
    # a layer type without its rope
    (GEMMA4, dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "full_attention"),
    (GEMMA3, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "rope_parameters"),
    # Gemma-4 MoE and bidirectional attention
    (GEMMA4, dict(enable_moe_block=True), "enable_moe_block"),
    (GEMMA4, dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (GEMMA3, dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    # fields whose transformers default would be a guess
    (GEMMA2, dict(query_pre_attn_scalar=...), "query_pre_attn_scalar"),
    (GEMMA2, dict(attn_logit_softcapping=...), "attn_logit_softcapping"),
    (GEMMA2, dict(head_dim=...), "head_dim"),
    (GEMMA3, dict(sliding_window_pattern=...), "sliding_window_pattern"),
    (GEMMA4, dict(global_head_dim=...), "global_head_dim"),
    (GEMMA4, dict(hidden_size_per_layer_input=...), "hidden_size_per_layer_input"),
    (GEMMA4, dict(layer_types=...), "layer_types"),
    (GEMMA2, dict(sliding_window=...), "sliding_window"),
    # unsupported values
    (GEMMA2, dict(hidden_activation="relu"), "hidden_activation"),
    (GEMMA4, dict(layer_types=["sliding_attention"] * 6), "layer_types"),
    (GEMMA4, dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"] * 2), "layer_types"),
    (GEMMA4, dict(num_kv_shared_layers=6), "num_kv_shared_layers"),
    (GEMMA4, dict(layer_types=["sliding_attention"] * 4 + ["full_attention"] * 2), "num_kv_shared_layers"),
    (GEMMA4, dict(per_layer_config={"2": {"intermediate_size": 256}}), "per_layer_config.2"),
    (GEMMA4, dict(vocab_size_per_layer_input=100), "vocab_size_per_layer_input"),
])
def test_refused_with_the_field_named(base: dict, changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(_edit(base, **changes))


@pytest.mark.parametrize("d", [
    dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"], text_config=GEMMA3,
         vision_config={"model_type": "siglip_vision_model"}),
    dict(model_type="gemma4", architectures=["Gemma4ForConditionalGeneration"], text_config=GEMMA4),
])
def test_multimodal_checkpoints_are_refused(d: dict) -> None:
    with pytest.raises(ValueError, match="multimodal"):
        ModelConfig.from_hf_dict(d)


def test_flat_text_only_gemma3_config_is_read() -> None:
    assert ModelConfig.from_hf_dict(_edit(GEMMA3, model_type="gemma3")).architecture == "gemma3"


@pytest.mark.parametrize("name", ["gemma2-2b", "gemma3-1b", "gemma4-e2b", "gemma2-tiny", "gemma3-tiny", "gemma4-tiny"])
def test_gemma_presets(name: str) -> None:
    c = PRESETS[name]
    assert c.architecture == name[:6]
    kinds = {layer.attention for layer in c.layers}
    assert kinds == {S, F}
    if c.architecture == "gemma4":
        assert c.num_kv_shared_layers > 0 and c.hidden_size_per_layer_input > 0
        assert {layer.head_dim for layer in c.layers if layer.attention is F} == {2 * c.head_dim}
    if name == "gemma4-e2b":
        assert c.num_layers == 35 and len(c.kv_sharing) == 20 and c.kv_layer_ids[-1] == 14
