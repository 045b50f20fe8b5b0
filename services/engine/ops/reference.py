"""The torch reference of every fused op: today's model math, op for op.

This is what runs on CPU (so CPU results stay bit-identical to the unfused layers) and what the
Triton kernels are tested against. Intermediate results are rounded to the input's dtype exactly
where these expressions round them; the kernels reproduce those roundings.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.ops import kv_fp8


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float | None = None,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See ``services.engine.ops.rms_norm``."""
    if residual is not None:
        x = residual + x
    normed = _norm(x, weight, eps, offset)
    return normed if residual is None else (normed, x)


def _norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float | None) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset is None:  # Llama: cast, then scale in x's dtype
        return weight * x32.to(x.dtype)
    if weight is not None:  # Gemma: scale by (offset + weight) in fp32, cast once
        x32 = x32 * (offset + weight.float())
    return x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See ``services.engine.ops.apply_rope``."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    cos = cos.to(q.dtype)[:, None, :]
    sin = sin.to(q.dtype)[:, None, :]
    q = q * cos + rotate_half(q) * sin
    return q, None if k is None else k * cos + rotate_half(k) * sin


def rope_and_write_kv(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                      sin: torch.Tensor | None, positions: torch.Tensor | None, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, write_blocks: torch.Tensor, write_offsets: torch.Tensor,
                      scales: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor | None, torch.Tensor]:
    """See ``services.engine.ops.rope_and_write_kv`` (q None: ``write_kv``, returning (None, k))."""
    if q is not None:
        q, k = apply_rope(q, k, cos, sin, positions)
    k_cache[write_blocks, write_offsets] = kv_fp8.to_cache(k, k_cache, scales[0])
    v_cache[write_blocks, write_offsets] = kv_fp8.to_cache(v, v_cache, scales[1])
    return q, k


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": nn.functional.silu, "gelu_pytorch_tanh": gelu_tanh}


def act_and_mul(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """See ``services.engine.ops.act_and_mul``."""
    return ACTIVATIONS[activation](gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return nn.functional.linear(x, weight, bias)
