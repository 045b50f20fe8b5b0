"""Triton kernels of the fused ops, and their launchers. Imported only when a Triton path is taken.

Numerics: every kernel loads in the input's dtype, computes in fp32, and rounds to the input's
dtype exactly where the torch reference (``reference.py``) rounds -- a product of two 16-bit
values is exact in fp32, so rounding it once gives torch's result, and the same holds for sums.
What can still differ is the order of the RMSNorm sum of squares and the last bits of ``rsqrt``
and ``exp``; on 16-bit inputs that rarely changes a rounded output. (Under Triton's CPU
interpreter a cast to bfloat16 truncates instead of rounding to nearest even, so there bf16
results can be one unit in the last place lower.)

Each launcher returns None for an input it does not handle (a dtype other than fp16/bf16/fp32, a
norm wider than ``MAX_NORM_COLS``, a layout it cannot address), and the caller falls back to the
reference. Nothing here syncs with the device: shapes, strides and block sizes are host integers,
so the launches can be captured in CUDA graphs.

Interpreter or compiler: ``triton.jit`` decides at decoration, from ``TRITON_INTERPRET``, so the
choice is made when this module is first imported (see ``tests/unit/engine/test_attention_backends.py``).
CPU tensors need the interpreter; without it a launch fails with a clear error.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from services.engine.ops import fp8_format
from services.engine.ops.gated_act_triton import gated_act

# The GEMV's launchers, dispatched (``ops._dispatch``) like this module's own.
from services.engine.ops.gemv_triton import act_and_linear, linear, linear_and_act  # noqa: F401
from services.engine.triton_pdl import launch_options, pdl_enter
from services.engine.triton_support import pdl_enabled

# Widest row RMSNorm keeps in registers in one program: 8192 (Llama-70B, Qwen2-72B) compiles for
# sm_90 without spills at 16 warps, 16384 spills; wider rows take the torch path.
MAX_NORM_COLS = 8192
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_MAX = tl.constexpr(fp8_format.FP8_MAX)  # e4m3's largest finite value: 448


# ---- kernels -----------------------------------------------------------------------------------------
# Row and token counts change every step: not specialised on (no recompiles for a count of 1 or a multiple of 16).
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    X, Residual, Weight, Out, ResidualOut,
    num_rows, num_cols, heads,  # rows are (token, head) pairs: heads per token (1 for 2-D inputs)
    stride_xt, stride_xh, stride_rt, stride_rh,
    eps, offset,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    FP32_SCALE: tl.constexpr,  # Gemma: x_normed * (offset + weight) in fp32; else Llama: weight * cast(x_normed)
    PDL: tl.constexpr,
):
    """BLOCK_ROWS rows of BLOCK_N columns per program; outputs are contiguous [num_rows, num_cols]."""
    pdl_enter(PDL)
    dtype = Out.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < num_cols
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    token = rows // heads
    head = rows % heads
    x = tl.load(X + (token * stride_xt + head * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    out_offsets = rows[:, None] * num_cols + cols[None, :]
    if HAS_RESIDUAL:  # the sum is rounded to x's dtype, as the unfused ``residual + x`` would be
        r = tl.load(Residual + (token * stride_rt + head * stride_rh)[:, None] + cols[None, :], mask=mask,
                    other=0.0)
        s = (x + r.to(tl.float32)).to(dtype)
        tl.store(ResidualOut + out_offsets, s, mask=mask)
        x = s.to(tl.float32)
    mean_square = tl.sum(x * x, axis=1) / num_cols
    y = x * tl.math.rsqrt(mean_square + eps)[:, None]
    if FP32_SCALE:
        if HAS_WEIGHT:
            w = tl.load(Weight + cols, mask=col_ok, other=0.0).to(tl.float32)
            y = y * (offset + w)[None, :]
    else:
        w = tl.load(Weight + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = y.to(dtype).to(tl.float32) * w[None, :]
    tl.store(Out + out_offsets, y.to(dtype), mask=mask)


@triton.jit
def _rotate_halves(x1, x2, Cos, Sin, angle_row, stride_ct, stride_st, d, mask, dtype, HALF: tl.constexpr):
    """(first, second) half of ``x * cos + rotate_half(x) * sin`` for fp32 halves ``x1``/``x2`` of a
    tile of rows, cos/sin cast to ``dtype`` and each product and the sum rounded to it, as torch
    does: first half ``x1 * c1 - x2 * s1``, second half ``x2 * c2 + x1 * s2`` (fp32 values)."""
    cos = Cos + (angle_row * stride_ct)[:, None] + d[None, :]
    sin = Sin + (angle_row * stride_st)[:, None] + d[None, :]
    c1 = tl.load(cos, mask=mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
    o1 = (x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)
    o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    return o1, o2


@triton.jit
def _rope_rows(X, Out, Cos, Sin, Positions, stride_xt, stride_xh, stride_ct, stride_st, num_heads, num_rows, block,
               HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """Rotate-half RoPE of BLOCK_R (token, head) rows of X into contiguous ``Out``."""
    dtype = Out.dtype.element_ty
    rows = block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    token = rows // num_heads
    head = rows % num_heads
    angle_row = tl.load(Positions + token, mask=row_ok, other=0).to(tl.int64) if HAS_POSITIONS else token
    d = tl.arange(0, BLOCK_HALF)
    mask = row_ok[:, None] & (d < HALF)[None, :]
    src = X + (token * stride_xt + head * stride_xh)[:, None] + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate_halves(x1, x2, Cos, Sin, angle_row, stride_ct, stride_st, d, mask, dtype, HALF)
    dst = Out + rows[:, None] * (2 * HALF) + d[None, :]
    tl.store(dst, o1.to(dtype), mask=mask)
    tl.store(dst + HALF, o2.to(dtype), mask=mask)


@triton.jit(do_not_specialize=["num_tokens", "q_blocks"])
def _rope_kernel(
    Q, K, QOut, KOut, Cos, Sin, Positions,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    num_tokens, num_q_heads, num_k_heads, q_blocks,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,  # (token, head) rows per program
    HAS_POSITIONS: tl.constexpr,  # cos/sin rows are positions[token] (a table), else the token itself
):
    """The first ``q_blocks`` programs rotate the query rows, the rest the key rows."""
    pid = tl.program_id(0)
    if pid < q_blocks:
        _rope_rows(Q, QOut, Cos, Sin, Positions, stride_qt, stride_qh, stride_ct, stride_st, num_q_heads,
                   num_tokens * num_q_heads, pid, HALF, BLOCK_HALF, BLOCK_R, HAS_POSITIONS)
    else:
        _rope_rows(K, KOut, Cos, Sin, Positions, stride_kt, stride_kh, stride_ct, stride_st, num_k_heads,
                   num_tokens * num_k_heads, pid - q_blocks, HALF, BLOCK_HALF, BLOCK_R, HAS_POSITIONS)


@triton.jit
def _store_slot(Cache, rows_lo, rows_hi, slot_offsets, d, mask, stride_d, scale, HALF: tl.constexpr,
                FP8: tl.constexpr):
    """Both halves of BLOCK_R head rows into the cache rows starting at ``slot_offsets``; with FP8, each
    divided by ``scale`` in float32, saturated to +-448 and rounded to e4m3 (``ops.fp8_format.quantize``)."""
    dst = Cache + slot_offsets[:, None] + d[None, :] * stride_d
    if FP8:
        fp8 = Cache.dtype.element_ty
        # IEEE division (div_rn), as torch divides: '/' compiles to an approximate one, off by an ulp at times,
        # which can tip an e4m3 rounding.
        rows_lo = tl.clamp(tl.div_rn(rows_lo.to(tl.float32), scale * 1.0), -FP8_MAX, FP8_MAX).to(fp8)
        rows_hi = tl.clamp(tl.div_rn(rows_hi.to(tl.float32), scale * 1.0), -FP8_MAX, FP8_MAX).to(fp8)
    tl.store(dst, rows_lo, mask=mask)
    tl.store(dst + HALF * stride_d, rows_hi, mask=mask)


@triton.jit(do_not_specialize=["num_tokens", "q_blocks"])
def _rope_write_kv_kernel(
    Q, K, V, QOut, KOut, KCache, VCache, Cos, Sin, Positions, WriteBlocks, WriteOffsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kb, stride_ks, stride_kh_cache, stride_kd, stride_vb, stride_vs, stride_vh_cache, stride_vd,
    num_tokens, num_q_heads, num_kv_heads, q_blocks,
    k_scale, v_scale,  # used with FP8
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,  # (token, head) rows per program
    HAS_POSITIONS: tl.constexpr,
    ROPE: tl.constexpr,  # rotate q and k (q_blocks programs for q), else only copy K/V into the cache
    FP8: tl.constexpr,  # the caches are e4m3: K/V quantized with their scales as they are stored
    PDL: tl.constexpr,
):
    """The first ``q_blocks`` programs rotate query rows into ``QOut`` (as ``_rope_kernel``); each
    other program takes BLOCK_R (token, KV head) rows: the key rotated (ROPE) into ``KOut`` and into
    its cache slot, the value copied into its slot. A token's slot is (``WriteBlocks[t]``,
    ``WriteOffsets[t]``), addressed through the cache views' own strides (any layout)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid < q_blocks:  # none without ROPE
        _rope_rows(Q, QOut, Cos, Sin, Positions, stride_qt, stride_qh, stride_ct, stride_st, num_q_heads,
                   num_tokens * num_q_heads, pid, HALF, BLOCK_HALF, BLOCK_R, HAS_POSITIONS)
    else:
        dtype = K.dtype.element_ty  # the cache's too, unless FP8
        rows = (pid - q_blocks).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < num_tokens * num_kv_heads
        token = rows // num_kv_heads
        head = rows % num_kv_heads
        d = tl.arange(0, BLOCK_HALF)
        mask = row_ok[:, None] & (d < HALF)[None, :]
        block = tl.load(WriteBlocks + token, mask=row_ok, other=0).to(tl.int64)
        slot = tl.load(WriteOffsets + token, mask=row_ok, other=0).to(tl.int64)
        k_src = K + (token * stride_kt + head * stride_kh)[:, None] + d[None, :]
        k1 = tl.load(k_src, mask=mask, other=0.0)
        k2 = tl.load(k_src + HALF, mask=mask, other=0.0)
        if ROPE:
            angle_row = tl.load(Positions + token, mask=row_ok, other=0).to(tl.int64) if HAS_POSITIONS else token
            o1, o2 = _rotate_halves(k1.to(tl.float32), k2.to(tl.float32), Cos, Sin, angle_row, stride_ct,
                                    stride_st, d, mask, dtype, HALF)
            k1, k2 = o1.to(dtype), o2.to(dtype)
            k_out = KOut + rows[:, None] * (2 * HALF) + d[None, :]
            tl.store(k_out, k1, mask=mask)
            tl.store(k_out + HALF, k2, mask=mask)
        _store_slot(KCache, k1, k2, block * stride_kb + slot * stride_ks + head * stride_kh_cache, d, mask,
                    stride_kd, k_scale, HALF, FP8)
        v_src = V + (token * stride_vt + head * stride_vh)[:, None] + d[None, :]
        v1 = tl.load(v_src, mask=mask, other=0.0)
        v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
        _store_slot(VCache, v1, v2, block * stride_vb + slot * stride_vs + head * stride_vh_cache, d, mask,
                    stride_vd, v_scale, HALF, FP8)


