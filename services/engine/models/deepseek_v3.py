"""DeepSeek-V3 decoder (multi-head latent attention, mixture of experts) over a paged cache of latent rows.

Attention (MLA, shapes in ``MLASpec``), per token ``x``::

    q        = q_b_proj(norm(q_a_proj(x)))  (or q_proj(x))   -> per head [q_nope | q_rope]
    c, k_pe  = kv_a_proj_with_mqa(x) split                     c: kv_lora_rank, k_pe: qk_rope_head_dim
    row      = [norm(c) | rope(k_pe)]                          the one thing cached per token and layer
    k_h, v_h = [W_UK_h c | rope(k_pe)], W_UV_h c               (kv_b_proj = [W_UK; W_UV] per head)

A step whose requests all decode one token attends in the absorbed form (the query folded into the
latent space, the latent rows attended to directly); any other step expands the gathered rows into
per-head keys and values (``attention/mla.py`` has both). ``mla_form`` forces one of them.

The rope part is rotated in pairs ``(x0, x1), (x2, x3) ...`` in DeepSeek checkpoints
(``rope_interleave``); the loader reorders those projection rows evens-then-odds, after which the
engine's rotate-half RoPE computes exactly that rotation, and the cached key holds the same values
as transformers' cache. YaRN scales cos and sin (``RopeSpec.cos_sin_scale``) and, through
``ModelConfig.attention_scale``, the softmax.

Feed-forward: the first ``first_k_dense_replace`` layers are dense, the others mixtures of experts
(``moe.py``).

Tensor parallelism: each rank holds ``num_heads / tp`` query heads (their rows of ``q_proj``/``q_b_proj``
and ``kv_b_proj``, their columns of ``o_proj``) and ``1 / tp`` of every MLP's and expert's width; the latent
projection and the cached row are the same on every rank (the row is replicated: ``AttentionKind.MLA``), and
the router is replicated. Attention's and the feed-forward's outputs are partial sums, all-reduced once each.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine import ops
from services.engine.attention import AttentionBatch, MLABackend, Rope, TailBatch, write_rows
from services.engine.kv_cache.buffers import LayerKV
from services.engine.model_config.hf import ModelConfig
from services.engine.models.base import DecoderModel, LayerShapeTable
from services.engine.models.fp8_linear import Fp8Part, Fp8Target, row_range
from services.engine.models.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    copy_weight,
    mlp_fp8_targets,
    param,
    row_parallel_bias,
)
from services.engine.models.moe import DeepseekMoE, GatedMLP
from services.engine.parallel import ParallelConfig, all_reduce

MLA_FORMS = ("auto", "absorbed", "expanded")
# transformers builds the q/kv latent norms with RMSNorm's default epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """One layer's latent attention: projections, the cached row, and both attention forms."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        m = config.mla
        self.spec = m
        self.parallel = parallel
        self.num_heads = config.num_heads // parallel.tp_size  # this rank's query heads
        self.scale = config.attention_scale
        h, n, bias = config.hidden_size, self.num_heads, config.attention_bias
        q_out = n * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(h, q_out, False, dtype, device)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(h, m.q_lora_rank, bias, dtype, device)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = Linear(m.q_lora_rank, q_out, False, dtype, device)
        self.kv_a_proj_with_mqa = Linear(h, m.row_width, bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, dtype, device)
        self.kv_b_proj = Linear(m.kv_lora_rank, n * (m.qk_nope_head_dim + m.v_head_dim), False, dtype, device)
        self.o_proj = Linear(n * m.v_head_dim, h, config.o_proj_bias, dtype, device)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj viewed as (W_UK [heads, qk_nope_head_dim, latent], W_UV [heads, v_head_dim, latent])."""
        m = self.spec
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [..., row width] -> per-head keys [..., heads, qk_head_dim], values [..., heads, v_head_dim]."""
        m = self.spec
        latent, k_rope = rows.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(*latent.shape[:-1], self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, values = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_rope = k_rope.unsqueeze(-2).expand(*k_nope.shape[:-1], m.qk_rope_head_dim)
        return torch.cat((k_nope, k_rope), dim=-1), values

    def forward(self, x: torch.Tensor, rope: Rope, kv: LayerKV, batch: AttentionBatch, group: int,
                absorbed: bool) -> torch.Tensor:
        m, n, t = self.spec, self.num_heads, x.shape[0]
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, n, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        q_rope, k_rope = ops.apply_rope(q_rope, k_rope.view(t, 1, m.qk_rope_head_dim), rope.cos, rope.sin,
                                        rope.positions)
        rows = torch.cat((self.kv_a_layernorm(latent), k_rope.view(t, m.qk_rope_head_dim)), dim=-1)
        meta = batch.groups[group]
        rows_cache, row_scale = kv[0], kv.scales[0]  # one latent row per token: the layer's k_scale for all of it
        backend: MLABackend = meta.backend
        if batch.kv_rounding is not None:  # a request for an FP8 reader: rows as an FP8 cache gives them back
            rows = batch.kv_rounding.apply(rows, kv.fp8_scales[0])
        write_rows(rows, rows_cache, meta, row_scale)
        if absorbed:
            w_uk, w_uv = self._up_projections()
            q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)
            out = backend.forward_absorbed(torch.cat((q_latent, q_rope), dim=-1), rows_cache, m.kv_lora_rank, batch,
                                           meta, self.scale, row_scale)
            out = torch.einsum("thl,hvl->thv", out.view(t, n, m.kv_lora_rank), w_uv)
        else:
            out = backend.forward_expanded(torch.cat((q_nope, q_rope), dim=-1), rows_cache, batch, meta, self.scale,
                                           self.expand, row_scale)
        return all_reduce(self.o_proj(out.reshape(t, n * m.v_head_dim)), self.parallel)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.self_attn = MLAttention(config, dtype, device, parallel)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        moe = config.moe
        self.mlp = (DeepseekMoE(h, moe, dtype, device, parallel) if moe.is_moe_layer(layer_id)
                    else GatedMLP(h, config.intermediate_size, dtype, device, parallel))


