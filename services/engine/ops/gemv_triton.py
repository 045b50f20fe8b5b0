"""``y = x @ W.T (+ b)`` for one row of ``x``: a batch-1 decode step's projections at the memory's rate.

At batch 1 a projection reads each weight element once for one multiply-add, so its time is the
weight's bytes over HBM bandwidth plus what it costs to start. cuBLAS reaches 0.5-0.9 of the
bandwidth on Llama-8B's projections and adds a split-K reduce kernel to two of them; this kernel
(``bench/gemv.py`` measures both) gives each program ``block_n`` output features, streams their
weight rows along K in ``block_k`` tiles and sums in fp32, rounding once as cuBLAS does (only the
order of the sum differs).

Two things a library GEMV cannot do:

* **Programmatic dependent launch** (Hopper and later, ``triton_pdl``): the kernel is launched before
  the one that writes ``x`` has finished, loads its first weight tile (weights never change), and
  only then waits for that kernel's writes. The launch and the first DRAM round trip hide behind the
  previous kernel's tail instead of following it.
* **A gated prologue** (``gated=``): the down projection reads the gate/up projection's output and
  applies ``act(gate) * up`` (rounded where torch rounds it) as it loads each tile, so the MLP's
  activation is not a kernel of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.engine.ops.gated_act_triton import gated_act
from services.engine.triton_pdl import launch_options, pdl_enter
from services.engine.triton_support import pdl_enabled

ACTIVATION_CODES = {None: 0, "silu": 1, "gelu_pytorch_tanh": 2}


class Tile(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _x_tile(X, offs, K, ACT: tl.constexpr):
    """x[offs] in fp32 (0 past K); with ACT, ``act(gate) * up`` of a [gate | up] row of 2K values."""
    x = tl.load(X + offs, mask=offs < K, other=0.0)
    if ACT != 0:
        x = gated_act(x, tl.load(X + K + offs, mask=offs < K, other=0.0), ACT == 2)
    return x.to(tl.float32)


@triton.jit
def _w_tile(w_ptrs, n_ok, offs, K, EVEN_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile as stored (converted where it is used, so the first tile's load stays in
    flight across ``pdl_enter``): rows past N (and, unless EVEN_K, columns past K) are 0."""
    if EVEN_K:
        return tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
    return tl.load(w_ptrs, mask=n_ok[:, None] & (offs < K)[None, :], other=0.0)


@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ACT: tl.constexpr, PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = W + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    w = _w_tile(w_ptrs, n_ok, rk, K, EVEN_K)
    pdl_enter(PDL)  # the first weight tile is in flight; x is the previous kernel's output
    acc = w.to(tl.float32) * _x_tile(X, rk, K, ACT)[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        acc += _w_tile(w_ptrs, n_ok, k + rk, K, EVEN_K).to(tl.float32) * _x_tile(X, k + rk, K, ACT)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=n_ok)


def default_tile(n: int, k: int) -> Tile:
    """The tile for an [n, k] weight, from ``bench/gemv.py --sweep`` on an H200 (Llama-8B's projections):
    the best tile of each shape, or one within 0.5 us of it, as a rule of two cases. Short outputs take
    narrow row blocks, so there are programs enough for every SM; the gated down projection's activation
    is computed once per program, which rules out narrower ones."""
    return Tile(16, 256, 4, 2) if n >= 16384 else Tile(8, 512, 4, 2)


def search_space() -> list[Tile]:
    """The tiles ``bench/gemv.py --sweep`` tries."""
    return [Tile(n, k, w, s) for n in (4, 8, 16, 32) for k in (128, 256, 512) for w in (4, 8) for s in (2, 3, 4)]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         tile: Tile | None = None, gated: str | None = None, pdl: bool | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of one row ([1, K]; with ``gated``, [1, 2K] holding gate then up,
    multiplied as ``act(gate) * up`` first). ``pdl=None``: programmatic dependent launch where
    ``triton_support.pdl_enabled`` allows it (never on CPU, so never under Triton's interpreter)."""
    n, k = weight.shape
    if x.shape != (1, 2 * k if gated else k) or x.stride(-1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes one contiguous row of {2 * k if gated else k} values, got {tuple(x.shape)}")
    tile = tile or default_tile(n, k)
    if pdl is None:
        pdl = pdl_enabled(x.device)
    if out is None:
        out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=k % tile.block_k == 0, HAS_BIAS=bias is not None,
        ACT=ACTIVATION_CODES[gated], PDL=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **launch_options(pdl))
    return out


def _gemv_input(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x`` is what this kernel is for: one row on a CUDA device, 16-bit like its weight."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``ops.linear``'s Triton path: the GEMV for one row on CUDA, None (cuBLAS) for anything else."""
    return gemv(x, weight, bias) if _gemv_input(x, weight) else None


def act_and_linear(activation: str, gate_up: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor | None:
    """``ops.act_and_linear``'s Triton path: one launch for one row, None for anything else."""
    if (activation not in ACTIVATION_CODES or not _gemv_input(gate_up, weight)
            or gate_up.shape[1] != 2 * weight.shape[1]):
        return None
    return gemv(gate_up, weight, bias, gated=activation)
