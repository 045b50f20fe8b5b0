"""The interface every architecture implements, as the runner and the CUDA-graph runner see it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from services.engine.attention import AttentionBatch, TailBatch
from services.engine.config import ModelConfig
from services.engine.models.layers import projection_shape
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

    @property
    def skips_to_tail(self) -> bool:
        """Whether ``forward`` honours ``tail`` (only rows whose output is needed past the last KV layer)."""
        return False

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
        expected = set(self._expected_names())
        seen: set[str] = set()
        for name, tensor in weights:
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
        raise NotImplementedError

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        raise NotImplementedError
