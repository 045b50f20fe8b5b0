"""Causal attention of one prefill chunk's fresh tokens to each other, with its log-sum-exp.

A long prefill chunk spends most of its attention time on its own tokens: a triangle of
``L x L`` scores on contiguous K/V that the step has just computed. The best dense kernel the
device has does that part (on an H100, cuDNN's flash attention runs it at about twice the speed
of the paged Triton kernel: ``bench/attention.py``), and the paged kernel adds the context before
the chunk, merging the two halves by their log-sum-exp (``triton_kernels``, ``MODES``).

CUDA: cuDNN through ``aten._scaled_dot_product_cudnn_attention``, which takes grouped K/V heads
as they are and returns the LSE. Its variable-length entry point (``_cudnn_attention_forward``
with cumulative lengths) rebuilds its execution plan on every call in torch 2.11 (~75 ms), so a
step with several long chunks makes one dense call per chunk instead. CPU: the same maths in
float32 with torch ops, so the split-and-merge path is tested where there is no cuDNN.
"""

from __future__ import annotations

import functools

import torch

_CUDNN_DTYPES = (torch.float16, torch.bfloat16)
CUDNN_MAX_HEAD_DIM = 128


@functools.cache
def _cudnn_usable(device_index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(device_index)
    return torch.backends.cudnn.is_available() and major >= 8


def dense_unsupported_reason(head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``dense_causal`` cannot run this shape here, or None if it can."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"device {device.type}"
    if not _cudnn_usable(device.index if device.index is not None else torch.cuda.current_device()):
        return "cuDNN attention needs cuDNN and compute capability 8.0 or newer"
    if dtype not in _CUDNN_DTYPES:
        return f"dtype {dtype} (cuDNN attention takes float16 and bfloat16)"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return f"head dim {head_dim} (cuDNN attention here: a multiple of 8 up to {CUDNN_MAX_HEAD_DIM})"
    return None


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [L, heads, head_dim] in q's dtype, lse [heads, L] float32, natural log) of causal
    attention of ``q`` [L, heads, head_dim] to ``k``/``v`` [L, kv_heads, head_dim] (any row strides)."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2),
            None, True, 0.0, True, False, scale=scale)[:2]
        return out[0].transpose(0, 1), lse.view(lse.shape[1], lse.shape[2])
    return _reference(q, k, v, scale)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    values = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ keys.transpose(1, 2) * scale
    hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ values
    return out.transpose(0, 1).to(q.dtype), lse
