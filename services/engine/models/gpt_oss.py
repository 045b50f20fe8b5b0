"""gpt-oss (gpt-oss-20b, gpt-oss-120b): Llama's decoder with attention sinks and a mixture of experts in every layer.

What differs from ``llama.py``:

* attention has biases on q/k/v/o and a learned sink logit per head (``Attention(sinks=True)``: every backend adds
  it to each row's softmax denominator); sliding (128) and full layers alternate, as two KV-cache groups;
* RMSNorm scales in float32 before the cast (``OffsetRMSNorm`` with offset 0), as transformers' ``GptOssRMSNorm``;
* the feed-forward block (``GptOssMoE``) routes with a biased router -- the top k logits, softmaxed among
  themselves -- to experts with biases and a clamped SwiGLU (``clamped_swiglu``).

Checkpoints store the experts stacked and transposed (``mlp.experts.gate_up_proj`` [E, H, 2I] with gate and up
interleaved column by column, ``down_proj`` [E, I, H], and their biases); ``GptOssExperts.load`` de-interleaves them
into ``RoutedExperts``' layout (gate rows, then up rows), so the expert loop (CPU) and the grouped GEMMs (CUDA) are
DeepSeek's and Qwen3-MoE's. An MXFP4 checkpoint's experts reach the model dequantized (``loading.quant.mxfp4``).
Under TP every rank routes every token and holds ``1 / tp_size`` of each expert's width and of the heads (their
sinks with them); the block's output is all-reduced once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch import nn

from services.engine.model_config.gpt_oss import GptOssSpec
from services.engine.model_config.hf import ModelConfig
from services.engine.models.fp8_linear import Fp8Target
from services.engine.models.layers import OffsetRMSNorm, copy_weight, param, row_parallel_bias
from services.engine.models.llama import Attention, LlamaForCausalLM
from services.engine.models.moe import RoutedExperts
from services.engine.ops.moe_fused import ExpertOrder, RouterSpec, route
from services.engine.ops.mxfp4_format import GROUP
from services.engine.ops.mxfp4_moe import mxfp4_grouped_mm
from services.engine.parallel import ParallelConfig, all_reduce


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of [rows, 2I] (gate, then up): ``(up + 1) * g * sigmoid(alpha * g)``, ``g`` the gate
    capped at ``limit`` and ``up`` clamped to ``[-limit, limit]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssRouter(nn.Module):
    """Each token's ``num_experts_per_tok`` highest logits (``W h + b``), softmaxed among themselves in the model's
    dtype, as transformers' ``GptOssTopKRouter``."""

    def __init__(self, hidden: int, spec: GptOssSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.top_k = spec.num_experts_per_tok
        self.weight = param(spec.num_experts, hidden, dtype=dtype, device=device)
        self.bias = param(spec.num_experts, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] in x's dtype, expert ids [tokens, k])."""
        top, experts = nn.functional.linear(x, self.weight, self.bias).topk(self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), experts

    def route(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor, ExpertOrder | None]:
        """``forward``'s (weights, ids) and, ``fused``, their order by expert (``ops.moe_fused.route``)."""
        if not fused:
            return (*self(x), None)
        return route(nn.functional.linear(x, self.weight, self.bias), RouterSpec(self.top_k, "logits"), None, x.dtype)


class GptOssExperts(RoutedExperts):
    """``RoutedExperts`` with biases and the clamped SwiGLU; loads transformers' stacked, interleaved tensors.

    ``mxfp4``: the projections stay as the checkpoint stores them (``gate_up_blocks`` [E, 2I, H / 2] and
    ``gate_up_scales`` [E, 2I, H / 32] uint8, rows gate then up; ``down_blocks`` [E, H, I / 2], ``down_scales``
    [E, H, I / 32]) and every step's grouped GEMMs read them (``ops.mxfp4_moe``): a quarter of the bytes of bf16
    experts, which gpt-oss-120b needs to fit one GPU."""

    def __init__(self, spec: GptOssSpec, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device, mxfp4: bool = False) -> None:
        super().__init__(spec.num_experts, hidden, intermediate, dtype, device, path="grouped" if mxfp4 else None,
                         bias=True, weights=not mxfp4)
        self.alpha = spec.swiglu_alpha
        self.limit = spec.swiglu_limit
        self.mxfp4 = mxfp4
        if mxfp4:
            e, u8 = spec.num_experts, torch.uint8
            self.gate_up_blocks = param(e, 2 * intermediate, hidden // 2, dtype=u8, device=device)
            self.gate_up_scales = param(e, 2 * intermediate, hidden // GROUP, dtype=u8, device=device)
            self.down_blocks = param(e, hidden, intermediate // 2, dtype=u8, device=device)
            self.down_scales = param(e, hidden, intermediate // GROUP, dtype=u8, device=device)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.alpha, self.limit)

    def project(self, proj: str, x: torch.Tensor, rows: torch.Tensor | None, ends: torch.Tensor,
                by_expert: torch.Tensor) -> torch.Tensor:
        if not self.mxfp4:
            return super().project(proj, x, rows, ends, by_expert)
        return mxfp4_grouped_mm(x, rows, getattr(self, f"{proj}_blocks"), getattr(self, f"{proj}_scales"),
                                getattr(self, f"{proj}_bias"), ends)

    def load_mxfp4(self, name: str, proj: str, part: str, tensor: torch.Tensor, parallel: ParallelConfig) -> None:
        """This rank's part of ``<proj>_blocks`` [E, out, in / 32, 16] or ``<proj>_scales`` [E, out, in / 32]:
        gate_up's interleaved rows (this rank's of each half), down's groups of 32 input columns."""
        dest = getattr(self, f"{proj.removesuffix('_proj')}_{part}")
        if proj == "down_proj":
            return copy_weight(name, dest, parallel.shard(tensor, 2).reshape(dest.shape))
        gate, up = parallel.shard(tensor[:, 0::2], 1), parallel.shard(tensor[:, 1::2], 1)
        return copy_weight(name, dest, torch.cat((gate, up), 1).reshape(dest.shape))

    def load_stacked(self, name: str, tail: str, tensor: torch.Tensor, parallel: ParallelConfig) -> None:
        if tail.endswith(("_blocks", "_scales")):
            proj, _, part = tail.rpartition("_")
            return self.load_mxfp4(name, proj, part, tensor, parallel)
        return self._load_dense(name, tail, tensor, parallel)

    def _load_dense(self, name: str, tail: str, tensor: torch.Tensor, parallel: ParallelConfig) -> None:
        """Copy this rank's part of ``mlp.experts.<tail>``: ``gate_up_proj`` [E, H, 2I] and its bias [E, 2I]
        (columns interleaved gate, up, gate, ...: this rank's columns of each), ``down_proj`` [E, I, H] (this
        rank's rows) and its bias [E, H] (rank 0 only: the outputs are summed over ranks)."""
        if tail == "down_proj":
            return copy_weight(name, self.down, parallel.shard(tensor.transpose(1, 2), 2))
        if tail == "down_proj_bias":
            return copy_weight(name, self.down_bias, row_parallel_bias(tensor, parallel))
        gate, up = tensor[..., ::2], tensor[..., 1::2]
        if tail == "gate_up_proj":
            gate, up = parallel.shard(gate.transpose(1, 2), 1), parallel.shard(up.transpose(1, 2), 1)
            half = self.intermediate
            copy_weight(name, self.gate_up[:, :half], gate)
            return copy_weight(name, self.gate_up[:, half:], up)
        if tail == "gate_up_proj_bias":
            return copy_weight(name, self.gate_up_bias, torch.cat((parallel.shard(gate, 1), parallel.shard(up, 1)), 1))
        raise ValueError(f"unexpected tensor {name!r}")


class GptOssMoE(nn.Module):
    """One layer's feed-forward block: the router, then the experts; the output all-reduced under TP."""

    def __init__(self, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype, device: torch.device,
                 mxfp4: bool = False) -> None:
        super().__init__()
        self.parallel = parallel
        self.router = GptOssRouter(config.hidden_size, config.gpt_oss, dtype, device)
        self.experts = GptOssExperts(config.gpt_oss, config.hidden_size, config.intermediate_size // parallel.tp_size,
                                     dtype, device, mxfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.experts(x, *self.router.route(x, self.experts.path == "fused")), self.parallel)

    def load(self, name: str, parts: list[str], tensor: torch.Tensor) -> None:
        """Copy one HF tensor named ``...mlp.<parts>`` into place."""
        if parts[0] == "router":
            return copy_weight(name, getattr(self.router, parts[1]), tensor)
        return self.experts.load_stacked(name, parts[1], tensor, self.parallel)


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's decoder with sinks in attention, float32-scaled norms and ``GptOssMoE`` in every layer;
    ``mxfp4_experts``: the experts kept in MXFP4 (``GptOssExperts``), their checkpoint tensors ``*_blocks`` and
    ``*_scales`` (``mxfp4_modules``)."""

    def __init__(self, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype, device: torch.device,
                 mxfp4_experts: bool = False) -> None:
        groups = config.intermediate_size // parallel.tp_size
        if mxfp4_experts and groups % GROUP:
            raise ValueError(f"MXFP4 experts of width {config.intermediate_size} cannot be split over "
                             f"{parallel.tp_size} ranks in whole {GROUP}-value groups")
        self.mxfp4_experts = mxfp4_experts
        super().__init__(config, parallel, dtype, device)

    def mxfp4_modules(self) -> frozenset[str]:
        """The HF modules whose MXFP4 tensors load as stored (none when the experts were dequantized)."""
        if not self.mxfp4_experts:
            return frozenset()
        return frozenset(f"model.layers.{i}.mlp.experts" for i in range(self.config.num_layers))

    def _attention(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
        return Attention(config, layer_id, parallel, dtype, device, sinks=True)

    def _norm(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
        return OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, 0.0, dtype, device)

    def _feed_forward(self, config: ModelConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype,
                      device: torch.device) -> nn.Module:
        return GptOssMoE(config, parallel, dtype, device, self.mxfp4_experts)

    def _expected_names(self) -> Iterator[str]:
        """Llama's names but the dense MLPs, then every layer's sinks, router and experts."""
        for name in super()._expected_names():
            parts = name.split(".")
            if not (len(parts) > 4 and parts[3] == "mlp"):
                yield name
        for i in range(self.config.num_layers):
            yield from (f"model.layers.{i}.{k}" for k in self._layer_shapes)

    @functools.cached_property
    def _layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name after ``model.layers.N.`` -> full shape, for what gpt-oss adds to a Llama layer."""
        c = self.config
        h, i, e = c.hidden_size, c.intermediate_size, c.gpt_oss.num_experts
        shapes = {"self_attn.sinks": (c.num_heads,), "mlp.router.weight": (e, h), "mlp.router.bias": (e,),
                  "mlp.experts.gate_up_proj": (e, h, 2 * i), "mlp.experts.gate_up_proj_bias": (e, 2 * i),
                  "mlp.experts.down_proj": (e, i, h), "mlp.experts.down_proj_bias": (e, h)}
        if self.mxfp4_experts:  # stored [E, out, in / 32, 16] and [E, out, in / 32]
            for proj, (rows, cols) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
                del shapes[f"mlp.experts.{proj}"]
                shapes[f"mlp.experts.{proj}_blocks"] = (e, rows, cols // GROUP, GROUP // 2)
                shapes[f"mlp.experts.{proj}_scales"] = (e, rows, cols // GROUP)
        return shapes

    def _hf_shape(self, name: str) -> tuple[int, ...]:
        tail = name.split(".", 3)[3] if name.startswith("model.layers.") else ""
        if tail in self._layer_shapes:
            return self._layer_shapes[tail]
        return super()._hf_shape(name)

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        parts = name.split(".")
        if len(parts) > 4 and parts[3] == "mlp":
            return self.layers[int(parts[2])].mlp.load(name, parts[4:], tensor)
        if len(parts) == 5 and parts[4] == "sinks":
            return copy_weight(name, self.layers[int(parts[2])].self_attn.sinks, self.parallel.shard(tensor, 0))
        return super()._load_one(name, tensor)

    def _feed_forward_fp8_targets(self, layer_id: int) -> list[Fp8Target]:
        """None: the experts are not FP8 projections."""
        return []