@triton.jit(do_not_specialize=["num_rows"])
def _act_and_mul_kernel(
    Gate, Up, Out,
    num_rows, num_cols, stride_gt, stride_ut,
    GELU: tl.constexpr,  # tanh-approximated GELU, else SiLU
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """``act(gate) * up`` for a [BLOCK_M, BLOCK_N] tile, act rounded to the input dtype before the product."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    g = tl.load(Gate + (rows * stride_gt)[:, None] + cols[None, :], mask=mask, other=0.0)
    u = tl.load(Up + (rows * stride_ut)[:, None] + cols[None, :], mask=mask, other=0.0)
    tl.store(Out + rows[:, None] * num_cols + cols[None, :], gated_act(g, u, GELU), mask=mask)


# ---- launchers ---------------------------------------------------------------------------------------
def interpreting() -> bool:
    """Whether triton.language was imported in interpreter mode (TRITON_INTERPRET=1 at the time)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_rms_norm_kernel, InterpretedFunction)


def _check_device(x: torch.Tensor) -> bool:
    """Whether ``x``'s device can run the kernels: CUDA, or CPU under the interpreter (else an error)."""
    if x.device.type == "cuda":
        return True
    if x.device.type != "cpu":
        return False
    if not interpreting():
        raise RuntimeError("fused ops through Triton on CPU tensors need Triton's interpreter: set "
                           "TRITON_INTERPRET=1 in the environment before triton is first imported")
    return True


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _tile_elements() -> int:
    """Elements per program: 2048 compiled (a few registers per thread at 4-8 warps); the
    interpreter runs programs one after another at a fixed cost per op, so it gets few large tiles."""
    return 32768 if interpreting() else 2048


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x, heads, token stride, head stride) addressing the rows of ``x`` as (token, head) pairs: a
    3-D [tokens, heads, cols] view as it lies (q/k heads sliced out of a fused projection), anything
    else as 2-D rows (heads 1), copied only when it cannot be viewed so."""
    if x.ndim == 3 and x.stride(-1) == 1:
        return x, x.shape[1], x.stride(0), x.stride(1)
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, 1, flat.stride(0), 0


def _num_warps(elements: int) -> int:
    """Warps for a tile: at most 16 elements per thread (4 warps for the usual 2048)."""
    return 4 if elements <= 2048 else 8 if elements <= 4096 else 16


@functools.cache
def _norm_config(num_cols: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_ROWS, num_warps): a whole row per program, several rows when rows are short."""
    block_n = _next_pow2(num_cols)
    block_rows = max(1, _tile_elements() // block_n)
    return block_n, block_rows, _num_warps(block_n * block_rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float | None,
             residual: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    num_cols = x.shape[-1]
    if x.dtype not in _DTYPES or num_cols > MAX_NORM_COLS or not _check_device(x):
        return None
    if weight is not None and (weight.shape != (num_cols,) or weight.stride(0) != 1 or weight.device != x.device):
        return None
    if offset is None and (weight is None or weight.dtype != x.dtype):  # the reference would promote
        return None
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return None
    x_rows, heads, sxt, sxh = _rows(x)
    r_rows, r_heads, srt, srh = _rows(residual) if residual is not None else (x_rows, heads, 0, 0)
    if r_heads != heads:  # one of them is not a [tokens, heads, cols] view: address both alike
        r_rows = residual.reshape(x_rows.shape).contiguous()
        srt, srh = r_rows.stride(0), r_rows.stride(1) if r_rows.ndim == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else None
    num_rows = x.numel() // num_cols
    if num_rows:
        block_n, block_rows, num_warps = _norm_config(num_cols)
        pdl = pdl_enabled(x.device)
        _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            x_rows, r_rows, weight if weight is not None else x_rows,
            out, residual_out if residual is not None else out,
            num_rows, num_cols, heads, sxt, sxh, srt, srh, float(eps), float(offset or 0.0),
            BLOCK_ROWS=block_rows, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None, FP32_SCALE=offset is not None, PDL=pdl, num_warps=num_warps,
            **launch_options(pdl),
        )
    return out if residual is None else (out, residual_out)


def _rope_operand(x: torch.Tensor) -> bool:
    return x.ndim == 3 and x.stride(-1) == 1


def _rope_declines(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor | None) -> bool:
    """Whether the RoPE kernels cannot take these inputs (the reference then runs)."""
    if q.ndim != 3:
        return True
    num_tokens, _, head_dim = q.shape
    if q.dtype not in _DTYPES or head_dim % 2 or not _rope_operand(q) or not _check_device(q):
        return True
    if k is not None and (not _rope_operand(k) or k.dtype != q.dtype or k.shape[::2] != q.shape[::2]):
        return True
    if (cos.ndim != 2 or sin.ndim != 2 or cos.shape[-1] != head_dim or sin.shape[-1] != head_dim
            or cos.stride(-1) != 1 or sin.stride(-1) != 1 or not cos.is_floating_point()
            or not sin.is_floating_point()):
        return True
    if positions is not None and (positions.shape != (num_tokens,) or positions.stride(0) != 1
                                  or positions.is_floating_point()):
        return True
    return positions is None and cos.shape[0] != num_tokens


def _rope_tiles(head_dim: int) -> tuple[int, int, int, int]:
    """(HALF, BLOCK_HALF, BLOCK_R, num_warps) of the RoPE kernels: BLOCK_R half-rows per program."""
    half = head_dim // 2
    block_half = _next_pow2(half)
    block_r = max(1, _tile_elements() // block_half)
    return half, block_half, block_r, _num_warps(block_r * block_half)


def _kv_write_tiles(head_dim: int) -> tuple[int, int, int, int]:
    """``_rope_tiles`` with twice the warps: a program holds a tile of K rows, V rows and their
    angles (sm_90, head_dim 128: 234 registers a thread at 4 warps, 106 at 8)."""
    half, block_half, block_r, _ = _rope_tiles(head_dim)
    return half, block_half, block_r, _num_warps(2 * block_r * block_half)


def apply_rope(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if _rope_declines(q, k, cos, sin, positions):
        return None
    num_tokens, num_q_heads, head_dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k is not None else None
    if num_tokens:
        half, block_half, block_r, num_warps = _rope_tiles(head_dim)
        num_k_heads = k.shape[1] if k is not None else 0
        q_blocks = triton.cdiv(num_tokens * num_q_heads, block_r)
        k_blocks = triton.cdiv(num_tokens * num_k_heads, block_r)
        _rope_kernel[(q_blocks + k_blocks,)](
            q, k if k is not None else q, q_out, k_out if k is not None else q_out, cos, sin,
            positions if positions is not None else q,
            q.stride(0), q.stride(1), *(k.stride()[:2] if k is not None else (0, 0)), cos.stride(0), sin.stride(0),
            num_tokens, num_q_heads, num_k_heads, q_blocks,
            HALF=half, BLOCK_HALF=block_half, BLOCK_R=block_r, HAS_POSITIONS=positions is not None,
            num_warps=num_warps,
        )
    return q_out, k_out


def _cache_declines(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    write_blocks: torch.Tensor, write_offsets: torch.Tensor) -> bool:
    """Whether the K/V write kernel cannot take these inputs (the reference then runs)."""
    if k.ndim != 3 or v.shape != k.shape or not _rope_operand(k) or not _rope_operand(v):
        return True
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.dtype not in _DTYPES or v.dtype != k.dtype or head_dim % 2 or not _check_device(k):
        return True
    for cache in (k_cache, v_cache):
        if (cache.ndim != 4 or tuple(cache.shape[2:]) != (num_kv_heads, head_dim)
                or cache.dtype not in (k.dtype, fp8_format.FP8_DTYPE) or cache.dtype != k_cache.dtype
                or cache.device != k.device):
            return True
    if fp8_format.is_fp8(k_cache) and not fp8_format.fp8_kernels_run_on(k.device):
        return True  # Triton has no e4m3 before sm_89: the torch write
    return any(index.shape != (num_tokens,) or index.stride(0) != 1 or index.is_floating_point()
               or index.device != k.device for index in (write_blocks, write_offsets))


def rope_and_write_kv(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                      sin: torch.Tensor | None, positions: torch.Tensor | None, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, write_blocks: torch.Tensor, write_offsets: torch.Tensor,
                      scales: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """One launch: (q None) K/V rows copied into their slots, returning (None, k); else q and k
    rotated first, returning the new (q, k), the k being what the cache got."""
    if _cache_declines(k, v, k_cache, v_cache, write_blocks, write_offsets):
        return None
    rope = q is not None
    if rope and _rope_declines(q, k, cos, sin, positions):
        return None
    num_tokens, num_kv_heads, head_dim = k.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if rope else None
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if rope else k
    if num_tokens:
        half, block_half, block_r, num_warps = _kv_write_tiles(head_dim)
        num_q_heads = q.shape[1] if rope else 0
        q_blocks = triton.cdiv(num_tokens * num_q_heads, block_r)
        kv_blocks = triton.cdiv(num_tokens * num_kv_heads, block_r)
        pdl = pdl_enabled(k.device)
        _rope_write_kv_kernel[(q_blocks + kv_blocks,)](
            q if rope else k, k, v, q_out if rope else k, k_out, k_cache, v_cache,
            cos if rope else k, sin if rope else k, positions if positions is not None else k,
            write_blocks, write_offsets,
            *(q.stride()[:2] if rope else (0, 0)), *k.stride()[:2], *v.stride()[:2],
            *((cos.stride(0), sin.stride(0)) if rope else (0, 0)), *k_cache.stride(), *v_cache.stride(),
            num_tokens, num_q_heads, num_kv_heads, q_blocks, float(scales[0]), float(scales[1]),
            HALF=half, BLOCK_HALF=block_half, BLOCK_R=block_r, HAS_POSITIONS=positions is not None, ROPE=rope,
            FP8=fp8_format.is_fp8(k_cache), PDL=pdl, num_warps=num_warps, **launch_options(pdl),
        )
    return q_out, k_out


@functools.cache
def _act_config(num_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps)."""
    block_n = min(_tile_elements(), _next_pow2(num_cols))
    block_m = max(1, _tile_elements() // block_n)
    return block_m, block_n, _num_warps(block_m * block_n)


def act_and_mul(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    if (gate.dtype not in _DTYPES or up.dtype != gate.dtype or gate.shape != up.shape
            or activation not in ("silu", "gelu_pytorch_tanh") or not _check_device(gate)):
        return None
    gate_rows, _, sgt, _ = _rows(gate.reshape(-1, gate.shape[-1]))
    up_rows, _, sut, _ = _rows(up.reshape(-1, up.shape[-1]))
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    num_rows, num_cols = gate_rows.shape
    if out.numel():
        block_m, block_n, num_warps = _act_config(num_cols)
        pdl = pdl_enabled(gate.device)
        _act_and_mul_kernel[(triton.cdiv(num_rows, block_m), triton.cdiv(num_cols, block_n))](
            gate_rows, up_rows, out, num_rows, num_cols, sgt, sut,
            GELU=activation == "gelu_pytorch_tanh", BLOCK_M=block_m, BLOCK_N=block_n, PDL=pdl, num_warps=num_warps,
            **launch_options(pdl),
        )
    return out
