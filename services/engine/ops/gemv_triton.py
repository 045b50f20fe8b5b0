"""``y = x @ W.T (+ b)`` for 1 to 32 rows of ``x``: a small decode batch's projections at the memory's rate.

At a small batch a projection reads each weight element once for a few multiply-adds, so its time is the
weight's bytes over HBM bandwidth plus what it costs to start. cuBLAS reaches 0.5-0.9 of the
bandwidth on Llama-8B's projections and adds a split-K reduce kernel to two of them at one row. Here
(``bench/gemv.py`` measures both) each program owns ``block_n`` output features and streams their
weight rows along K in ``block_k`` tiles, summing in fp32 and rounding once as cuBLAS does (only the
order of the sum differs): one row on the CUDA cores, several as a tensor-core MMA whose 16-row side is
the weight tile (the rows of x, padded to 16 or 32, are the other).

What a library GEMM cannot do:

* **Programmatic dependent launch** (Hopper and later, ``triton_pdl``): the kernel is launched before
  the one that writes ``x`` has finished, loads its first weight tile (weights never change), and
  only then waits for that kernel's writes. The launch and the first DRAM round trip hide behind the
  previous kernel's tail instead of following it.
* **The MLP's activation inside a projection**, so it is not a kernel of its own: at one row as the down
  projection's prologue (``gated=``: ``act(gate) * up`` applied as each tile of the gate/up output is
  loaded), at several as the gate/up projection's epilogue (``gated_out=``: a program computes gate row j
  and up row j together), both rounded where torch rounds.
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


@triton.jit
def _x_rows_t(X, rm, m_ok, stride_xm, offs, K):
    """x[rm, offs] transposed, a [BLOCK_K, BLOCK_M] tile in x's dtype (0 past M and K): the MMA's right operand."""
    x = tl.load(X + rm[:, None] * stride_xm + offs[None, :], mask=m_ok[:, None] & (offs < K)[None, :], other=0.0)
    return tl.trans(x)


@triton.jit
def _gemv_rows_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ACT_OUT: tl.constexpr, PDL: tl.constexpr, PRECISION: tl.constexpr):
    """A few rows: the weight tile is the MMA's left operand (its rows fill the 16 the tensor core needs),
    the rows of x, padded to BLOCK_M, its right one; the output is written transposed back. With ACT_OUT
    the weight is a gate/up projection's [gate; up] (2N rows): a program computes gate row j and up row j
    together and writes ``act(gate) * up`` (each rounded first, as torch rounds the projection's output)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = W + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    up_offset = N.to(tl.int64) * stride_wn
    w = _w_tile(w_ptrs, n_ok, rk, K, EVEN_K)
    if ACT_OUT != 0:
        w_up = _w_tile(w_ptrs + up_offset, n_ok, rk, K, EVEN_K)
    pdl_enter(PDL)  # as in the one-row kernel: the first weight tiles are in flight
    xt = _x_rows_t(X, rm, m_ok, stride_xm, rk, K)
    acc = tl.dot(w, xt, input_precision=PRECISION)
    if ACT_OUT != 0:
        acc_up = tl.dot(w_up, xt, input_precision=PRECISION)
    for k in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        xt = _x_rows_t(X, rm, m_ok, stride_xm, k + rk, K)
        acc = tl.dot(_w_tile(w_ptrs, n_ok, k + rk, K, EVEN_K), xt, acc, input_precision=PRECISION)
        if ACT_OUT != 0:
            acc_up = tl.dot(_w_tile(w_ptrs + up_offset, n_ok, k + rk, K, EVEN_K), xt, acc_up,
                            input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if ACT_OUT != 0:
            acc_up += tl.load(B + N + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = acc.to(Y.dtype.element_ty)
    if ACT_OUT != 0:
        y = gated_act(y, acc_up.to(Y.dtype.element_ty), ACT_OUT == 2)
    tl.store(Y + rm[None, :] * stride_ym + rn[:, None], y, mask=n_ok[:, None] & m_ok[None, :])


MAX_ROWS = 32  # the most rows (a decode batch) the Triton kernels take; more go to cuBLAS


def default_tile(n: int, k: int, rows: int = 1, gated_out: bool = False) -> Tile:
    """The tile for an [n, k] weight, from ``bench/gemv.py --sweep`` on an H200 (Llama-8B's projections).
    One row: the best tile of each shape, or one within 0.5 us of it, as a rule of two cases; short outputs
    take narrow row blocks, so there are programs enough for every SM; the gated down projection's
    activation is computed once per program, which rules out narrower ones. Several rows: the best tile at
    8 and 16 rows of each shape (they agreed), as a rule of three cases: long outputs (the gate/up projection
    with its epilogue, the LM head) 64 rows and 128-wide K tiles; short ones 64 and 256 when there are
    programs enough (qkv), else 32 rows and 512 (o_proj, and the down projection's long K). At 32 rows the
    LM head's best tile had three stages (251 against 274 us for four)."""
    if rows > 1:
        if gated_out or n >= 16384:
            return Tile(64, 128, 4, 3 if rows > 16 and not gated_out else 4)
        return Tile(64, 256, 4, 3) if n >= 6144 and k < 8192 else Tile(32, 512, 4, 4)
    return Tile(16, 256, 4, 2) if n >= 16384 else Tile(8, 512, 4, 2)


def search_space(rows: int = 1) -> list[Tile]:
    """The tiles ``bench/gemv.py --sweep`` tries (several rows: 16 weight rows at least, the MMA's)."""
    blocks_n = (4, 8, 16, 32) if rows == 1 else (16, 32, 64)
    return [Tile(n, k, w, s) for n in blocks_n for k in (128, 256, 512) for w in (4, 8) for s in (2, 3, 4)]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         tile: Tile | None = None, gated: str | None = None, gated_out: str | None = None,
         pdl: bool | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of 1 to ``MAX_ROWS`` rows. One row runs on the CUDA cores, several on
    the tensor cores. An MLP's activation goes where each is cheapest:

    * ``gated`` (one row): ``x`` is [1, 2K], gate then up, multiplied as ``act(gate) * up`` as it loads
      (the down projection);
    * ``gated_out`` (several rows): ``weight`` is [2N, K], a gate/up projection's gate rows then up rows;
      the output is [M, N], ``act(gate) * up`` (the activation computed once per element, not once per
      program as a prologue would).

    ``pdl=None``: programmatic dependent launch where ``triton_support.pdl_enabled`` allows it (never on CPU,
    so never under Triton's interpreter)."""
    n, k = weight.shape
    width, rows = 2 * k if gated else k, x.shape[0] if x.dim() == 2 else 0
    if (x.dim() != 2 or not 1 <= rows <= MAX_ROWS or x.shape[1] != width or x.stride(-1) != 1
            or weight.stride(1) != 1):
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} contiguous rows of {width} values, got {tuple(x.shape)}")
    if (gated and rows > 1) or (gated_out and (rows == 1 or n % 2)):
        raise ValueError("a gated input takes one row, a gated output several rows and an even number of weight rows")
    n_out = n // 2 if gated_out else n
    tile = tile or default_tile(n_out, k, rows, gated_out is not None)
    if pdl is None:
        pdl = pdl_enabled(x.device)
    if out is None:
        out = torch.empty(rows, n_out, device=x.device, dtype=x.dtype)
    common = dict(BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=k % tile.block_k == 0,
                  HAS_BIAS=bias is not None, PDL=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages,
                  **launch_options(pdl))
    grid = (triton.cdiv(n_out, tile.block_n),)
    b = bias if bias is not None else weight
    if rows == 1:
        _gemv_kernel[grid](x, weight, b, out, n, k, weight.stride(0), ACT=ACTIVATION_CODES[gated], **common)
    else:
        _gemv_rows_kernel[grid](x, weight, b, out, rows, n_out, k, x.stride(0), weight.stride(0), out.stride(0),
                                BLOCK_M=max(16, triton.next_power_of_2(rows)), ACT_OUT=ACTIVATION_CODES[gated_out],
                                PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **common)
    return out


def _gemv_input(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x`` is what these kernels are for: 1 to ``MAX_ROWS`` rows on a CUDA device, 16-bit like its
    weight."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``ops.linear``'s Triton path: the GEMVs for 1 to ``MAX_ROWS`` rows on CUDA, None (cuBLAS) for the rest."""
    return gemv(x, weight, bias) if _gemv_input(x, weight) else None


def act_and_linear(activation: str, gate_up: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor | None:
    """``ops.act_and_linear``'s Triton path: one launch for one row (the activation as the prologue), None for
    anything else."""
    if (activation not in ACTIVATION_CODES or not _gemv_input(gate_up, weight) or gate_up.shape[0] != 1
            or gate_up.shape[1] != 2 * weight.shape[1]):
        return None
    return gemv(gate_up, weight, bias, gated=activation)


def linear_and_act(activation: str, x: torch.Tensor, gate_up_weight: torch.Tensor,
                   gate_up_bias: torch.Tensor | None) -> torch.Tensor | None:
    """``ops.gated_mlp``'s first half for 2 to ``MAX_ROWS`` rows on CUDA: the gate/up projection with the
    activation as its epilogue; None for anything else."""
    if (activation not in ACTIVATION_CODES or not _gemv_input(x, gate_up_weight) or x.shape[0] == 1
            or gate_up_weight.shape[0] % 2):
        return None
    return gemv(x, gate_up_weight, gate_up_bias, gated_out=activation)
