"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Projections run on the flattened tokens of the whole step; only attention needs the
per-request structure (see ``attention.py``). q/k/v and gate/up are fused into one matmul each
at load time. Tensor parallelism shards heads and MLP columns; the row-parallel outputs are
all-reduced.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from services.engine.attention import AttentionBatch, TailBatch, paged_attention
from services.engine.config import ModelConfig
from services.engine.models.base import DecoderModel
from services.engine.models.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    copy_weight,
    load_attention_projection,
    load_mlp_projection,
    param,
)
from services.engine.parallel import ParallelConfig, all_reduce


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.parallel = parallel
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // parallel.tp_size
        self.num_kv_heads = parallel.num_local_kv_heads(config.num_kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        h = config.hidden_size
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, config.attention_bias, dtype, device)
        self.o_proj = Linear(self.q_size, h, config.o_proj_bias, dtype, device)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch, group: int) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        out = paged_attention(q, k, v, kv[0], kv[1], batch, batch.groups[group], self.scale)
        return all_reduce(self.o_proj(out), self.parallel)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.parallel = parallel
        inter = config.intermediate_size // parallel.tp_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, config.mlp_bias, dtype, device)
        self.down_proj = Linear(inter, config.hidden_size, config.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return all_reduce(self.down_proj(nn.functional.silu(gate) * up), self.parallel)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, layer_id, parallel, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, parallel, dtype, device)


class LlamaForCausalLM(DecoderModel):
    """The whole decoder plus LM head. ``kv_views[layer]`` is that layer's (K, V) cache view."""

    def __init__(self, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        parallel.check_divides(config.num_heads, config.num_kv_heads, config.intermediate_size)
        self.config = config
        self.parallel = parallel
        self.embed_tokens = param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, parallel, dtype, device) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (
            None if config.tie_word_embeddings
            else param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        self.rope = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_views: list[tuple[torch.Tensor, torch.Tensor]], layer_groups: list[int],
                tail: TailBatch | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm (every layer owns KV: no tail skip)."""
        h = self.embed_tokens[input_ids]
        for i, layer in enumerate(self.layers):
            h = h + layer.self_attn(layer.input_layernorm(h), positions, self.rope, kv_views[i], batch, layer_groups[i])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return nn.functional.linear(hidden, head).float()

    # ---- weight loading ------------------------------------------------------------------------
    def _expected_names(self) -> Iterator[str]:
        c = self.config
        yield "model.embed_tokens.weight"
        yield "model.norm.weight"
        if not c.tie_word_embeddings:
            yield "lm_head.weight"
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            yield from (p + "input_layernorm.weight", p + "post_attention_layernorm.weight")
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                yield p + f"self_attn.{proj}.weight"
            if c.attention_bias:
                yield from (p + f"self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj"))
            if c.o_proj_bias:
                yield p + "self_attn.o_proj.bias"
            if c.qk_norm:
                yield from (p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield p + f"mlp.{proj}.weight"
                if c.mlp_bias:
                    yield p + f"mlp.{proj}.bias"

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        c, tp = self.config, self.parallel
        if name == "model.embed_tokens.weight":
            return copy_weight(name, self.embed_tokens, tensor)
        if name == "lm_head.weight":
            return copy_weight(name, self.lm_head, tensor)
        if name == "model.norm.weight":
            return copy_weight(name, self.norm.weight, tensor)
        parts = name.split(".")
        layer = self.layers[int(parts[2])]
        module = parts[3]
        if module in ("input_layernorm", "post_attention_layernorm"):
            return copy_weight(name, getattr(layer, module).weight, tensor)
        proj, kind = parts[4], parts[5]
        if module == "self_attn":
            attn = layer.self_attn
            if proj in ("q_norm", "k_norm"):
                return copy_weight(name, getattr(attn, proj).weight, tensor)
            return load_attention_projection(name, attn, proj, kind, tensor, tp, c.num_kv_heads, c.head_dim)
        return load_mlp_projection(name, layer.mlp, proj, kind, tensor, tp)


