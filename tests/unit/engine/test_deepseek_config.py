"""Reading DeepSeek-V3 config.json: MLA and MoE fields, YaRN as transformers computes it, the presets, refusals.

The configs are what transformers 5.23 writes (``rope_parameters``) and the hub's older form
(``rope_scaling`` with ``type: yarn`` beside ``rope_theta``); the rope frequencies, cos/sin scale and
softmax scale are compared with transformers' own numbers, not with constants copied from it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.kv_cache.buffers import kv_cache_groups
from services.engine.llm_engine import LLMEngine
from services.engine.model_config.hf import PRESETS, ModelConfig
from services.engine.models import build_model
from services.engine.models.layers import rope_inv_freq
from services.engine.parallel import ParallelConfig
from services.kv.spec.groups import AttentionKind

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0,
        "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, n_group=2,
             topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
             qk_nope_head_dim=24, v_head_dim=20, max_position_embeddings=163840, routed_scaling_factor=2.5)


def _transformers_config(**overrides):
    import transformers

    return transformers.DeepseekV3Config(**{**SHAPE, "rope_parameters": dict(YARN), **overrides})


def _saved(**overrides) -> dict:
    """The config.json transformers writes for these fields."""
    return _transformers_config(**overrides).to_dict()


def test_transformers_config_reads_into_mla_and_moe_fields() -> None:
    c = ModelConfig.from_hf_dict(_saved())
    assert c.architecture == "deepseek_v3" and c.num_layers == 3 and c.num_heads == 4
    m, moe = c.mla, c.moe
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (48, 32, 24, 16, 20)
    assert m.rope_interleave and m.row_width == 48
    assert (moe.n_routed_experts, moe.n_shared_experts, moe.moe_intermediate_size, moe.num_experts_per_tok,
            moe.n_group, moe.topk_group, moe.first_k_dense_replace) == (8, 2, 32, 3, 2, 1, 1)
    assert moe.norm_topk_prob and moe.routed_scaling_factor == 2.5
    # The cache: one "KV head" as wide as the latent row, on every layer; one MLA group of it.
    assert (c.num_kv_heads, c.head_dim) == (1, 48)
    assert all(layer.attention is AttentionKind.MLA and layer.head_dim == 48 for layer in c.layers)
    (group,) = kv_cache_groups(c, 16, ParallelConfig())
    assert (group.kind, group.layer_ids, group.num_kv_heads, group.head_dim) == (AttentionKind.MLA, (0, 1, 2), 1, 48)
    assert group.num_kv_planes == 1


def test_yarn_frequencies_and_scales_are_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    for mscale_all_dim in (0.707, 1.0):  # equal mscales (cos/sin scale 1), then not
        hf = _transformers_config(rope_parameters={**YARN, "mscale_all_dim": mscale_all_dim})
        c = ModelConfig.from_hf_dict(hf.to_dict())
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        assert torch.equal(rope_inv_freq(c.mla.qk_rope_head_dim, c.rope), inv_freq)
        assert c.rope.cos_sin_scale == pytest.approx(attention_factor, rel=1e-12)
        assert c.attention_scale == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)
    assert c.rope.cos_sin_scale != 1.0 and c.attention_scale != (24 + 16) ** -0.5


def test_hub_form_reads_like_the_saved_form() -> None:
    """DeepSeek-V3's hub config.json: rope_theta + rope_scaling (type), its router named, no rope_interleave."""
    hub = {k: v for k, v in _saved().items() if k not in ("rope_parameters", "rope_interleave")}
    scaling = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
    hub.update(rope_theta=10000.0, rope_scaling={"type": "yarn", **scaling}, topk_method="noaux_tc",
               scoring_func="sigmoid", num_nextn_predict_layers=1)
    assert ModelConfig.from_hf_dict(hub) == ModelConfig.from_hf_dict(_saved())


@pytest.mark.parametrize(("change", "field"), [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"rope_parameters": {**YARN, "beta_fast": "fast"}}, "beta_fast"),
])
def test_refusals_name_the_field(change: dict, field: str) -> None:
    d = {**_saved(), **change}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(d)


def test_missing_q_lora_rank_is_refused_but_null_means_no_bottleneck() -> None:
    d = _saved(q_lora_rank=None)
    assert ModelConfig.from_hf_dict(d).mla.q_lora_rank is None
    del d["q_lora_rank"]
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelConfig.from_hf_dict(d)


def test_yarn_is_refused_where_attention_would_ignore_its_scaling() -> None:
    llama = dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, rms_norm_eps=1e-6, max_position_embeddings=512,
                 rope_parameters=copy.deepcopy(YARN))
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict(llama)


def test_a_tp_size_that_cannot_shard_the_model_is_refused_by_name() -> None:
    config = PRESETS["deepseek-v3-tiny"]
    with pytest.raises(ValueError, match="tensor-parallel size .* attention heads"):
        build_model(config, ParallelConfig(tp_size=config.num_heads + 1, tp_rank=0), torch.float32,
                    torch.device("cpu"))
    model = build_model(config, ParallelConfig(tp_size=2, tp_rank=1), torch.float32, torch.device("cpu"))
    assert model.layers[0].self_attn.num_heads == config.num_heads // 2  # each rank: half the query heads


def test_v2_lite_preset_has_the_real_shapes() -> None:
    c = PRESETS["deepseek-v2-lite"]
    assert (c.num_layers, c.hidden_size, c.num_heads, c.vocab_size, c.intermediate_size) == (27, 2048, 16, 102400,
                                                                                               10944)
    m, moe = c.mla, c.moe
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (None, 512, 128,
                                                                                                     64, 128)
    assert (moe.n_routed_experts, moe.moe_intermediate_size, moe.n_shared_experts, moe.num_experts_per_tok,
            moe.first_k_dense_replace) == (64, 1408, 2, 6, 1)
    assert c.head_dim == 576 and c.rope.rope_type == "yarn" and c.rope.factor == 40.0
    assert 15.6e9 < c.num_parameters < 15.8e9  # DeepSeek-V2-Lite: 15.7B in all


def test_tiny_preset_generates_the_same_with_and_without_chunking() -> None:
    prompt = list(range(100, 137))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = []
    for budget in (8, 256):
        engine = LLMEngine(EngineConfig(model="dummy:deepseek-v3-tiny", device="cpu", dtype="float32", block_size=4,
                                        num_kv_blocks=32, max_num_batched_tokens=budget))
        tokens.append(engine.generate([prompt], params)[0].token_ids)
    assert len(tokens[0]) == 10 and tokens[0] == tokens[1]


def test_loader_skips_multi_token_prediction_layers_and_refuses_strays() -> None:
    """Hub checkpoints hold a layer past the last one (MTP, ``num_nextn_predict_layers``): skipped, as
    transformers does; an unknown tensor of a real layer is still an error naming it."""
    from services.engine.loading.weights import dummy_weights

    model = build_model(PRESETS["deepseek-v3-tiny"], ParallelConfig(), torch.float32, torch.device("cpu"))
    weights = list(dummy_weights(model))
    mtp = ("model.layers.4.self_attn.kv_b_proj.weight", torch.zeros(3, 3))
    model.load_weights([*weights, mtp])
    stray = ("model.layers.1.mlp.experts.8.up_proj.weight", torch.zeros(32, 64))  # only experts 0..7 exist
    with pytest.raises(ValueError, match="experts.8"):
        model.load_weights([*weights, stray])
