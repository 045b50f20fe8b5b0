"""Gemma-4 (text, dense) decoder: Gemma-3's layers plus per-layer inputs, KV sharing and a
per-layer output scalar, over a paged KV cache.

What Gemma-4 adds to ``gemma.py`` (the attention, MLP and norms there already read it from
``ModelConfig``):

* norms scale by ``weight`` itself (no ``1 +``); values get a weightless RMSNorm; scores are not
  scaled (``attention_scale`` 1.0: q and k are normed per head);
* full-attention layers are wider (``global_head_dim``), may have fewer KV heads, and with
  ``attention_k_eq_v`` use their raw keys as values (no ``v_proj``); their rope is
  ``proportional`` (only the first quarter of each half is rotated);
* per-layer inputs (PLE): every token gets, for every layer, a small vector made of a lookup in
  its own table and a projection of the token's embedding::

      ple[t, l] = (norm(W_proj @ emb[t] / sqrt(hidden))[l] + table[id_t][l] * sqrt(P)) / sqrt(2)

  which each layer gates in after its MLP: ``h += norm(W_up @ (gelu(W_gate @ h) * ple[:, l]))``;
* each layer's output is multiplied by a loaded scalar (``layer_scalar``);
* the last ``num_kv_shared_layers`` layers compute no K/V: each attends over the cache of the
  last earlier layer of its kind (``LayerSpec.kv_source``), and the KV-shared layers' MLPs may be
  double-wide.

The prefill skip (``forward``'s ``tail``) is why the KV-shared layers matter beyond memory: see
``Gemma4ForCausalLM.forward``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.engine import ops
from services.engine.attention import AttentionBatch, Rope, TailBatch
from services.engine.model_config.hf import ModelConfig
from services.engine.models.gemma import GemmaDecoderLayer, GemmaForCausalLM
from services.engine.models.layers import Linear, OffsetRMSNorm, check_activation, copy_weight, param
from services.engine.parallel import ParallelConfig


class Gemma4DecoderLayer(GemmaDecoderLayer):
    """A Gemma-3 style layer, then the per-layer-input block, then ``* layer_scalar``."""

    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(config, layer_id, parallel, dtype, device)
        self.layer_scalar = param(1, dtype=dtype, device=device)
        p = config.hidden_size_per_layer_input
        if p:  # replicated on every TP rank: small, and it needs the whole hidden state
            h = config.hidden_size
            self.per_layer_input_gate = Linear(h, p, False, dtype, device)
            self.per_layer_projection = Linear(p, h, False, dtype, device)
            self.post_per_layer_input_norm = OffsetRMSNorm(h, config.rms_norm_eps, config.norm_weight_offset,
                                                           dtype, device)
            self.activation = check_activation(config.hidden_activation)

    def forward(self, h: torch.Tensor, rope: Rope, kv: tuple[torch.Tensor, torch.Tensor],
                batch: AttentionBatch, group: int, per_layer_input: torch.Tensor | None = None) -> torch.Tensor:
        h = super().forward(h, rope, kv, batch, group)
        if per_layer_input is not None:
            gated = ops.act_and_mul(self.activation, self.per_layer_input_gate(h), per_layer_input)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar


class Gemma4ForCausalLM(GemmaForCausalLM):
    """Gemma-4 text decoder plus LM head.

    ``prefill_skip`` (default on) lets ``forward`` honour ``tail``; the runner passes ``tail`` only
    when its ``kv_shared_prefill_skip`` is on too, so either switch turns the skip off.
    """

    layer_class = Gemma4DecoderLayer

    def __init__(self, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device, prefill_skip: bool = True) -> None:
        super().__init__(config, parallel, dtype, device)
        self.prefill_skip = prefill_skip
        # From this layer on every layer is KV-shared (Gemma-4's sharing is always such a suffix).
        self.first_kv_shared_layer = config.num_layers - config.num_kv_shared_layers
        p, n = config.hidden_size_per_layer_input, config.num_layers
        if p:
            self.embed_tokens_per_layer = param(config.vocab_size_per_layer_input, n * p, dtype=dtype, device=device)
            self.register_buffer("per_layer_embed_scale", torch.tensor(p**0.5, dtype=dtype, device=device),
                                 persistent=False)
            self.per_layer_model_projection = Linear(config.hidden_size, n * p, False, dtype, device)
            self.per_layer_projection_norm = OffsetRMSNorm(p, config.rms_norm_eps, config.norm_weight_offset,
                                                           dtype, device)

    @property
    def skips_to_tail(self) -> bool:
        return self.prefill_skip and self.config.num_kv_shared_layers > 0

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[num_tokens, num_layers, P]: the token's own per-layer vector plus a projection of its embedding."""
        c = self.config
        shape = (input_ids.shape[0], c.num_layers, c.hidden_size_per_layer_input)
        looked_up = (self.embed_tokens_per_layer[input_ids] * self.per_layer_embed_scale).view(shape)
        projected = self.per_layer_model_projection(embeds) * c.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + looked_up) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_views: list[tuple[torch.Tensor, torch.Tensor]], layer_groups: list[int],
                tail: TailBatch | None = None) -> torch.Tensor:
        """Final-norm hidden states: of every token, or -- with ``tail`` -- of ``tail.rows`` only.

        The prefill skip: at the first KV-shared layer, keep only the rows whose output is read
        (``tail.rows``: the last token of each sampling chunk, all tokens of a chunk returning
        logits, none of a mid-prefill chunk) and attend with ``tail.batch``, the same contexts
        with those shorter queries. This changes no result, because from that layer on no layer
        writes KV: a token's hidden state past that point feeds only its own later layers and its
        own logits. Nothing another token (now or in a later step) reads is computed from a
        dropped row -- the later tokens read K/V, and every K/V was written by the layers before
        the first KV-shared one, which ran over all rows. So a 4K-token prompt runs its last
        ``num_kv_shared_layers`` layers (20 of 35 in E2B) for one row instead of 4096. When no row
        needs output (``tail.batch`` is None) the result is an empty [0, hidden] tensor.
        """
        h = self.embed_tokens[input_ids] * self.embed_scale
        ple = self._per_layer_inputs(input_ids, h) if self.config.hidden_size_per_layer_input else None
        ropes = [Rope(*angles(positions)) for angles in self.ropes]
        for i, layer in enumerate(self.layers):
            if tail is not None and i == self.first_kv_shared_layer:
                if tail.batch is None:
                    return h.new_empty((0, h.shape[-1]))
                rows = tail.rows
                h, batch = h[rows], tail.batch
                ple = None if ple is None else ple[rows]
                ropes = [Rope(rope.cos[rows], rope.sin[rows]) for rope in ropes]
            h = layer(h, ropes[self.rope_of_layer[i]], kv_views[i], batch, layer_groups[i],
                      None if ple is None else ple[:, i])
        return self.norm(h)

    # ---- weight loading ------------------------------------------------------------------------
    def _expected_names(self) -> Iterator[str]:
        yield from super()._expected_names()
        c = self.config
        for i in range(c.num_layers):
            yield f"model.layers.{i}.layer_scalar"
        if c.hidden_size_per_layer_input:
            yield from ("model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
                        "model.per_layer_projection_norm.weight")
            for i in range(c.num_layers):
                p = f"model.layers.{i}."
                yield from (p + "per_layer_input_gate.weight", p + "per_layer_projection.weight",
                            p + "post_per_layer_input_norm.weight")

    def _hf_shape(self, name: str) -> tuple[int, ...]:
        c = self.config
        h, p, n = c.hidden_size, c.hidden_size_per_layer_input, c.num_layers
        shapes = {
            "model.embed_tokens_per_layer.weight": (c.vocab_size_per_layer_input, n * p),
            "model.per_layer_model_projection.weight": (n * p, h),
            "model.per_layer_projection_norm.weight": (p,),
        }
        if name in shapes:
            return shapes[name]
        last = name.split(".")[3] if name.startswith("model.layers.") else None
        layer_shapes = {"layer_scalar": (1,), "per_layer_input_gate": (p, h), "per_layer_projection": (h, p),
                        "post_per_layer_input_norm": (h,)}
        if last in layer_shapes:
            return layer_shapes[last]
        return super()._hf_shape(name)

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name == "model.embed_tokens_per_layer.weight":
            return copy_weight(name, self.embed_tokens_per_layer, tensor)
        if name == "model.per_layer_model_projection.weight":
            return copy_weight(name, self.per_layer_model_projection.weight, tensor)
        if name == "model.per_layer_projection_norm.weight":
            return copy_weight(name, self.per_layer_projection_norm.weight, tensor)
        parts = name.split(".")
        if parts[1] == "layers" and parts[3] in ("layer_scalar", "per_layer_input_gate", "per_layer_projection",
                                                 "post_per_layer_input_norm"):
            layer = self.layers[int(parts[2])]
            if parts[3] == "layer_scalar":
                return copy_weight(name, layer.layer_scalar, tensor)
            return copy_weight(name, getattr(layer, parts[3]).weight, tensor)
        return super()._load_one(name, tensor)
