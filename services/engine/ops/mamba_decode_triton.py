"""Mamba2's one-token decode step in two Triton launches, states read and written in place in their slots.

The torch step (``models/mamba2.py``, the CPU path and the reference) is some thirty kernels a layer: the
conv windows gathered from the pool and scattered back, the SSM states likewise (two full copies of every
state), the group rows of B and C repeated per head, and each elementwise op its own launch. Here:

1. ``conv_update``: per row and block of channels, the window ``[state | x]`` dotted with the conv weight,
   plus the bias, SiLU; the window shifted one step in place in the row's slot. Output fp32 ``[rows,
   channels]``. Nothing in it is Mamba-specific: a Gated DeltaNet's short convs over q, k, v are the same.
2. ``selective_update``: per row, head and block of ``head_dim``: ``dt = softplus(dt + dt_bias)`` clamped,
   ``dA = exp(dt * A)``, the state tile ``h = h * dA + dt * x B^T`` updated in place, ``y = h C + D x``,
   times ``silu(z)`` when ``z`` is given (the gated norm's gate; the norm itself, a reduction across heads,
   stays with the model). B and C are read per group, not repeated per head.

Numerics: fp32 throughout (the conv's products and sums, the state), inputs bf16, fp16 or fp32; the torch
step rounds the conv to the conv state's dtype before SiLU, this does not. A batch row whose slot is negative
is padding (``state_slots_triton``): its states are not touched and its outputs are 0.

No host syncs and no data-dependent shapes (CUDA-graph safe); programmatic dependent launch where enabled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.ops.state_slots_triton import check_slots, load_slot, state_strides, state_tile_offsets
from services.engine.triton_pdl import launch_options, pdl_enter
from services.engine.triton_support import pdl_enabled

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CONV_BLOCK = 128  # channels per conv program
CONV_WARPS = 4
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's: above it softplus(x) is x


@triton.jit(do_not_specialize=["num_rows"])
def _conv_update_kernel(
    X, State, Slots, Weight, Bias, Out,
    num_rows, channels, stride_x, stride_state_slot, stride_state_ch, stride_out,
    D_CONV: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr, PDL: tl.constexpr,
):
    """One row's ``BLOCK_C`` channels. The window is [the state's D_CONV - 1 columns | x]; the new state is the
    window's last D_CONV - 1 columns. Both are loaded before the barrier, stored after it: other threads of the
    program read the addresses this one overwrites."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, BLOCK_K)
    slot, valid = load_slot(Slots, row)
    ch_ok = (ch < channels) & valid
    is_x = (k == D_CONV - 1)[None, :]
    x = tl.load(X + row * stride_x + ch, mask=ch_ok, other=0.0).to(tl.float32)
    state = State + slot * stride_state_slot + ch[:, None].to(tl.int64) * stride_state_ch
    in_state = ch_ok[:, None] & (k < D_CONV - 1)[None, :]
    window = tl.load(state + k[None, :], mask=in_state, other=0.0).to(tl.float32)
    window = tl.where(is_x, x[:, None], window)
    shifted_in_state = ch_ok[:, None] & (k < D_CONV - 2)[None, :]
    shifted = tl.load(state + k[None, :] + 1, mask=shifted_in_state, other=0.0)
    shifted = tl.where((k == D_CONV - 2)[None, :], x[:, None].to(shifted.dtype), shifted)
    w_ok = (ch < channels)[:, None] & (k < D_CONV)[None, :]
    w = tl.load(Weight + ch[:, None] * D_CONV + k[None, :], mask=w_ok, other=0.0).to(tl.float32)
    acc = tl.sum(window * w, axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + ch, mask=ch < channels, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.debug_barrier()
    tl.store(state + k[None, :], shifted.to(State.dtype.element_ty), mask=in_state)
    tl.store(Out + row * stride_out + ch, tl.where(valid, acc, 0.0), mask=ch < channels)


def conv_update(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, silu: bool = True) -> torch.Tensor:
    """One causal depthwise conv step: ``x`` [rows, channels] (rows may be strided, a slice of a projection),
    ``conv_state`` [slots, channels, d_conv - 1] (updated in place in rows ``slots``), ``weight`` [channels,
    d_conv] contiguous, ``bias`` [channels] or None. Returns the conv output [rows, channels] fp32 (SiLU'd)."""
    rows, channels = x.shape
    d_conv = weight.shape[1]
    stride_slot, stride_ch, _ = state_strides(conv_state, 3, "conv_state")
    if conv_state.shape[1:] != (channels, d_conv - 1) or weight.shape[0] != channels or not weight.is_contiguous():
        raise ValueError(f"conv_state {tuple(conv_state.shape)} / weight {tuple(weight.shape)} do not fit x's "
                         f"{channels} channels")
    if x.stride(1) != 1:
        raise ValueError("x's channels must be contiguous")
    check_slots(slots, rows, conv_state)
    out = torch.empty(rows, channels, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    pdl = pdl_enabled(x.device)
    _conv_update_kernel[(rows, triton.cdiv(channels, CONV_BLOCK))](
        x, conv_state, slots, weight, bias if bias is not None else weight, out,
        rows, channels, x.stride(0), stride_slot, stride_ch, out.stride(0),
        D_CONV=d_conv, BLOCK_C=CONV_BLOCK, BLOCK_K=triton.next_power_of_2(d_conv), HAS_BIAS=bias is not None,
        SILU=silu, PDL=pdl, num_warps=CONV_WARPS, **launch_options(pdl),
    )
    return out


@triton.jit(do_not_specialize=["num_rows"])
def _selective_update_kernel(
    XBC, Dt, Z, State, Slots, DtBias, ALog, Dskip, Y,
    num_rows, heads_per_group, head_dim, d_state, n_groups, dt_min, dt_max,
    stride_xbc, stride_dt, stride_z, stride_state_slot, stride_state_head, stride_state_p, stride_y,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, HAS_Z: tl.constexpr, PDL: tl.constexpr,
):
    """One row's head, rows ``BLOCK_P`` of its ``[head_dim, d_state]`` state. ``XBC`` is the conv output:
    x (heads x head_dim), then B and C (n_groups x d_state each)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    slot, valid = load_slot(Slots, row)
    p_ok = (p < head_dim) & valid
    d_ok = (d < d_state) & valid
    group = head // heads_per_group
    inner = heads_per_group * n_groups * head_dim
    dt = tl.load(Dt + row * stride_dt + head, mask=valid, other=0.0).to(tl.float32)
    dt += tl.load(DtBias + head).to(tl.float32)
    dt = tl.where(dt > SOFTPLUS_THRESHOLD, dt, tl.maximum(dt, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(dt))))  # softplus
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * -tl.exp(tl.load(ALog + head).to(tl.float32)))
    xbc = XBC + row * stride_xbc
    x = tl.load(xbc + head * head_dim + p, mask=p_ok, other=0.0)
    b = tl.load(xbc + inner + group * d_state + d, mask=d_ok, other=0.0)
    c = tl.load(xbc + inner + (n_groups + group) * d_state + d, mask=d_ok, other=0.0)
    offsets = state_tile_offsets(slot, head, p, d, stride_state_slot, stride_state_head, stride_state_p)
    tile_ok = p_ok[:, None] & d_ok[None, :]
    h = tl.load(State + offsets, mask=tile_ok, other=0.0)
    h = h * decay + (dt * x)[:, None] * b[None, :]
    tl.store(State + offsets, h, mask=tile_ok)
    y = tl.sum(h * c[None, :], axis=1) + tl.load(Dskip + head).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(Z + row * stride_z + head * head_dim + p, mask=p_ok, other=0.0).to(tl.float32)
        y = y * (z / (1.0 + tl.exp(-z)))
    tl.store(Y + row * stride_y + head * head_dim + p, tl.where(valid, y, 0.0), mask=p < head_dim)


def ssm_tile(rows: int, heads: int, head_dim: int, d_state: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps): tiles of at most 4096 state elements, halved while the grid has fewer than 512
    programs (a batch of one fills an H200's 132 SMs only with small tiles; every tile is read once anyway), a
    warp per 512 elements (2 to 8): 16 elements a thread compile to ~100 registers for sm_90, 32 to 215."""
    block_d = triton.next_power_of_2(d_state)
    block_p = max(1, min(triton.next_power_of_2(head_dim), 4096 // block_d))
    while block_p > 4 and rows * heads * triton.cdiv(head_dim, block_p) < 512:
        block_p //= 2
    return block_p, _warps(block_p, block_d)


def _warps(block_p: int, block_d: int) -> int:
    return min(8, max(2, block_p * block_d // 512))


def selective_update(xbc: torch.Tensor, dt: torch.Tensor, z: torch.Tensor | None, ssm_state: torch.Tensor,
                     slots: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, d_skip: torch.Tensor,
                     n_groups: int, dt_limit: tuple[float, float] = (0.0, float("inf")),
                     block_p: int | None = None) -> torch.Tensor:
    """One selective-scan step: ``xbc`` [rows, heads * head_dim + 2 * n_groups * d_state] (the conv output, x then
    B then C), ``dt`` [rows, heads], ``z`` [rows, heads * head_dim] or None, ``ssm_state`` [slots, heads,
    head_dim, d_state] fp32 (updated in place in rows ``slots``), ``dt_bias``/``a_log``/``d_skip`` [heads].
    Returns y [rows, heads * head_dim] fp32, times ``silu(z)`` when ``z`` is given. ``block_p``: the tile's
    rows (default ``ssm_tile``'s), for benchmarks."""
    rows = xbc.shape[0]
    _, heads, head_dim, d_state = ssm_state.shape
    strides = state_strides(ssm_state, 4, "ssm_state")
    if ssm_state.dtype != torch.float32:
        raise ValueError(f"ssm_state must be float32, got {ssm_state.dtype}")
    if heads % n_groups or xbc.shape[1] != heads * head_dim + 2 * n_groups * d_state or xbc.stride(1) != 1:
        raise ValueError(f"xbc {tuple(xbc.shape)} does not fit {heads} heads of {head_dim} and {n_groups} groups "
                         f"of {d_state} (channels contiguous)")
    if dt.shape != (rows, heads) or dt.stride(1) != 1 or (z is not None and (z.shape != (rows, heads * head_dim)
                                                                           or z.stride(1) != 1)):
        raise ValueError(f"dt {tuple(dt.shape)} / z must be [rows, heads] / [rows, heads * head_dim], inner dims "
                         "contiguous")
    check_slots(slots, rows, ssm_state)
    y = torch.empty(rows, heads * head_dim, dtype=torch.float32, device=xbc.device)
    if rows == 0:
        return y
    block_p = block_p or ssm_tile(rows, heads, head_dim, d_state)[0]
    num_warps = _warps(block_p, triton.next_power_of_2(d_state))
    pdl = pdl_enabled(xbc.device)
    _selective_update_kernel[(rows, heads, triton.cdiv(head_dim, block_p))](
        xbc, dt, z if z is not None else y, ssm_state, slots, dt_bias, a_log, d_skip, y,
        rows, heads // n_groups, head_dim, d_state, n_groups, float(dt_limit[0]), float(dt_limit[1]),
        xbc.stride(0), dt.stride(0), z.stride(0) if z is not None else 0, strides[0], strides[1], strides[2],
        y.stride(0), BLOCK_P=block_p, BLOCK_D=triton.next_power_of_2(d_state), HAS_Z=z is not None, PDL=pdl,
        num_warps=num_warps, **launch_options(pdl),
    )
    return y
