"""The interface every architecture implements, as the runner and the CUDA-graph runner see it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from services.engine.attention import AttentionBatch, TailBatch
from services.engine.config import ModelConfig
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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError
