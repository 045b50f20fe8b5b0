"""Gemma-2 and Gemma-3 (text) decoders over a paged KV cache; the layers Gemma-4 builds on.

What differs from Llama, all driven by ``ModelConfig`` (so one module serves both families):

* token embeddings are scaled by ``sqrt(hidden_size)`` (in the weights' dtype, as the reference);
* RMSNorm scales by ``1 + weight`` (``norm_weight_offset``), computed in fp32 and cast once;
* "sandwich" norms: the attention and the MLP outputs are normed before their residual add, and
  the MLP has its own input norm::

      h = h + post_attention_norm(attn(input_norm(h)))
      h = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))

* the MLP gate is tanh-GELU; scores are scaled by ``query_pre_attn_scalar ** -0.5``;
* Gemma-2 soft-caps attention scores and the final logits (``cap * tanh(x / cap)``);
* Gemma-3 norms q and k per head before RoPE, and its sliding and full layers have different
  ropes (one ``RopeAngles`` per distinct (head dim, rope) pair, computed once per step).

Each residual add is fused into the norm that reads its result (``services.engine.ops``): the
add after the attention block into ``pre_feedforward_layernorm``, and (Gemma-2/3) the add after
the MLP block into the next layer's ``input_layernorm`` (``GemmaDecoderLayer.sublayers``).

Layers alternate sliding-window and full attention; each kind is its own KV-cache group and the
runner hands every layer its group's metadata, so the attention code is the same for both.
Per-layer head dims, KV heads and KV sharing (Gemma-4) are read from ``config.layers`` here
already. q/k/v and gate/up are fused at load time; tensor parallelism shards heads and MLP
columns as in ``llama.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine import ops
from services.engine.attention import AttentionBatch, Rope, TailBatch, paged_attention
from services.engine.kv_cache.buffers import LayerKV
from services.engine.model_config.hf import ModelConfig
from services.engine.models.base import DecoderModel
from services.engine.models.layers import (
    Linear,
    OffsetRMSNorm,
    RopeAngles,
    check_activation,
    gated_mlp,
    param,
    softcap,
)
from services.engine.parallel import ParallelConfig, all_reduce


class GemmaAttention(nn.Module):
    """One layer's attention. A KV-shared layer (``kv_source`` set) projects only q and attends
    over its source layer's cache; a k=v layer projects keys once and uses the raw keys as values."""

    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        spec = config.layers[layer_id]
        self.parallel = parallel
        self.head_dim = spec.head_dim
        self.num_heads = config.num_heads // parallel.tp_size
        self.num_kv_heads = parallel.num_local_kv_heads(spec.num_kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.computes_kv = spec.kv_source is None
        self.k_is_v = self.computes_kv and config.layer_k_is_v(layer_id)
        num_kv_outputs = 0 if not self.computes_kv else 1 if self.k_is_v else 2
        self.scale = config.attention_scale if config.attention_scale is not None else self.head_dim**-0.5
        self.softcap = config.attn_logit_softcapping
        h, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_weight_offset
        self.qkv_proj = Linear(h, self.q_size + num_kv_outputs * self.kv_size, config.attention_bias, dtype, device)
        self.o_proj = Linear(self.q_size, h, config.o_proj_bias, dtype, device)
        self.q_norm = OffsetRMSNorm(self.head_dim, eps, offset, dtype, device) if config.qk_norm else None
        self.k_norm = (OffsetRMSNorm(self.head_dim, eps, offset, dtype, device)
                       if config.qk_norm and self.computes_kv else None)
        self.v_norm = (OffsetRMSNorm(self.head_dim, eps, 0.0, dtype, device, with_weight=False)
                       if config.v_norm and self.computes_kv else None)

    def forward(self, x: torch.Tensor, rope: Rope, kv: LayerKV, batch: AttentionBatch, group: int) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim)
        k = v = None
        if self.computes_kv:
            k = qkv[:, self.q_size: self.q_size + self.kv_size].view(n, self.num_kv_heads, self.head_dim)
            v = k if self.k_is_v else qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
            if self.k_norm is not None:
                k = self.k_norm(k)
            if self.v_norm is not None:
                v = self.v_norm(v)
        if self.q_norm is not None:
            q = self.q_norm(q)
        out = paged_attention(q, k, v, kv[0], kv[1], batch, batch.groups[group], self.scale, self.softcap, rope,
                              kv_scale=kv.scales, rounding_scale=kv.fp8_scales)
        return all_reduce(self.o_proj(out), self.parallel)


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.parallel = parallel
        inter = config.layer_intermediate_size(layer_id) // parallel.tp_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, config.mlp_bias, dtype, device)
        self.down_proj = Linear(inter, config.hidden_size, config.mlp_bias, dtype, device)
        self.activation = check_activation(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(gated_mlp(self.activation, x, self.gate_up_proj, self.down_proj), self.parallel)


class GemmaDecoderLayer(nn.Module):
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        for name in self.NORMS:
            setattr(self, name, OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset,
                                              dtype, device))
        self.self_attn = GemmaAttention(config, layer_id, parallel, dtype, device)
        self.mlp = GemmaMLP(config, layer_id, parallel, dtype, device)

    def forward(self, h: torch.Tensor, rope: Rope, kv: tuple[torch.Tensor, torch.Tensor],
                batch: AttentionBatch, group: int) -> torch.Tensor:
        """``h = h + post_attn_norm(attn(input_norm(h))); h + post_ff_norm(mlp(pre_ff_norm(h)))``."""
        h, out = self.sublayers(h, None, rope, kv, batch, group)
        return h + out

    def sublayers(self, residual: torch.Tensor, pending: torch.Tensor | None, rope: Rope,
                  kv: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch, group: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the stream ``residual + pending`` (``pending``: the previous layer's last
        output, not yet added; None: nothing pending). Returns the stream after the attention block
        and the MLP block's output, not yet added to it: each add is done by the next norm's kernel."""
        if pending is None:
            x = self.input_layernorm(residual)
        else:
            x, residual = self.input_layernorm(pending, residual)
        attn = self.post_attention_layernorm(self.self_attn(x, rope, kv, batch, group))
        x, residual = self.pre_feedforward_layernorm(attn, residual)
        return residual, self.post_feedforward_layernorm(self.mlp(x))


class GemmaForCausalLM(DecoderModel):
    """Gemma-2 / Gemma-3 text decoder plus LM head. ``kv_views[layer]`` is that layer's (K, V) view."""

    layer_class: type[GemmaDecoderLayer] = GemmaDecoderLayer
    LAYER_NORMS = GemmaDecoderLayer.NORMS

    def __init__(self, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        for i, spec in enumerate(config.layers):
            parallel.check_divides(config.num_heads, spec.num_kv_heads, config.layer_intermediate_size(i))
        self.config = config
        self.parallel = parallel
        self.embed_tokens = param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # The reference multiplies by the scale cast to the weights' dtype (sqrt(2304) is 48.0 in bf16).
        self.register_buffer("embed_scale", torch.tensor(config.embed_scale, dtype=dtype, device=device),
                             persistent=False)
        self.layers = nn.ModuleList(self.layer_class(config, i, parallel, dtype, device)
                                    for i in range(config.num_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset, dtype, device)
        self.lm_head = (
            None if config.tie_word_embeddings
            else param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        keys = [(spec.head_dim, spec.rope) for spec in config.layers]
        distinct = list(dict.fromkeys(keys))
        self.ropes = nn.ModuleList(RopeAngles(dim, rope, device) for dim, rope in distinct)
        self.rope_of_layer = [distinct.index(key) for key in keys]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_views: list[tuple[torch.Tensor, torch.Tensor]], layer_groups: list[int],
                tail: TailBatch | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm (every layer owns KV: no tail skip)."""
        h = self.embed_tokens[input_ids] * self.embed_scale
        ropes = [Rope(*angles(positions)) for angles in self.ropes]
        pending = None  # the last layer's MLP output, added to h by the next norm
        for i, layer in enumerate(self.layers):
            h, pending = layer.sublayers(h, pending, ropes[self.rope_of_layer[i]], kv_views[i], batch,
                                         layer_groups[i])
        return self.norm(h) if pending is None else self.norm(pending, h)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return softcap(ops.linear(hidden, head).float(), self.config.final_logit_softcapping)

    # ---- weight loading ------------------------------------------------------------------------
    def _ignored(self, name: str) -> bool:
        """Also the K/V projections and norms of KV-shared layers (they compute no KV), as transformers."""
        if super()._ignored(name):
            return True
        parts = name.split(".")
        if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn" and parts[2].isdigit():
            layer = int(parts[2])
            if layer < self.config.num_layers and self.config.layers[layer].kv_source is not None:
                return parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")
        return False

    def _attention_projections(self, layer_id: int) -> tuple[str, ...]:
        """A KV-shared layer stores only q; a layer whose K is its V (Gemma-4's attention_k_eq_v) no v."""
        attn = self.layers[layer_id].self_attn
        if not attn.computes_kv:
            return ("q_proj",)
        return ("q_proj", "k_proj") if attn.k_is_v else ("q_proj", "k_proj", "v_proj")
