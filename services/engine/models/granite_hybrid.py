"""Granite-4.0-H (``GraniteMoeHybridForCausalLM``, dense or MoE): Mamba2 layers beside attention layers.

Each layer is ``h = h + m * mixer(norm1(h)); h = h + m * ffn(norm2(h))`` with ``m`` the residual
multiplier, where the mixer is either Llama-style attention over the paged KV cache (scores scaled
by the attention multiplier, RoPE only when ``position_embedding_type`` is ``rope``) or a Mamba2
mixer (``mamba2.py``) over the request's fixed-size state. Embeddings are multiplied by the
embedding multiplier, logits divided by ``logits_scaling``. ``ffn`` is the shared MLP
(``shared_mlp.input_linear`` = gate and up, ``output_linear`` = down), plus, in the MoE form
(Granite-4.0-H-Tiny, -Small), the routed experts of ``block_sparse_moe`` (``moe.GraniteMoE``).

State layers own no KV: ``kv_views[layer]`` is ``()`` for them, and ``forward`` takes the step's
``StateBatch`` (each chunk's state slot) and the engine's ``StatePool``. Prefix caching is off for
this model (``KVCacheManager``: a hit would need the state at the end of the prefix, which is not
snapshotted). Decode steps may be captured in CUDA graphs (their state slots in the graph's static input;
not with the expert loop: ``supports_cuda_graphs``), prefill steps run eagerly (a chunk's scan needs its
length on the host). Under TP the attention layers and the shared MLP shard as
Llama's, each Mamba2 mixer holds its heads (``Mamba2Mixer``), the routed experts a slice of their width. The
state moves with the KV between engines of any TP sizes (``services/kv/plan/state_runs.py`` maps the heads).
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine import ops
from services.engine.attention import AttentionBatch, TailBatch
from services.engine.kv_cache.state_pool import StateBatch, StatePool
from services.engine.model_config.hf import ModelConfig
from services.engine.models.base import DecoderModel, LayerShapeTable
from services.engine.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    copy_weight,
    load_attention_projection,
    load_mlp_projection,
    param,
)
from services.engine.models.llama import MLP, Attention
from services.engine.models.mamba2 import Mamba2Mixer
from services.engine.models.moe import GraniteMoE
from services.engine.parallel import ParallelConfig, all_reduce


class GraniteDecoderLayer(nn.Module):
    """Norms, one mixer (``self_attn`` or ``mamba``, the other None), the shared MLP and the routed
    experts (``block_sparse_moe``; None in the dense form)."""

    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        if layer_id in config.state_layer_ids:
            self.mamba = Mamba2Mixer(config.granite.mamba, h, config.rms_norm_eps, dtype, device, parallel)
            self.self_attn = None
        else:
            self.mamba = None
            self.self_attn = Attention(config, layer_id, parallel, dtype, device)
            self.self_attn.scale = config.attention_scale  # Granite's attention multiplier
        self.mlp = MLP(config, parallel, dtype, device)
        experts = config.granite.experts
        self.block_sparse_moe = GraniteMoE(h, experts, dtype, device, parallel) if experts is not None else None
        self.parallel = parallel

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared MLP's output, plus the routed experts' (added in transformers' order)."""
        shared = self.mlp(x)  # all-reduced by the MLP
        if self.block_sparse_moe is None:
            return shared
        return all_reduce(self.block_sparse_moe(x), self.parallel) + shared