class DeepseekV3ForCausalLM(LayerShapeTable, DecoderModel):
    """The whole decoder plus LM head. ``kv_views[layer]`` is that layer's ``(rows,)`` latent cache view.

    ``mla_form``: ``auto`` (absorbed for decode-only steps, expanded otherwise), or one form for
    every step (both give the same result; the tests compare them).
    """

    LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        if config.mla is None or config.moe is None:
            raise ValueError(f"a {config.architecture} config has no MLA/MoE spec: not a DeepSeek-V3 config")
        parallel.check_model(config)
        self.config = config
        self.parallel = parallel
        self.mla_form = "auto"
        self._shapes: dict[int, dict[str, tuple[int, ...]]] = {}
        self.embed_tokens = param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i, dtype, device, parallel)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (None if config.tie_word_embeddings
                        else param(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.rope = RotaryEmbedding(config.mla.qk_rope_head_dim, config.rope, config.max_position_embeddings, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_views: list[tuple[torch.Tensor, ...]], layer_groups: list[int],
                tail: TailBatch | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm (every layer owns KV: no tail skip)."""
        if self.mla_form not in MLA_FORMS:
            raise ValueError(f"mla_form must be one of {', '.join(MLA_FORMS)}, got {self.mla_form!r}")
        absorbed = self.mla_form == "absorbed" or (self.mla_form == "auto" and batch.max_query_len == 1)
        residual = self.embed_tokens[input_ids]
        rope = self.rope(positions)
        out = None
        for i, layer in enumerate(self.layers):
            if out is None:
                x = layer.input_layernorm(residual)
            else:
                x, residual = layer.input_layernorm(out, residual)
            out = layer.self_attn(x, rope, kv_views[i], batch, layer_groups[i], absorbed)
            x, residual = layer.post_attention_layernorm(out, residual)
            out = all_reduce(layer.mlp(x), self.parallel)
        return self.norm(residual) if out is None else self.norm(out, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return ops.linear(hidden, head).float()

    # ---- weight loading ------------------------------------------------------------------------
    def _ignored(self, name: str) -> bool:
        """Also the multi-token-prediction layers past the last decoder layer (``num_nextn_predict_layers``)."""
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= self.config.num_layers:
            return True
        return super()._ignored(name)

    def _layer_shapes(self, layer_id: int) -> dict[str, tuple[int, ...]]:
        """HF name (after ``model.layers.N.``) -> full shape, for every tensor of one layer (computed once:
        a MoE layer has hundreds)."""
        if layer_id not in self._shapes:
            self._shapes[layer_id] = self._compute_layer_shapes(layer_id)
        return self._shapes[layer_id]

    def _compute_layer_shapes(self, layer_id: int) -> dict[str, tuple[int, ...]]:
        c, m = self.config, self.config.mla
        h, n = c.hidden_size, c.num_heads
        q_out, v_out = n * m.qk_head_dim, n * m.v_head_dim
        shapes: dict[str, tuple[int, ...]] = {f"{norm}.weight": (h,) for norm in self.LAYER_NORMS}
        attn = {"kv_a_proj_with_mqa.weight": (m.row_width, h), "kv_a_layernorm.weight": (m.kv_lora_rank,),
                "kv_b_proj.weight": (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                "o_proj.weight": (h, v_out)}
        if m.q_lora_rank is None:
            attn["q_proj.weight"] = (q_out, h)
        else:
            attn.update({"q_a_proj.weight": (m.q_lora_rank, h), "q_a_layernorm.weight": (m.q_lora_rank,),
                         "q_b_proj.weight": (q_out, m.q_lora_rank)})
        if c.attention_bias:
            attn.update({"kv_a_proj_with_mqa.bias": (m.row_width,), "o_proj.bias": (h,)})
            if m.q_lora_rank is not None:
                attn["q_a_proj.bias"] = (m.q_lora_rank,)
        shapes.update({f"self_attn.{k}": v for k, v in attn.items()})
        if not c.moe.is_moe_layer(layer_id):
            shapes.update(_mlp_shapes("mlp", h, c.intermediate_size))
            return shapes
        moe = c.moe
        shapes.update({"mlp.gate.weight": (moe.n_routed_experts, h),
                       "mlp.gate.e_score_correction_bias": (moe.n_routed_experts,)})
        for e in range(moe.n_routed_experts):
            shapes.update(_mlp_shapes(f"mlp.experts.{e}", h, moe.moe_intermediate_size))
        if moe.n_shared_experts:
            shapes.update(_mlp_shapes("mlp.shared_experts", h, moe.n_shared_experts * moe.moe_intermediate_size))
        return shapes

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            return super()._load_one(name, tensor)
        parts = name.split(".")
        layer = self.layers[int(parts[2])]
        module = parts[3]
        if module in self.LAYER_NORMS:
            return copy_weight(name, getattr(layer, module).weight, tensor)
        if module == "mlp":
            if isinstance(layer.mlp, GatedMLP):
                return layer.mlp.load(name, parts[4], tensor)
            return layer.mlp.load(name, parts[4:], tensor)
        proj, kind = parts[4], parts[5]
        attn = layer.self_attn
        if proj in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa"):
            tensor = self._rope_rows_halved(proj, tensor)
        if proj in ("q_proj", "q_b_proj", "kv_b_proj"):  # rows per head: this rank's heads
            tensor = self.parallel.shard(tensor, 0)
        elif proj == "o_proj":  # columns per head, and the bias added once over the ranks
            tensor = self.parallel.shard(tensor, 1) if kind == "weight" else row_parallel_bias(tensor, self.parallel)
        return copy_weight(name, getattr(getattr(attn, proj), kind), tensor)

    def _rope_rows_halved(self, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` with the output rows that make rope dims reordered from interleaved pairs to
        evens-then-odds (no change without ``rope_interleave``), so rotate-half RoPE rotates each pair."""
        order = self._rope_order(proj)
        return tensor if order is None else tensor[order.to(tensor.device)]

    def _rope_order(self, proj: str) -> torch.Tensor | None:
        """The HF rows of ``proj`` in the order the model holds them (None: as stored; see ``_rope_rows_halved``)."""
        m = self.config.mla
        if not m.rope_interleave:
            return None
        r = m.qk_rope_head_dim
        halves = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))
        if proj == "kv_a_proj_with_mqa":  # rows: latent, then the rope key
            return torch.cat((torch.arange(m.kv_lora_rank), m.kv_lora_rank + halves))
        # rows per head: the unrotated part, then the rope part
        per_head = torch.cat((torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + halves))
        return (torch.arange(self.config.num_heads)[:, None] * m.qk_head_dim + per_head).flatten()

    def fp8_targets(self) -> list[Fp8Target]:
        """Every layer's q (or q_a/q_b), kv_a and o projections, its dense MLP or shared experts. kv_b is read as
        matrices in the absorbed form: it stays dequantized. The routed experts are ``fp8_experts``."""
        tp, out = self.parallel, []
        for i, layer in enumerate(self.layers):
            path, hf, attn = f"layers.{i}.self_attn", f"model.layers.{i}.self_attn", layer.self_attn
            for proj in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"):
                linear = getattr(attn, proj)
                if linear is None:
                    continue
                full = linear.weight.shape[0] * (tp.tp_size if proj in ("q_proj", "q_b_proj") else 1)
                order = self._rope_order(proj) if proj != "q_a_proj" else None
                rows = torch.arange(full) if order is None else order
                if proj in ("q_proj", "q_b_proj"):
                    rows = tp.shard(rows, 0)
                out.append(Fp8Target(f"{path}.{proj}", (Fp8Part(f"{hf}.{proj}", rows),)))
            o_rows = row_range(0, attn.o_proj.weight.shape[0])
            out.append(Fp8Target(f"{path}.o_proj", (Fp8Part(f"{hf}.o_proj", o_rows),), True, (tp.tp_rank, tp.tp_size)))
            mlp = layer.mlp
            if isinstance(mlp, GatedMLP):
                out += mlp_fp8_targets(f"layers.{i}.mlp", f"model.layers.{i}.mlp", mlp, tp)
            elif mlp.shared_experts is not None:
                out += mlp_fp8_targets(f"layers.{i}.mlp.shared_experts", f"model.layers.{i}.mlp.shared_experts",
                                       mlp.shared_experts, tp)
        return out

    def fp8_experts(self) -> list[tuple[str, str]]:
        """Every MoE layer's routed experts (stored by name: ``mlp.experts.<e>.gate_proj``)."""
        return [(f"layers.{i}.mlp.experts", f"model.layers.{i}.mlp.experts") for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, DeepseekMoE)]


def _mlp_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (intermediate, hidden), f"{prefix}.up_proj.weight": (intermediate, hidden),
            f"{prefix}.down_proj.weight": (hidden, intermediate)}
