"""The interface every architecture implements, as the runner and the CUDA-graph runner see it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from services.engine.attention import AttentionBatch, TailBatch
from services.engine.model_config.hf import ModelConfig
from services.engine.models.fp8_linear import Fp8Target, ScaleSlot
from services.engine.models.layers import (
    copy_weight,
    load_attention_projection,
    load_mlp_projection,
    projection_shape,
)
from services.engine.parallel import ParallelConfig


class DecoderModel(nn.Module):
    """A decoder-only LM over a paged KV cache.

    ``forward`` takes the step's flattened tokens and, per layer, the (K, V) cache views and KV
    group to use (a KV-sharing layer is handed its source layer's). It returns final-norm hidden
    states: for every token, or -- when ``tail`` is given and the model has KV-shared layers
    (``skips_to_tail``) -- only for ``tail.rows``, the tokens whose output anyone reads.
    """

    config: ModelConfig
    parallel: ParallelConfig
    LAYER_NORMS: tuple[str, ...] = ()  # per-layer norms the checkpoint stores: model.layers.N.<norm>.weight
    # FP8 scales the loader expects beside the weights (HF name ``<module>.weight_fp8_scale`` -> where they go),
    # filled by ``services.engine.loading.fp8_model`` when projections stay FP8; empty otherwise.
    fp8_scales: dict[str, tuple[ScaleSlot, tuple[int, ...]]]

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether decode steps can be captured in CUDA graphs: not when a module's forward asks the host for
        device values (it says so with ``graph_safe`` False: the expert loop); the runtime then runs every step
        eagerly."""
        return all(getattr(module, "graph_safe", True) for module in self.modules())

    @property
    def skips_to_tail(self) -> bool:
        """Whether ``forward`` honours ``tail`` (only rows whose output is needed past the last KV layer)."""
        return False

    def fp8_targets(self) -> list[Fp8Target]:
        """The projections that can run in FP8 and where their HF modules' rows go (none by default: an
        architecture without them runs an FP8 checkpoint dequantized)."""
        return []

    def fp8_experts(self) -> list[tuple[str, str]]:
        """The routed experts that can stay FP8: (the ``RoutedExperts`` module's path, the HF prefix its experts
        are stored under as ``<prefix>.<e>.gate_proj`` ...); none by default (stacked experts are dequantized)."""
        return []

    def replace_module(self, path: str, module: nn.Module) -> None:
        """Put ``module`` at ``path`` (``layers.0.mlp.down_proj``) in place of what is there."""
        parent, _, name = path.rpartition(".")
        setattr(self.get_submodule(parent) if parent else self, name, module)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_views: list[tuple[torch.Tensor, torch.Tensor]], layer_groups: list[int],
                tail: TailBatch | None = None) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ---- weight loading ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up and taking this TP rank's shard.

        Raises ValueError naming any missing or unexpected tensor or any tensor of the wrong shape;
        names ``_ignored`` says transformers drops on load are skipped.
        """
        fp8_scales = getattr(self, "fp8_scales", {})
        expected = set(self._expected_names()) | set(fp8_scales)
        seen: set[str] = set()
        for name, tensor in weights:
            if name in fp8_scales:
                slot, shape = fp8_scales[name]
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"FP8 scale {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
                slot.place(tensor)
                seen.add(name)
                continue
            if name not in expected:
                if self._ignored(name):
                    continue
                raise ValueError(f"unexpected tensor {name!r} for a {self.config.architecture} model")
            # Checked before sharding: slicing a rank's rows out of an oversized tensor would pass.
            shape = self._hf_shape(name)
            if tuple(tensor.shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
            self._load_one(name, tensor)
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing tensors: {shown}")

    def _ignored(self, name: str) -> bool:
        """Checkpoint tensors with no place in the model: a tied head stored anyway, RoPE buffers."""
        return name == "lm_head.weight" or "rotary_emb" in name

    def _hf_shape(self, name: str) -> tuple[int, ...]:
        """The full, unsharded shape the checkpoint must store ``name`` at (per-layer KV shapes)."""
        c = self.config
        h = c.hidden_size
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (c.vocab_size, h)
        if name == "model.norm.weight":
            return (h,)
        layer_id = int(name.split(".")[2])
        spec = c.layers[layer_id]
        q, kv, i = c.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, c.layer_intermediate_size(layer_id)
        proj, kind = name.split(".")[-2:]
        if proj in ("q_norm", "k_norm"):
            return (spec.head_dim,)
        if proj.endswith("norm"):
            return (h,)
        return projection_shape(proj, kind, h, q, kv, i)

    def _expected_names(self) -> Iterator[str]:
        """Every tensor the checkpoint must hold: the shared embed/norm/head, then per layer its norms
        (``LAYER_NORMS``), attention projections (``_attention_projections``) with their biases,
        the q/k norms its attention has, and the MLP."""
        c = self.config
        yield "model.embed_tokens.weight"
        yield "model.norm.weight"
        if not c.tie_word_embeddings:
            yield "lm_head.weight"
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            yield from (p + f"{norm}.weight" for norm in self.LAYER_NORMS)
            projs = self._attention_projections(i)
            yield from (p + f"self_attn.{proj}.weight" for proj in (*projs, "o_proj"))
            if c.attention_bias:
                yield from (p + f"self_attn.{proj}.bias" for proj in projs)
            if c.o_proj_bias:
                yield p + "self_attn.o_proj.bias"
            attn = layer.self_attn
            yield from (p + f"self_attn.{norm}.weight" for norm in ("q_norm", "k_norm")
                        if getattr(attn, norm) is not None)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield p + f"mlp.{proj}.weight"
                if c.mlp_bias:
                    yield p + f"mlp.{proj}.bias"

    def _attention_projections(self, layer_id: int) -> tuple[str, ...]:
        """The q/k/v projections layer ``layer_id``'s checkpoint stores (all three, unless a family's
        layer computes no KV or shares K and V)."""
        return ("q_proj", "k_proj", "v_proj")

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one expected tensor in, taking this TP rank's shard of the projections."""
        c, tp = self.config, self.parallel
        if name == "model.embed_tokens.weight":
            return copy_weight(name, self.embed_tokens, tensor)
        if name == "lm_head.weight":
            return copy_weight(name, self.lm_head, tensor)
        if name == "model.norm.weight":
            return copy_weight(name, self.norm.weight, tensor)
        parts = name.split(".")
        layer_id = int(parts[2])
        layer = self.layers[layer_id]
        module = parts[3]
        if module in self.LAYER_NORMS:
            return copy_weight(name, getattr(layer, module).weight, tensor)
        proj, kind = parts[4], parts[5]
        if module == "self_attn":
            attn = layer.self_attn
            if proj in ("q_norm", "k_norm"):
                return copy_weight(name, getattr(attn, proj).weight, tensor)
            spec = c.layers[layer_id]
            return load_attention_projection(name, attn, proj, kind, tensor, tp, spec.num_kv_heads, spec.head_dim)
        return load_mlp_projection(name, layer.mlp, proj, kind, tensor, tp)


class LayerShapeTable:
    """Weight names for a model that lists each layer's tensors with their checkpoint shapes
    (``_layer_shapes``, e.g. MoE experts or Mamba mixers beside attention): the expected names and
    shapes follow from that table plus the shared embedding, final norm and head. Mixed in before
    :class:`DecoderModel`."""

    def _layer_shapes(self, layer_id: int) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def _expected_names(self) -> Iterator[str]:
        yield "model.embed_tokens.weight"
        yield "model.norm.weight"
        if not self.config.tie_word_embeddings:
            yield "lm_head.weight"
        for i in range(self.config.num_layers):
            yield from (f"model.layers.{i}.{k}" for k in self._layer_shapes(i))

    def _hf_shape(self, name: str) -> tuple[int, ...]:
        c = self.config
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (c.vocab_size, c.hidden_size)
        if name == "model.norm.weight":
            return (c.hidden_size,)
        _, _, layer, rest = name.split(".", 3)
        return self._layer_shapes(int(layer))[rest]