class GraniteHybridForCausalLM(LayerShapeTable, DecoderModel):
    """The whole decoder plus LM head over a paged KV cache (attention layers) and a state pool (Mamba2)."""

    LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        if config.granite is None:
            raise ValueError(f"a {config.architecture} config has no Granite spec: not a Granite-4.0-H config")
        parallel.check_model(config)
        self.config = config
        self.parallel = parallel
        self.spec = config.granite
        self.embed_tokens = param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(GraniteDecoderLayer(config, i, parallel, dtype, device)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (None if config.tie_word_embeddings
                        else param(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.rope = (RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings, device)
                     if self.spec.use_rope else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_views: list[tuple[torch.Tensor, ...]], layer_groups: list[int],
                tail: TailBatch | None = None, *, states: StateBatch | None = None,
                state_pool: StatePool | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm. ``states``/``state_pool``: each chunk's
        state row and the rows themselves (the model runner passes them for every step)."""
        if states is None or state_pool is None:
            raise ValueError("a Granite-4.0-H step needs its chunks' state slots and the state pool")
        if batch.host_lens is not None:
            query_lens = list(batch.host_lens[0])
        elif batch.max_query_len == 1:  # a decode step, possibly captured in a CUDA graph
            query_lens = None
        else:
            raise ValueError("a Granite-4.0-H prefill step needs its chunk lengths on the host")
        m = self.spec.residual_multiplier
        residual = self.embed_tokens[input_ids] * self.config.embed_scale
        rope = self.rope(positions) if self.rope is not None else None
        out = None
        for i, layer in enumerate(self.layers):
            if out is None:
                x = layer.input_layernorm(residual)
            else:
                x, residual = layer.input_layernorm(out * m, residual)
            if layer.mamba is not None:
                out = layer.mamba(x, query_lens, states, state_pool.conv[i], state_pool.ssm[i])
            else:
                out = layer.self_attn(x, rope, kv_views[i], batch, layer_groups[i])
            x, residual = layer.post_attention_layernorm(out * m, residual)
            out = layer.feed_forward(x)
        return self.norm(residual) if out is None else self.norm(out * m, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return (ops.linear(hidden, head) / self.spec.logits_scaling).float()

    # ---- weight loading ------------------------------------------------------------------------
    def _layer_shapes(self, layer_id: int) -> dict[str, tuple[int, ...]]:
        """HF name (after ``model.layers.N.``) -> full shape, for every tensor of one layer."""
        c, h = self.config, self.config.hidden_size
        layer = self.layers[layer_id]
        shapes: dict[str, tuple[int, ...]] = {f"{norm}.weight": (h,) for norm in self.LAYER_NORMS}
        shapes["shared_mlp.input_linear.weight"] = (2 * c.intermediate_size, h)
        shapes["shared_mlp.output_linear.weight"] = (h, c.intermediate_size)
        if layer.block_sparse_moe is not None:
            shapes.update({f"block_sparse_moe.{k}": v for k, v in layer.block_sparse_moe.hf_shapes().items()})
        if layer.mamba is not None:
            shapes.update({f"mamba.{k}": v for k, v in layer.mamba.hf_shapes().items()})
            return shapes
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for proj, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            shapes[f"self_attn.{proj}.weight"] = (rows, cols)
            if c.attention_bias:
                shapes[f"self_attn.{proj}.bias"] = (rows,)
        return shapes

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            return super()._load_one(name, tensor)
        _, _, layer_id, rest = name.split(".", 3)
        layer = self.layers[int(layer_id)]
        module, _, tail = rest.partition(".")
        if module in self.LAYER_NORMS:
            return copy_weight(name, getattr(layer, module).weight, tensor)
        if module == "mamba":
            return layer.mamba.load(name, tail, tensor)
        if module == "block_sparse_moe":
            return layer.block_sparse_moe.load(name, tail, tensor)
        if module == "shared_mlp":
            if not tail.startswith("input_linear"):
                return load_mlp_projection(name, layer.mlp, "down_proj", "weight", tensor, self.parallel)
            gate, up = tensor.chunk(2, dim=0)
            load_mlp_projection(name, layer.mlp, "gate_proj", "weight", gate, self.parallel)
            return load_mlp_projection(name, layer.mlp, "up_proj", "weight", up, self.parallel)
        proj, kind = tail.split(".")
        c = self.config
        return load_attention_projection(name, layer.self_attn, proj, kind, tensor, self.parallel, c.num_kv_heads,
                                         c.head_dim)
