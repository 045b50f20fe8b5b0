"""Qwen3-MoE (Qwen3-30B-A3B, -235B-A22B, Qwen3-Coder): Qwen3's attention, sparse feed-forward blocks.

The decoder is ``llama.LlamaForCausalLM`` (Qwen3's per-head q/k norms included); a sparse layer's feed-forward
block (``Qwen3MoeBlock``) softmaxes its router's logits over every expert in float32, keeps the top k
(renormalised when ``norm_topk_prob``), and runs the chosen experts through ``moe.RoutedExperts``, the experts
path DeepSeek-V3 uses (the expert loop on CPU, the fused layer of ``ops.moe_fused`` on CUDA, router included), so
both gain from its speed work. Under TP
every rank routes every token and holds ``1 / tp_size`` of each expert's width; the block's output is all-reduced
once. Dense layers (``mlp_only_layers``, off the ``decoder_sparse_step`` beat) keep Llama's MLP.

Checkpoints store every expert's projections by name (``mlp.experts.<e>.gate_proj.weight``) and the router as
``mlp.gate.weight``; an FP8 checkpoint's experts stay FP8 where ``loading.fp8_model`` keeps them (``fp8_experts``:
the grouped FP8 GEMM on CUDA), else they are dequantized at load.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch import nn

from services.engine.model_config.hf import ModelConfig
from services.engine.model_config.qwen3_moe import Qwen3MoESpec
from services.engine.models.fp8_linear import Fp8Target
from services.engine.models.layers import copy_weight, param
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.moe import RoutedExperts
from services.engine.ops.moe_fused import ExpertOrder, RouterSpec, route
from services.engine.parallel import ParallelConfig, all_reduce


class Qwen3MoeRouter(nn.Module):
    """Which ``num_experts_per_tok`` experts each token uses and with what weight (transformers' rounding: logits
    in the model's dtype, the softmax and renormalisation in float32, the weights back in the model's dtype)."""

    def __init__(self, hidden: int, spec: Qwen3MoESpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.weight = param(spec.num_experts, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] in x's dtype, expert ids [tokens, k])."""
        logits = nn.functional.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = probs.topk(self.spec.num_experts_per_tok, dim=-1)
        if self.spec.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), experts

    def route(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor, ExpertOrder | None]:
        """``forward``'s (weights, ids) and, ``fused``, their order by expert (``ops.moe_fused.route``)."""
        if not fused:
            return (*self(x), None)
        spec = RouterSpec(self.spec.num_experts_per_tok, "softmax", self.spec.norm_topk_prob)
        return route(nn.functional.linear(x, self.weight), spec, None, x.dtype)


class Qwen3MoeBlock(nn.Module):
    """A sparse layer's feed-forward block: the router, then the routed experts (no shared expert)."""

    def __init__(self, hidden: int, spec: Qwen3MoESpec, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        self.parallel = parallel
        self.gate = Qwen3MoeRouter(hidden, spec, dtype, device)
        self.experts = RoutedExperts(spec.num_experts, hidden, spec.moe_intermediate_size // parallel.tp_size, dtype,
                                     device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.experts(x, *self.gate.route(x, self.experts.path == "fused")), self.parallel)

    def load(self, name: str, parts: list[str], tensor: torch.Tensor) -> None:
        """Copy one HF tensor named ``...mlp.<parts>`` into place (the router whole, an expert's shard)."""
        if parts[0] == "gate":
            return copy_weight(name, self.gate.weight, tensor)
        return self.experts.load(name, int(parts[1]), parts[2], tensor, self.parallel)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Llama's decoder with ``Qwen3MoeBlock`` in the sparse layers."""

    def _feed_forward(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                      device: torch.device) -> nn.Module:
        if config.qwen3_moe.is_moe_layer(layer_id):
            return Qwen3MoeBlock(config.hidden_size, config.qwen3_moe, dtype, device, parallel)
        return super()._feed_forward(config, layer_id, parallel, dtype, device)

    def _sparse(self, layer_id: int) -> bool:
        return self.config.qwen3_moe.is_moe_layer(layer_id)

    def _expected_names(self) -> Iterator[str]:
        """Llama's names but a sparse layer's MLP, then every sparse layer's router and experts."""
        for name in super()._expected_names():
            parts = name.split(".")
            if not (len(parts) > 4 and parts[3] == "mlp" and self._sparse(int(parts[2]))):
                yield name
        for i in filter(self._sparse, range(self.config.num_layers)):
            yield from (f"model.layers.{i}.{k}" for k in self._sparse_shapes)

    @functools.cached_property
    def _sparse_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name after ``model.layers.N.`` -> full shape, for a sparse layer's router and experts (the same in
        every sparse layer, computed once: a real one has hundreds)."""
        h, spec = self.config.hidden_size, self.config.qwen3_moe
        i = spec.moe_intermediate_size
        shapes = {"mlp.gate.weight": (spec.num_experts, h)}
        for e in range(spec.num_experts):
            shapes.update({f"mlp.experts.{e}.gate_proj.weight": (i, h), f"mlp.experts.{e}.up_proj.weight": (i, h),
                           f"mlp.experts.{e}.down_proj.weight": (h, i)})
        return shapes

    def _hf_shape(self, name: str) -> tuple[int, ...]:
        parts = name.split(".")
        if len(parts) > 4 and parts[3] == "mlp" and self._sparse(int(parts[2])):
            return self._sparse_shapes[name.split(".", 3)[3]]
        return super()._hf_shape(name)

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        parts = name.split(".")
        if len(parts) > 4 and parts[3] == "mlp" and self._sparse(int(parts[2])):
            return self.layers[int(parts[2])].mlp.load(name, parts[4:], tensor)
        return super()._load_one(name, tensor)

    def _feed_forward_fp8_targets(self, layer_id: int) -> list[Fp8Target]:
        """The dense layers' MLPs only: the routed experts are ``fp8_experts``."""
        return [] if self._sparse(layer_id) else super()._feed_forward_fp8_targets(layer_id)

    def fp8_experts(self) -> list[tuple[str, str]]:
        """Every sparse layer's routed experts (stored by name: ``mlp.experts.<e>.gate_proj``)."""
        return [(f"layers.{i}.mlp.experts", f"model.layers.{i}.mlp.experts")
                for i in filter(self._sparse, range(self.config.num_layers))]
