"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Projections run on the flattened tokens of the whole step; only attention needs the
per-request structure (see ``attention/``). q/k/v and gate/up are fused into one matmul each
at load time. Tensor parallelism shards heads and MLP columns; the row-parallel outputs are
all-reduced.

Each residual add is fused into the norm that reads its result (``services.engine.ops``): the
layer loop carries the residual stream and the last sublayer's output separately, and
``norm(out, residual)`` returns both the normed input of the next sublayer and the new stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from services.engine import ops
from services.engine.attention import AttentionBatch, Rope, TailBatch, paged_attention
from services.engine.kv_cache.buffers import LayerKV
from services.engine.model_config.hf import ModelConfig
from services.engine.models.base import DecoderModel
from services.engine.models.fp8_linear import Fp8Target
from services.engine.models.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    attention_fp8_targets,
    gated_mlp,
    mlp_fp8_targets,
    param,
)
from services.engine.parallel import ParallelConfig, all_reduce


class Attention(nn.Module):
    """Llama's attention: fused q/k/v, optional q/k norms and biases; ``sinks`` (gpt-oss) a learned logit per
    local head, float32, that joins each row's softmax with a zero value."""

    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device, sinks: bool = False) -> None:
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
        self.sinks = param(self.num_heads, dtype=torch.float32, device=device) if sinks else None

    def forward(self, x: torch.Tensor, rope: Rope, kv: LayerKV, batch: AttentionBatch, group: int) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = paged_attention(q, k, v, kv[0], kv[1], batch, batch.groups[group], self.scale, rope=rope,
                              kv_scale=kv.scales, rounding_scale=kv.fp8_scales, sinks=self.sinks)
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
        return all_reduce(gated_mlp("silu", x, self.gate_up_proj, self.down_proj), self.parallel)


class DecoderLayer(nn.Module):
    """Attention then the feed-forward block ``mlp`` (a dense ``MLP``, or a family's sparse block), each after its
    norm (``norm`` makes one)."""

    def __init__(self, norm: Callable[[], nn.Module], self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = norm()
        self.mlp = mlp


class LlamaForCausalLM(DecoderModel):
    """The whole decoder plus LM head. ``kv_views[layer]`` is that layer's (K, V) cache view."""

    LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        parallel.check_divides(config.num_heads, config.num_kv_heads, config.intermediate_size)
        self.config = config
        self.parallel = parallel
        self.embed_tokens = param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)

        def norm() -> nn.Module:
            return self._norm(config, dtype, device)

        self.layers = nn.ModuleList(DecoderLayer(norm, self._attention(config, i, parallel, dtype, device),
                                                 self._feed_forward(config, i, parallel, dtype, device))
                                    for i in range(config.num_layers))
        self.norm = norm()
        self.lm_head = (
            None if config.tie_word_embeddings
            else param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        self.rope = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings, device)

    def _feed_forward(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                      device: torch.device) -> nn.Module:
        """Layer ``layer_id``'s feed-forward block: the dense MLP (a family with sparse layers overrides this)."""
        return MLP(config, parallel, dtype, device)

    def _attention(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
        """Layer ``layer_id``'s attention (a family with attention sinks overrides this)."""
        return Attention(config, layer_id, parallel, dtype, device)

    def _norm(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """One RMSNorm of the hidden width: Llama's, which casts before its weight (a family that scales in
        float32 first overrides this)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_views: list[tuple[torch.Tensor, torch.Tensor]], layer_groups: list[int],
                tail: TailBatch | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm (every layer owns KV: no tail skip).

        The same math as ``h = h + attn(norm1(h)); h = h + mlp(norm2(h))`` per layer, with each add
        done by the next norm's kernel: ``residual`` is the stream, ``out`` the sublayer output not
        yet added to it.
        """
        residual = self.embed_tokens[input_ids]
        rope = self.rope(positions)
        out = None
        for i, layer in enumerate(self.layers):
            if out is None:
                x = layer.input_layernorm(residual)
            else:
                x, residual = layer.input_layernorm(out, residual)
            out = layer.self_attn(x, rope, kv_views[i], batch, layer_groups[i])
            x, residual = layer.post_attention_layernorm(out, residual)
            out = layer.mlp(x)
        return self.norm(residual) if out is None else self.norm(out, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return ops.linear(hidden, head).float()

    def fp8_targets(self) -> list[Fp8Target]:
        """Every layer's fused q/k/v, o, fused gate/up and down projections."""
        out = []
        for i, layer in enumerate(self.layers):
            spec = self.config.layers[i]
            out += attention_fp8_targets(f"layers.{i}.self_attn", f"model.layers.{i}.self_attn", layer.self_attn,
                                         self.parallel, spec.num_kv_heads, spec.head_dim)
            out += self._feed_forward_fp8_targets(i)
        return out

    def _feed_forward_fp8_targets(self, layer_id: int) -> list[Fp8Target]:
        """Layer ``layer_id``'s fused gate/up and down projections (a family's sparse block overrides this)."""
        return mlp_fp8_targets(f"layers.{layer_id}.mlp", f"model.layers.{layer_id}.mlp", self.layers[layer_id].mlp,
                               self.parallel)
