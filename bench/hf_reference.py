"""Hugging Face transformers on the engine's own dummy weights: the reference ``bench/engine.py`` divides by.

The model is built from the same ``ModelConfig`` preset and every tensor gets the value the engine's
dummy loader gives the tensor of that name (``weights.dummy_tensor``), so both run the same network
on the same device and dtype. The Llama family (Llama-3.1-8B is the benchmark shape) and Qwen3-MoE map here;
transformers 5 keeps a Qwen3-MoE layer's experts as two stacked tensors (``mlp.experts.gate_up_proj``: every
expert's gate rows then its up rows; ``mlp.experts.down_proj``), filled from the checkpoint names the engine's
loader uses (``mlp.experts.<e>.gate_proj.weight`` ...), and runs them by its default experts implementation
(``grouped_mm`` where torch has it), which ``hf_model`` prints.

Prefill: one forward over ``tokens`` prompt tokens (logits of the last position only, as a server
needs). Decode: one forward of one token per sequence over a KV cache of ``context`` tokens per
sequence, filled with random values (a step's cost depends on shapes only), with HF's default SDPA
attention; that is what ``generate`` runs per token, without its Python sampling loop.
"""

from __future__ import annotations

import time

import torch

from services.engine.loading.weights import dummy_tensor
from services.engine.model_config.hf import ModelConfig


def _rope(mc: ModelConfig) -> dict:
    rope = {"rope_type": mc.rope.rope_type, "rope_theta": mc.rope.theta}
    if mc.rope.rope_type == "llama3":
        rope.update(factor=mc.rope.factor, low_freq_factor=mc.rope.low_freq_factor,
                    high_freq_factor=mc.rope.high_freq_factor,
                    original_max_position_embeddings=mc.rope.original_max_position_embeddings)
    if mc.rope.rope_type == "yarn":
        rope.update(factor=mc.rope.factor, beta_fast=mc.rope.beta_fast, beta_slow=mc.rope.beta_slow,
                    truncate=mc.rope.truncate,
                    original_max_position_embeddings=mc.rope.original_max_position_embeddings)
    return rope


def _hf_config(mc: ModelConfig):
    """(config, model class) of transformers for a Llama, Qwen3-MoE or gpt-oss preset."""
    import transformers

    common = dict(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps, max_position_embeddings=mc.max_position_embeddings,
        tie_word_embeddings=mc.tie_word_embeddings, attention_bias=mc.attention_bias, rope_parameters=_rope(mc),
    )
    if mc.architecture == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if mc.architecture == "qwen3_moe":
        spec = mc.qwen3_moe
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=spec.norm_topk_prob,
            decoder_sparse_step=spec.decoder_sparse_step, mlp_only_layers=list(spec.mlp_only_layers),
        )
        return config, transformers.Qwen3MoeForCausalLM
    if mc.architecture == "gpt_oss":  # its checkpoint names are the engine's dense ones: dummy_tensor fills them
        spec = mc.gpt_oss
        types = ["sliding_attention" if layer.sliding_window else "full_attention" for layer in mc.layers]
        config = transformers.GptOssConfig(
            **common, num_local_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
            swiglu_limit=spec.swiglu_limit, sliding_window=mc.sliding_window, layer_types=types,
        )
        return config, transformers.GptOssForCausalLM
    raise ValueError(f"the HF reference maps Llama, Qwen3-MoE and gpt-oss presets only, not {mc.architecture!r}")


def _stacked_experts(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int):
    """transformers 5's stacked expert tensor ``<layer>.mlp.experts.gate_up_proj`` / ``down_proj`` from the
    per-expert checkpoint tensors the engine's dummy loader makes; None for any other name."""
    prefix, _, kind = name.rpartition(".")
    if not prefix.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj") or len(shape) != 3:
        return None
    out = torch.empty(shape, dtype=dtype, device=device)
    for e in range(shape[0]):
        if kind == "gate_up_proj":  # [gate; up] rows, as transformers' chunk(2) reads them
            half = shape[1] // 2
            out[e, :half] = dummy_tensor(f"{prefix}.{e}.gate_proj.weight", (half, shape[2]), dtype, device, seed)
            out[e, half:] = dummy_tensor(f"{prefix}.{e}.up_proj.weight", (half, shape[2]), dtype, device, seed)
        else:
            out[e] = dummy_tensor(f"{prefix}.{e}.down_proj.weight", tuple(shape[1:]), dtype, device, seed)
    return out


def hf_model(mc: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A transformers ``LlamaForCausalLM`` / ``Qwen3MoeForCausalLM`` with the engine's dummy weights for ``mc``."""
    import transformers

    config, model_class = _hf_config(mc)
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not (mc.tie_word_embeddings and name == "lm_head.weight"):
                value = _stacked_experts(name, tuple(param.shape), dtype, device, seed)
                param.copy_(value if value is not None else dummy_tensor(name, tuple(param.shape), dtype, device, seed))
    experts = getattr(model.config, "_experts_implementation", None)
    print(f"# HF reference: transformers {transformers.__version__} {model_class.__name__}, attention "
          f"{model.config._attn_implementation}" + (f", experts {experts}" if mc.architecture != "llama" else ""),
          flush=True)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_prefill_s(model, tokens: int, rounds: int = 2) -> float:
    """Best-of-``rounds`` seconds for one prompt of ``tokens`` tokens (one warm-up first)."""
    device = model.device
    ids = torch.randint(100, 30000, (1, tokens), device=device)
    best = float("inf")
    for r in range(rounds + 1):
        _sync(device)
        t = time.perf_counter()
        model(input_ids=ids, logits_to_keep=1, use_cache=False)
        _sync(device)
        if r:
            best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def hf_decode_step_s(model, batch: int, context: int, steps: int = 16) -> float:
    """Seconds per decode step of ``batch`` sequences at ``context`` tokens of (random) KV each."""
    from transformers import DynamicCache

    cfg, device = model.config, model.device
    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=cfg)
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype),
                     layer)
    ids = torch.randint(100, 30000, (batch, 1), device=device)
    for i in range(3 + steps):
        if i == 3:
            _sync(device)
            t = time.perf_counter()
        position = torch.full((batch, 1), context + i, device=device)
        out = model(input_ids=ids, position_ids=position, past_key_values=cache, use_cache=True, logits_to_keep=1)
        ids = out.logits[:, -1:].argmax(-1)
    _sync(device)
    return (time.perf_counter() - t) / steps
