"""Small random Hugging Face checkpoints, written with ``save_pretrained``, one per architecture."""

from __future__ import annotations

from pathlib import Path

import torch

# Shared small shape: GQA (4 query heads over 2 KV heads), 2 layers, a vocabulary small enough
# to be fast and large enough that greedy ties are rare. initializer_range is larger than HF's
# default so the logits are peaked and greedy decoding is robust to fp32 rounding.
_BASE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6,
)

ARCHITECTURES = ("llama", "llama_tied", "qwen2", "qwen3", "mistral")
# Gemma checkpoints: sliding-window layers with a 16-token window (shorter than the test prompts)
# beside full ones. Gemma-2 soft-caps scores and logits (low caps, so the tanh really bends);
# Gemma-3 has q/k norms, a different rope per layer type and a logit cap (its score cap is set but
# ignored, as transformers does); Gemma-4 has wider full-attention heads with one KV head and
# k=v, 2 KV-shared layers (one per kind) with double-wide MLPs, and per-layer inputs.
GEMMA_ARCHITECTURES = ("gemma2", "gemma3", "gemma4")
_GEMMA_BASE = dict(_BASE, head_dim=16, sliding_window=16, hidden_activation="gelu_pytorch_tanh")
# DeepSeek-V3 (multi-head latent attention): one cached row of kv_lora_rank + qk_rope_head_dim = 40 elements
# per token and layer; a low-rank query, group-limited MoE after one dense layer, YaRN rope.
_DEEPSEEK_V3 = dict(
    _BASE, num_hidden_layers=3, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, q_lora_rank=48,
    n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                     "original_max_position_embeddings": 64},
)


# Qwen3-MoE: 8 experts of 32, top-2 renormalised, the second of three layers dense (mlp_only_layers).
_QWEN3_MOE = dict(_BASE, num_hidden_layers=3, head_dim=16, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                  tie_word_embeddings=False)
# gpt-oss: sliding (16-token window) and full layers alternating, 8 experts of 64 with biases (two MXFP4 groups: TP 2
# splits them), top-2 over the chosen logits, a low SwiGLU limit so the clamps bite, YaRN without truncation; q/k/v/o
# biases and per-head sinks (the sinks, biases and norms perturbed in make_checkpoint: transformers starts them at
# zero, zero and one).
_GPT_OSS = dict(_BASE, num_hidden_layers=4, head_dim=16, intermediate_size=64, num_local_experts=8,
                num_experts_per_tok=2, sliding_window=16, swiglu_limit=1.5, tie_word_embeddings=False,
                layer_types=["sliding_attention", "full_attention"] * 2,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})


def hf_config(arch: str):
    import transformers

    if arch == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        return transformers.LlamaConfig(**_BASE, rope_scaling=rope, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "llama_tied":
        return transformers.LlamaConfig(**_BASE, tie_word_embeddings=True, attention_bias=True)
    if arch == "qwen2":
        return transformers.Qwen2Config(**_BASE, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**{**_BASE, "head_dim": 32}, tie_word_embeddings=False)
    if arch == "mistral":
        # A window shorter than the test sequences, so the windowed mask is exercised.
        return transformers.MistralConfig(**_BASE, sliding_window=24, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**_QWEN3_MOE)
    if arch == "gpt_oss":
        return transformers.GptOssConfig(**_GPT_OSS)
    if arch == "deepseek_v3":
        return transformers.DeepseekV3Config(**{k: v for k, v in _DEEPSEEK_V3.items() if k != "num_key_value_heads"})
    if arch == "gemma2":
        return transformers.Gemma2Config(
            **{**_GEMMA_BASE, "num_hidden_layers": 4}, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
            final_logit_softcapping=8.0, tie_word_embeddings=False,
        )
    if arch == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
        return transformers.Gemma3TextConfig(
            **{**_GEMMA_BASE, "num_hidden_layers": 4}, query_pre_attn_scalar=16, rope_parameters=rope,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            # transformers' Gemma-3 attention ignores attn_logit_softcapping; the final cap applies.
            attn_logit_softcapping=4.0, final_logit_softcapping=12.0, tie_word_embeddings=True,
        )
    if arch == "gemma4":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0}}
        return transformers.Gemma4TextConfig(
            **{**_GEMMA_BASE, "num_hidden_layers": 6}, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=_BASE["vocab_size"], final_logit_softcapping=10.0, rope_parameters=rope,
            tie_word_embeddings=True,
        )
    raise ValueError(arch)


def _add(std: float):
    return lambda t: t + std * torch.randn_like(t)


def _draw(std: float):
    return lambda t: std * torch.randn_like(t)


# What transformers initialises to constants, moved per family (the first suffix a name ends with wins), so that a
# tensor read wrong shows in the logits: unit norms would hide a norm read as 1 + w instead of w; a zero router
# ties every expert (the lowest ids chosen); sinks of HF's initial size barely move a softmax; zero biases, zero
# routing corrections and unit layer scalars would hide one not applied.
PERTURBATIONS = {
    "qwen3_moe": (("mlp.gate.weight", _draw(0.5)), ("norm.weight", _add(0.2))),
    "gpt_oss": (("sinks", _draw(1.5)), ("norm.weight", _add(0.2)), ("bias", _draw(0.2))),
    "deepseek_v3": (("norm.weight", _add(0.2)), ("e_score_correction_bias", _draw(0.3))),
    "gemma": (("norm.weight", _add(0.2)), ("layer_scalar", lambda t: torch.empty_like(t).uniform_(0.5, 1.5))),
}


def make_checkpoint(arch: str, directory: Path, seed: int = 0):
    """Create, save and return (directory, HF model in eval mode, fp32)."""
    import transformers

    torch.manual_seed(seed)
    gemma = arch in GEMMA_ARCHITECTURES
    # Eager attention for Gemma and gpt-oss: transformers has no SDPA path for soft-capped scores or sinks.
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch), attn_implementation="eager"
                                                          if gemma or arch == "gpt_oss" else "sdpa")
    model = model.float().eval()
    rules = PERTURBATIONS.get("gemma" if gemma else arch, ())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            rule = next((how for suffix, how in rules if name.endswith(suffix)), None)
            if rule is not None:
                tensor.copy_(rule(tensor))
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


class ColocatedReference:
    """Greedy tokens of one engine doing prefill and decode on CPU in float32, as test workers run: the reference
    a disaggregated answer must equal. One engine serves every call: ``ref(prompt, max_tokens)`` for one prompt,
    ``ref.many(prompts, max_tokens)`` for several in one batch, as the workers batch them (each row's tokens are
    those of its prompt alone, which the workers' answers must equal anyway; a batch of long outputs takes a
    fraction of the engine steps of one call per prompt)."""

    def __init__(self, model: str, num_kv_blocks: int = 256, kv_cache_dtype: str = "auto") -> None:
        from services.engine.engine_config import EngineConfig
        from services.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks,
                                             kv_cache_dtype=kv_cache_dtype))

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        return self.many([prompt], max_tokens)[0]

    def many(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from services.contract.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [out.token_ids for out in self.engine.generate(prompts, params)]


def colocated_reference(model: str, num_kv_blocks: int = 256) -> ColocatedReference:
    """Greedy tokens ``(prompt, max_tokens)`` of one engine doing prefill and decode on CPU in float32, as
    test workers run: the reference a disaggregated answer must equal. One engine serves every call."""
    return ColocatedReference(model, num_kv_blocks)


def colocated_tokens(model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One prompt's reference (``colocated_reference``) from an engine of its own."""
    return colocated_reference(model, num_kv_blocks=16)(prompt, max_tokens)
