"""The fused MoE layer of 16/32-bit routed experts (CUDA, or Triton's interpreter in tests): routing, the sort by
expert, both grouped GEMMs and the weighted sum of each token's experts in a handful of launches, none syncing with
the host (a decode step with them is captured in a CUDA graph).

``route`` turns the router's logits into each token's experts and weights and sorts the (token, expert) pairs by
expert (``ExpertOrder``) in one launch for up to ``SINGLE_MAX_TOKENS`` tokens, two past that
(``moe_route_triton``); ``align`` sorts ids chosen elsewhere. ``fused_experts`` runs the experts over that order
(``moe_gemm_triton``): gate_up gathering its rows from the tokens with ``silu(gate) * up`` as its epilogue, down
over the sorted rows, then ``combine`` un-permuting, weighting and summing each token's k outputs. In place of
``RoutedExperts``' grouped path: argsort, scatter_add, cumsum, a row gather, ``torch._grouped_mm`` twice, the
activation, a multiply, a scatter and a sum. Triton is imported on first use only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SINGLE_MAX_TOKENS = 32  # up to this many tokens (every decode batch the graphs capture) route in one launch
CHUNK_TOKENS = 16  # past it, tokens per routing program
SCORES = ("logits", "softmax", "sigmoid")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class RouterSpec:
    """How a router turns logits into each token's ``top_k`` experts and their weights.

    ``score``: ``logits`` chooses by the logits and weights by their softmax over the chosen (Granite, gpt-oss);
    ``softmax`` by the softmax over every expert (Qwen3-MoE); ``sigmoid`` by sigmoids plus the correction bias,
    within the ``topk_group`` best of ``n_group`` groups (DeepSeek-V3). ``softmax`` and ``sigmoid`` weights are the
    chosen scores, divided by their sum plus ``renorm_eps`` when ``renorm``, times ``scale``."""

    top_k: int
    score: str
    renorm: bool = False
    renorm_eps: float = 0.0
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"router score must be one of {', '.join(SCORES)}, got {self.score!r}")


@dataclass(frozen=True)
class ExpertOrder:
    """A step's (token, expert) pairs sorted by expert, pair ``p = token * top_k + slot``, ties in pair order (the
    loop's order): ``sorted_pairs`` [P] int32 the pair of each sorted row, ``pos_of_pair`` [P] int32 its inverse,
    ``ends`` [E] int32 each expert's end row."""

    sorted_pairs: torch.Tensor
    pos_of_pair: torch.Tensor
    ends: torch.Tensor
    top_k: int


