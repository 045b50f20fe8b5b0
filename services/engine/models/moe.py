"""Mixture-of-experts feed-forward blocks: DeepSeek-V3's (and its dense gated MLP) and Granite-4.0-H's; Qwen3-MoE's
block (``qwen3_moe.py``) runs its experts through the same ``RoutedExperts``.

Both blocks are ``routed(x) + shared(x)`` and differ only in the router: DeepSeek-V3's scores
experts with sigmoids, a correction bias and expert groups (see ``MoESpec``), Granite's takes the
top-k router logits and softmaxes them (``GraniteExpertsSpec``). ``RoutedExperts`` holds the
experts of either, stacked, and runs them either one at a time over the tokens that chose them, in
expert order (the CPU path: the order transformers adds them in, so float32 results agree to the
last bits wherever the matmuls do), or as grouped GEMMs over all experts at once (CUDA): the fused
layer of ``ops.moe_fused`` by default, ``torch._grouped_mm`` as the reference. On the fused path the
routers route through ``ops.moe_fused.route`` too (``route(x, fused=True)``: scores, top-k, weights and
the sort by expert in one launch), handing the experts the sorted order with the weights.

The expert loop asks the host how many tokens each expert got (``bincount(...).tolist()``), so a
step with it cannot be captured in a CUDA graph; the grouped and fused paths can (``RoutedExperts.graph_safe``,
which ``DecoderModel.supports_cuda_graphs`` reads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from services.engine import ops
from services.engine.model_config.deepseek import MoESpec
from services.engine.model_config.granite import GraniteExpertsSpec
from services.engine.models.layers import Linear, copy_weight, gated_mlp, param
from services.engine.ops.fp8_format import FP8_DTYPE
from services.engine.ops.fp8_moe import fp8_grouped_mm
from services.engine.ops.moe_fused import ExpertOrder, RouterSpec, align, fused_experts, fused_moe_usable, route
from services.engine.parallel import ParallelConfig


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul (rows: gate, then up).

    Under TP each rank holds ``intermediate / tp_size`` of the width (gate/up rows, down columns), so its
    output is a partial sum the caller all-reduces (once per layer, with the routed experts' in a MoE layer).
    """

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        self.parallel = parallel
        local = intermediate // parallel.tp_size
        self.gate_up_proj = Linear(hidden, 2 * local, False, dtype, device)
        self.down_proj = Linear(local, hidden, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp("silu", x, self.gate_up_proj, self.down_proj)

    def load(self, name: str, proj: str, tensor: torch.Tensor) -> None:
        """Copy this rank's shard of an HF ``gate_proj``/``up_proj``/``down_proj`` weight into place."""
        if proj == "down_proj":
            return copy_weight(name, self.down_proj.weight, self.parallel.shard(tensor, 1))
        half = self.gate_up_proj.weight.shape[0] // 2
        rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
        return copy_weight(name, self.gate_up_proj.weight[rows], self.parallel.shard(tensor, 0))


class ExpertRouter(nn.Module):
    """DeepSeek-V3's router: which experts each token uses, and with what weight.

    Scores are computed in float32 whatever the model's dtype. ``e_score_correction_bias`` (kept in
    float32, as transformers keeps it) shifts which experts are chosen, never their weights.
    """

    def __init__(self, hidden: int, spec: MoESpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.weight = param(spec.n_routed_experts, hidden, dtype=dtype, device=device)
        self.e_score_correction_bias = param(spec.n_routed_experts, dtype=torch.float32, device=device)

    def route(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor, ExpertOrder | None]:
        """``forward``'s (weights, ids) and, ``fused``, their order by expert from ``ops.moe_fused.route`` (the same
        choice from the same float32 logits)."""
        if not fused:
            return (*self(x), None)
        s = self.spec
        spec = RouterSpec(s.num_experts_per_tok, "sigmoid", s.norm_topk_prob, 1e-20, s.routed_scaling_factor,
                          s.n_group, s.topk_group)
        return route(nn.functional.linear(x.float(), self.weight.float()), spec, self.e_score_correction_bias,
                     torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] float32, expert ids [tokens, k])."""
        s = self.spec
        scores = nn.functional.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if s.topk_group < s.n_group:
            # A group's merit is the sum of its two best (corrected) scores; only the best groups stay.
            grouped = choice.view(-1, s.n_group, s.experts_per_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = group_scores.topk(s.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(-1, s.n_routed_experts)
        experts = choice.topk(s.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, experts)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, experts


def grouped_mm_usable(dtype: torch.dtype, device: torch.device, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` runs these shapes on ``device``: CUDA from sm_90 (its CUTLASS kernel takes
    bfloat16 with every dim a multiple of 8). On CPU torch runs it as a reference loop, never chosen by default
    (``RoutedExperts``: the expert loop is the CPU path)."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0) and all(d % 8 == 0 for d in dims))


class RoutedExperts(nn.Module):
    """``num_experts`` silu-gated MLPs stacked: ``gate_up`` [E, 2I, H] (rows: gate, then up), ``down`` [E, H, I].

    Three paths with the same result (up to the order bf16 partial sums are added in):

    * ``loop`` (the CPU path): one expert at a time over the tokens that chose it, added in expert order
      as transformers adds them. It asks the host for each expert's token count.
    * ``grouped`` (CUDA, bf16, sm_90+): the (token, expert) pairs sorted by expert, then two grouped GEMMs
      (``torch._grouped_mm``: gate_up, down) over every expert at once, each reading only the experts some
      token chose; each token's k outputs summed. No host sync: a step with it can be captured in a CUDA
      graph. Chosen over the loop by ``bench/mla_moe.py`` (``bench/RESULTS.md``).
    * ``fused`` (CUDA, 16/32-bit, where the fused ops take Triton: ``ops.moe_fused``): the same sort, GEMMs
      and sum as Triton kernels with the row gather, the activation and the un-permute inside them, over the
      order the router hands in (``forward``'s ``order``) or one sorted here. No host sync either.

    ``path``: force one (tests and the benchmark); default ``fused`` where ``fused_moe_usable`` (not under
    ``PDSERVE_FUSED_OPS=torch``), else ``grouped`` where ``grouped_mm_usable``, else ``loop``. ``bias``: every
    projection has one (``gate_up_bias`` [E, 2I], ``down_bias`` [E, H]); a family with another activation than
    silu-gating overrides ``activate``. ``keep_fp8``: the projections held as an FP8 checkpoint stores them
    (``loading.fp8_model`` decides), grouped through ``ops.fp8_moe``.
    """

    PATHS = ("loop", "grouped", "fused")

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device, path: str | None = None, bias: bool = False, weights: bool = True) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        # weights False: a subclass holds the projections in its own format (and ``project`` reads them).
        self.gate_up = param(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device) if weights else None
        self.down = param(num_experts, hidden, intermediate, dtype=dtype, device=device) if weights else None
        self.gate_up_bias = param(num_experts, 2 * intermediate, dtype=dtype, device=device) if bias else None
        self.down_bias = param(num_experts, hidden, dtype=dtype, device=device) if bias else None
        if path is None:
            path = ("fused" if fused_moe_usable(dtype, device) else
                    "grouped" if grouped_mm_usable(dtype, device, hidden, intermediate) else "loop")
        if path not in self.PATHS:
            raise ValueError(f"expert path must be one of {', '.join(self.PATHS)}, got {path!r}")
        self.path = path
        self.fp8_block: tuple[int, int] | None = None

    def keep_fp8(self, block: tuple[int, int]) -> None:
        """Hold the projections as e4m3 with float32 scales per ``block`` (``gate_up_scale`` [E, 2I / b0,
        ceil(H / b1)], rows gate then up; ``down_scale`` [E, ceil(H / b0), I / b1]): half the bytes of bf16, read
        by the grouped FP8 GEMM on every step (the grouped path; on CPU its torch reference). This rank's width
        ``I`` must be whole blocks both ways (gate and up fused by rows, down's TP shard by columns): ValueError
        otherwise."""
        (b0, b1), i = block, self.intermediate
        if i % b0 or i % b1:
            raise ValueError(f"FP8 experts {i} wide (per rank) are not whole {b0}x{b1} blocks")
        e, h, dev = self.num_experts, self.down.shape[1], self.down.device
        self.gate_up = param(e, 2 * i, h, dtype=FP8_DTYPE, device=dev)
        self.down = param(e, h, i, dtype=FP8_DTYPE, device=dev)
        self.gate_up_scale = param(e, 2 * i // b0, math.ceil(h / b1), dtype=torch.float32, device=dev)
        self.down_scale = param(e, math.ceil(h / b0), i // b1, dtype=torch.float32, device=dev)
        self.fp8_block, self.path = tuple(block), "grouped"

    def load_fp8_scale(self, expert: int, proj: str, scale: torch.Tensor, parallel: ParallelConfig) -> None:
        """Copy this rank's blocks of one expert's HF scale grid: ``gate_proj`` / ``up_proj`` [I / b0, ceil(H / b1)]
        (this rank's block rows), ``down_proj`` [ceil(H / b0), I / b1] (its block columns)."""
        name = f"expert {expert} {proj} scale"
        if proj == "down_proj":
            return copy_weight(name, self.down_scale[expert], parallel.shard(scale, 1))
        half = self.gate_up_scale.shape[1] // 2
        rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
        return copy_weight(name, self.gate_up_scale[expert, rows], parallel.shard(scale, 0))

    @property
    def graph_safe(self) -> bool:
        """Whether a forward can be captured in a CUDA graph (no host sync); ``DecoderModel.supports_cuda_graphs``
        reads it."""
        return self.path in ("grouped", "fused")

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The hidden activations [rows, I] of the gate/up projections' outputs [rows, 2I] (gate, then up)."""
        return ops.silu_and_mul(gate_up)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                order: ExpertOrder | None = None) -> torch.Tensor:
        """Sum over each token's chosen ``experts`` [tokens, k] of its output times ``weights`` [tokens, k];
        ``order``: the pairs already sorted by expert (the fused router's), read by the fused path only."""
        if self.path == "fused":
            return self._fused(x, weights, experts, order)
        if self.path == "grouped":
            return self._grouped(x, weights, experts)
        return self._loop(x, weights, experts)

    def _fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
               order: ExpertOrder | None) -> torch.Tensor:
        if order is None:
            order = align(experts, self.num_experts)
        # silu-gating is fused into gate_up; a family's own activation (gpt-oss) runs between the GEMMs
        activate = None if type(self).activate is RoutedExperts.activate else self.activate
        return fused_experts(x, self.gate_up, self.down, weights, order, self.gate_up_bias, self.down_bias, activate)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        tokens, k = experts.shape
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        by_expert = flat[order]
        gate_up = self.project("gate_up", x, order // k, ends, by_expert)
        y = self.project("down", self.activate(gate_up), None, ends, by_expert)
        y = (y * weights.view(-1)[order, None]).to(x.dtype)
        by_pair = torch.empty_like(y)
        by_pair[order] = y
        return by_pair.view(tokens, k, -1).sum(dim=1)

    def project(self, proj: str, x: torch.Tensor, rows: torch.Tensor | None, ends: torch.Tensor,
                by_expert: torch.Tensor) -> torch.Tensor:
        """One grouped projection (``gate_up`` or ``down``) of the (token, expert) pairs sorted by expert: ``rows``
        the row of ``x`` each pair reads (None: ``x`` is already the pairs'), ``ends`` each expert's end pair,
        ``by_expert`` each pair's expert."""
        if self.fp8_block is not None:
            out = fp8_grouped_mm(x, rows, getattr(self, proj), getattr(self, f"{proj}_scale"), self.fp8_block, ends)
        else:
            out = torch._grouped_mm(x if rows is None else x[rows], getattr(self, proj).transpose(1, 2), offs=ends)
        bias = getattr(self, f"{proj}_bias")
        return out if bias is None else out + bias[by_expert]

    def load(self, name: str, expert: int, proj: str, tensor: torch.Tensor, parallel: ParallelConfig) -> None:
        """Copy this rank's shard of one expert's HF ``gate_proj`` / ``up_proj`` (rows) or ``down_proj`` (columns)."""
        if proj == "down_proj":
            return copy_weight(name, self.down[expert], parallel.shard(tensor, 1))
        half = self.down.shape[2]  # this rank's width of one expert
        rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
        return copy_weight(name, self.gate_up[expert, rows], parallel.shard(tensor, 0))

    def _bias(self, proj: str, expert: int) -> torch.Tensor | None:
        bias = getattr(self, f"{proj}_bias")
        return None if bias is None else bias[expert]

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start: start + count]
            start += count
            tokens = pairs // k
            gate_up = nn.functional.linear(x[tokens], self.gate_up[expert], self._bias("gate_up", expert))
            y = nn.functional.linear(self.activate(gate_up), self.down[expert], self._bias("down", expert))
            y = y * weights.view(-1)[pairs, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


@dataclass(frozen=True)
class ExpertScaleSlot:
    """Where one expert's HF scale grid goes (``<prefix>.<e>.<proj>.weight_fp8_scale``): the loader's
    counterpart of ``fp8_linear.ScaleSlot`` for experts kept in FP8."""

    experts: RoutedExperts
    expert: int
    proj: str
    parallel: ParallelConfig

    def place(self, scale: torch.Tensor) -> None:
        self.experts.load_fp8_scale(self.expert, self.proj, scale, self.parallel)


class DeepseekMoE(nn.Module):
    """DeepSeek-V3's routed experts plus its shared experts (one gated MLP).

    Under TP every rank routes every token (the router is replicated) and holds ``1 / tp_size`` of every
    expert's width, so its output is a partial sum the layer all-reduces once.
    """

    def __init__(self, hidden: int, spec: MoESpec, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        i = spec.moe_intermediate_size
        self.gate = ExpertRouter(hidden, spec, dtype, device)
        self.experts = RoutedExperts(spec.n_routed_experts, hidden, i // parallel.tp_size, dtype, device)
        self.shared_experts = (GatedMLP(hidden, spec.n_shared_experts * i, dtype, device, parallel)
                               if spec.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate.route(x, self.experts.path == "fused"))
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def load(self, name: str, parts: list[str], tensor: torch.Tensor) -> None:
        """Copy one HF tensor named ``...mlp.<parts>`` into place (``parts`` after ``mlp.``)."""
        if parts[0] == "gate":
            dest = self.gate.weight if parts[1] == "weight" else self.gate.e_score_correction_bias
            return copy_weight(name, dest, tensor)
        if parts[0] == "shared_experts":
            return self.shared_experts.load(name, parts[1], tensor)
        return self.experts.load(name, int(parts[1]), parts[2], tensor, self.parallel)


class SoftmaxTopKRouter(nn.Module):
    """Granite's router: the ``top_k`` experts of highest logit, weighted by the softmax of those logits.

    The logits are computed in the model's dtype and then taken to float32, and the weights go back
    to the model's dtype, as transformers' ``GraniteMoeHybridTopKRouter`` does.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = param(num_experts, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] in ``x``'s dtype, expert ids [tokens, k])."""
        logits, experts = nn.functional.linear(x, self.weight).float().topk(self.top_k, dim=-1)
        return logits.softmax(dim=-1).to(x.dtype), experts

    def route(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor, ExpertOrder | None]:
        """``forward``'s (weights, ids) and, ``fused``, their order by expert (``ops.moe_fused.route``)."""
        if not fused:
            return (*self(x), None)
        return route(nn.functional.linear(x, self.weight), RouterSpec(self.top_k, "logits"), None, x.dtype)


class GraniteMoE(nn.Module):
    """Granite-4.0-H's routed experts (``block_sparse_moe``); the layer adds its shared MLP's output.

    The checkpoint stores the experts stacked as they are held here: ``input_linear`` [E, 2I, H]
    (gate, then up) and ``output_linear`` [E, H, I]; the router is ``router.layer`` [E, H]. Under TP each
    rank holds ``I / tp`` of every expert's width (its output is a partial sum) and the whole router.
    """

    def __init__(self, hidden: int, spec: GraniteExpertsSpec, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        self.router = SoftmaxTopKRouter(hidden, spec.num_local_experts, spec.num_experts_per_tok, dtype, device)
        self.experts = RoutedExperts(spec.num_local_experts, hidden, spec.intermediate_size // parallel.tp_size,
                                     dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.router.route(x, self.experts.path == "fused"))

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name (after ``block_sparse_moe.``) -> the model's shape, for every tensor of the block."""
        e, i, h = self.spec.num_local_experts, self.spec.intermediate_size, self.router.weight.shape[1]
        return {"input_linear.weight": (e, 2 * i, h), "output_linear.weight": (e, h, i), "router.layer.weight": (e, h)}

    def load(self, name: str, tail: str, tensor: torch.Tensor) -> None:
        """Copy this rank's part of an HF tensor (after ``block_sparse_moe.``) into place."""
        tp = self.parallel
        if tail == "router.layer.weight":
            return copy_weight(name, self.router.weight, tensor)
        if tail == "output_linear.weight":
            return copy_weight(name, self.experts.down, tp.shard(tensor, 2))
        if tail != "input_linear.weight":
            raise ValueError(f"unexpected tensor {name!r}")
        gate, up = tensor.chunk(2, dim=1)
        return copy_weight(name, self.experts.gate_up, torch.cat((tp.shard(gate, 1), tp.shard(up, 1)), dim=1))
