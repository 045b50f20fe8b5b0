"""Tensor-parallel sharding arithmetic: which heads and weight rows a TP rank owns.

Query heads split evenly across ranks. KV heads split evenly when ``tp_size <= num_kv_heads``;
otherwise each KV head is replicated on ``tp_size // num_kv_heads`` consecutive ranks::

    num_kv_heads=2, tp_size=4:  rank 0,1 -> kv head 0    rank 2,3 -> kv head 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from services.engine.model_config.hf import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"invalid tensor-parallel rank {self.tp_rank} of {self.tp_size}")

    def check_divides(self, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
        """Refuse a TP size that cannot shard these shapes; the error names every one that fails."""
        tp = self.tp_size
        problems = []
        if num_kv_heads % tp and tp % num_kv_heads:
            problems.append(f"{num_kv_heads} KV heads over {tp} ranks (neither divides the other)")
        if num_heads % tp:
            problems.append(f"{num_heads} attention heads over {tp} ranks")
        if intermediate_size % tp:
            problems.append(f"MLP width {intermediate_size} over {tp} ranks")
        if problems:
            raise ValueError(f"tensor-parallel size {tp} cannot shard this model: {'; '.join(problems)}")

    def check_model(self, config: ModelConfig) -> None:
        """Refuse, before any rank starts, a TP size that cannot shard every layer of the model."""
        for i, spec in enumerate(config.layers):
            self.check_divides(config.num_heads, spec.num_kv_heads, config.layer_intermediate_size(i))
        experts = config.moe or config.qwen3_moe
        if experts is not None and experts.moe_intermediate_size % self.tp_size:
            raise ValueError(f"tensor-parallel size {self.tp_size} cannot shard this model: expert width "
                             f"{experts.moe_intermediate_size} over {self.tp_size} ranks")
        if config.granite is not None:
            config.granite.mamba.for_rank(self.tp_size, self.tp_rank)  # heads and groups must split
            experts = config.granite.experts
            if experts is not None and experts.intermediate_size % self.tp_size:
                raise ValueError(f"tensor-parallel size {self.tp_size} cannot shard this model: expert width "
                                 f"{experts.intermediate_size} over {self.tp_size} ranks")

    def num_local_kv_heads(self, num_kv_heads: int) -> int:
        return max(1, num_kv_heads // self.tp_size)

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """[start, end) of the global KV heads this rank holds."""
        if self.tp_size <= num_kv_heads:
            n = num_kv_heads // self.tp_size
            return self.tp_rank * n, (self.tp_rank + 1) * n
        head = self.tp_rank * num_kv_heads // self.tp_size
        return head, head + 1

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's even slice of ``tensor`` along ``dim``."""
        if self.tp_size == 1:
            return tensor
        size = tensor.shape[dim] // self.tp_size
        return tensor.narrow(dim, self.tp_rank * size, size)


def all_reduce(x: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """Sum partial results across TP ranks (no-op without TP)."""
    if parallel.tp_size > 1:
        import torch.distributed  # here, not at the top: the config types are read without torch

        torch.distributed.all_reduce(x)
    return x