def fused_moe_usable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the fused layer serves experts of ``dtype`` on ``device`` in this process: a dtype its kernels take
    and the fused ops' Triton path on that device (``ops.triton_serves``: CUDA by default, never under
    ``PDSERVE_FUSED_OPS=torch``)."""
    from services.engine import ops

    return dtype in DTYPES and ops.triton_serves(device)


def _order_buffers(num_pairs: int, num_experts: int, top_k: int, device: torch.device) -> ExpertOrder:
    i32 = torch.int32
    return ExpertOrder(torch.empty(num_pairs, dtype=i32, device=device),
                       torch.empty(num_pairs, dtype=i32, device=device),
                       torch.zeros(num_experts, dtype=i32, device=device), top_k)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def route(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None,
          weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, ExpertOrder]:
    """(weights [tokens, k] in ``weights_dtype``, expert ids [tokens, k] int64, their ``ExpertOrder``) from the
    router's ``logits`` [tokens, E] (any float dtype, read as fp32); ``bias`` [E] the correction bias added for the
    choice only (``sigmoid``)."""
    from services.engine.ops import moe_route_triton as kernels

    tokens, num_experts = logits.shape
    k, dev = spec.top_k, logits.device
    if not 1 <= k <= num_experts or logits.stride(1) != 1 or num_experts % spec.n_group:
        raise ValueError(f"route: top {k} of {num_experts} experts in {spec.n_group} groups, rows contiguous")
    weights = torch.empty(tokens, k, dtype=weights_dtype, device=dev)
    ids = torch.empty(tokens, k, dtype=torch.int64, device=dev)
    order = _order_buffers(tokens * k, num_experts, k, dev)
    if tokens == 0:
        return weights, ids, order
    block_t = _next_pow2(tokens) if tokens <= SINGLE_MAX_TOKENS else CHUNK_TOKENS
    chunks, block_e = -(-tokens // block_t), _next_pow2(num_experts)
    hist = torch.empty(chunks, block_e, dtype=torch.int32, device=dev) if chunks > 1 else order.ends
    rank = torch.empty(tokens * k, dtype=torch.int32, device=dev) if chunks > 1 else order.ends
    kernels._route_kernel[(chunks,)](
        logits, logits if bias is None else bias, weights, ids, hist, rank, order.sorted_pairs, order.pos_of_pair,
        order.ends, tokens, num_experts, logits.stride(0), spec.renorm_eps, spec.scale, TOP_K=k,
        SCORE=SCORES.index(spec.score), RENORM=spec.renorm, HAS_BIAS=bias is not None, N_GROUP=spec.n_group,
        TOPK_GROUP=spec.topk_group, GROUP_SIZE=num_experts // spec.n_group, SINGLE=chunks == 1, BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_K=_next_pow2(k), BLOCK_G=_next_pow2(spec.n_group),
        num_warps=8 if block_t * block_e >= 4096 else 4,
    )
    if chunks > 1:
        _place(ids, hist, rank, order, num_experts, block_t * k)
    return weights, ids, order


def _place(ids: torch.Tensor, hist: torch.Tensor, rank: torch.Tensor, order: ExpertOrder, num_experts: int,
           pairs_per_chunk: int) -> None:
    from services.engine.ops import moe_route_triton as kernels

    chunks, block_e = hist.shape
    kernels._place_kernel[(chunks,)](ids, hist, rank, order.sorted_pairs, order.pos_of_pair, order.ends, ids.numel(),
                                     num_experts, chunks, pairs_per_chunk, BLOCK_P=_next_pow2(pairs_per_chunk),
                                     BLOCK_E=block_e, BLOCK_C=max(1, min(64, 8192 // block_e)))


def align(ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    """The ``ExpertOrder`` of expert ids [tokens, k] chosen by any router (one launch up to 128 pairs, two past)."""
    from services.engine.ops import moe_route_triton as kernels

    tokens, k = ids.shape
    ids = ids.contiguous()
    order = _order_buffers(tokens * k, num_experts, k, ids.device)
    if tokens == 0:
        return order
    block_e = _next_pow2(num_experts)
    per_chunk = 128 if block_e <= 128 else 64
    chunks = -(-ids.numel() // per_chunk)
    hist = torch.empty(chunks, block_e, dtype=torch.int32, device=ids.device) if chunks > 1 else order.ends
    rank = torch.empty(ids.numel(), dtype=torch.int32, device=ids.device) if chunks > 1 else order.ends
    kernels._count_kernel[(chunks,)](ids, hist, rank, order.sorted_pairs, order.pos_of_pair, order.ends, ids.numel(),
                                     num_experts, per_chunk, SINGLE=chunks == 1, BLOCK_P=per_chunk, BLOCK_E=block_e,
                                     num_warps=8)
    if chunks > 1:
        _place(ids, hist, rank, order, num_experts, per_chunk)
    return order


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  order: ExpertOrder, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  activate: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * down[e](act(gate_up[e] x[t]))`` over each token's experts ``e`` of ``order``, in
    x's dtype, rounded where ``RoutedExperts``' grouped path rounds. ``gate_up`` [E, 2I, H] (gate rows, then up),
    ``down`` [E, H, I]; ``activate`` None: silu-gating, fused into gate_up; else a function of the gate/up outputs
    [rows, 2I] (gpt-oss's clamped SwiGLU), run between the GEMMs."""
    from services.engine.ops import moe_gemm_triton as gemm

    pairs, k, ends = order.sorted_pairs, order.top_k, order.ends
    if activate is None:
        hidden = gemm.moe_gemm(x, pairs, k, gate_up, gate_up_bias, ends, act=True)
    else:
        hidden = activate(gemm.moe_gemm(x, pairs, k, gate_up, gate_up_bias, ends))
    y = gemm.moe_gemm(hidden, None, k, down, down_bias, ends, keep_splits=True)
    return gemm.combine(y, order.pos_of_pair, weights, x.dtype)
