"""Chunked scans of a linear recurrence with one decay per head and token, in Triton, over a step's sequences.

Per head, the state ``h`` [P, N] (P value rows, N key columns) and, per token ``t``, a log-decay ``g_t <= 0``,
a weight ``w_t``, a key ``k_t`` and a query ``q_t`` [N] and a value ``v_t`` [P]::

    h_t = exp(g_t) h_{t-1} + w_t v_t k_t^T          y_t = h_t q_t

Mamba2's SSD is this with ``g = dt A``, ``w = dt``, ``k = B``, ``q = C``, ``v = x``, B and C shared by a group
of heads. Gated DeltaNet decays its state the same way (``g = -exp(A_log) softplus(a + dt_bias)``, one scalar
per head and token, keys and queries per group of value heads); its delta rule corrects each chunk's values by
the state entering the chunk, which its own kernel does, and then its output is ``chunk_output``'s with ``w = 1``.

Within chunks of ``Q`` tokens (``scan_chunks``: each sequence's own chunks, all sequences in one launch), with
``cum`` the running sum of ``g`` inside the chunk, the scan is five launches, each reusable alone:

1. ``chunk_cumsum``: ``w`` (from the raw time step: ``+ bias``, softplus, clamp) and ``cum`` per head and token.
2. ``chunk_qk``: ``q_t . k_s`` per chunk and group, [chunks, groups, Q, Q] (the causal tiles only).
3. ``chunk_states``: each chunk's own state from zero: ``sum_s exp(cum_last - cum_s) w_s v_s k_s^T``.
4. ``pass_states``: along each sequence's chunks, ``h_in(c + 1) = exp(cum_last(c)) h_in(c) + local(c)``, written
   over 3's output; the first ``h_in`` read from the sequence's state slot (zero when fresh), the last ``h``
   written back there.
5. ``chunk_output``: ``y_t = exp(cum_t) q_t h_in + sum_{s <= t} exp(cum_t - cum_s) (q_t . k_s) w_s v_s``, plus
   ``D v_t`` and times ``silu(z_t)`` when given (Mamba2's skip and its gated norm's gate).

Numerics: the decays, the state and every sum in fp32; the products' operands in the inputs' dtype (bf16 and
fp16 on tensor cores; fp32 as IEEE fp32 products, no TF32). Every exponent is <= 0. Shapes and strides are host
integers and nothing syncs; the chunk table is the only per-step input beyond the tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.ops.scan_chunks import CHUNK_FIELDS, SEQ_FIELDS, ScanChunks
from services.engine.ops.triton_ops import interpreting

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Warps per program, chosen by the sm_90 compile (tests/unit/engine/test_ssd_scan_kernel.py) at Granite-4.0-H-Tiny's
# shapes: no spills and ~100-130 registers (the output tile at 4 warps took 174-210).
QK_WARPS = 4
STATES_WARPS = 4
OUTPUT_WARPS = 8
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's: above it softplus(x) is x
_CF = tl.constexpr(CHUNK_FIELDS)
_SF = tl.constexpr(SEQ_FIELDS)


def scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An fp32 buffer between launches, left unfilled: every element a later launch reads is written first (the
    tests fill it with NaN to show that)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def tile(chunk_size: int) -> int:
    """Token rows per tile of a chunk (queries and keys alike): 64, or the chunk rounded up to a power of two."""
    return min(64, max(16, triton.next_power_of_2(chunk_size)))


def _precision(dtype: torch.dtype) -> str:
    """``DOT``: IEEE fp32 products for fp32 inputs; "upcast" under the interpreter (it cannot dot bfloat16);
    else the tensor cores' (bf16/fp16 products are exact, the precision argument unused)."""
    if interpreting():
        return "upcast"
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """``a @ b`` in fp32, as ``_precision`` chose."""
    if DOT == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT)


@triton.jit
def _chunk_row(Chunks, chunk):
    """(first token, tokens) of a chunk."""
    return tl.load(Chunks + chunk * _CF).to(tl.int64), tl.load(Chunks + chunk * _CF + 1)


@triton.jit(do_not_specialize=["num_tokens"])
def _chunk_cumsum_kernel(
    Dt, A, DtBias, Chunks, W, Cum, heads, num_tokens, stride_dt, dt_min, dt_max,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, A_IS_LOG: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
):
    """One chunk's ``BLOCK_H`` heads: ``w`` and the running sum of ``w a`` over the chunk's tokens."""
    chunk = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    start, n = _chunk_row(Chunks, chunk)
    t = tl.arange(0, BLOCK_Q)
    ok = (t < n)[:, None] & (h < heads)[None, :]
    w = tl.load(Dt + start * stride_dt + t[:, None] * stride_dt + h[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        w += tl.load(DtBias + h, mask=h < heads, other=0.0).to(tl.float32)[None, :]
    if SOFTPLUS:
        w = tl.where(w > SOFTPLUS_THRESHOLD, w, tl.maximum(w, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(w))))
    w = tl.where(ok, tl.minimum(tl.maximum(w, dt_min), dt_max), 0.0)
    a = tl.load(A + h, mask=h < heads, other=0.0).to(tl.float32)
    if A_IS_LOG:
        a = -tl.exp(a)
    cum = tl.cumsum(w * a[None, :], axis=0)
    offsets = h[None, :].to(tl.int64) * num_tokens + t[:, None]
    tl.store(W + start + offsets, w, mask=ok)
    tl.store(Cum + start + offsets, cum, mask=ok)


def chunk_cumsum(dt: torch.Tensor, a: torch.Tensor, table: ScanChunks, dt_bias: torch.Tensor | None = None,
                 softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                 a_is_log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``dt`` [tokens, heads] (the raw time step; heads contiguous), ``a`` [heads] (``-exp(a)`` when ``a_is_log``).
    Returns ``w`` and ``cum`` [heads, tokens] fp32: ``w = clamp(softplus(dt + bias))`` (each step optional),
    ``cum`` the running sum of ``w a`` within each chunk."""
    tokens, heads = dt.shape
    if tokens != table.num_tokens or dt.stride(1) != 1 or a.shape != (heads,):
        raise ValueError(f"dt {tuple(dt.shape)} (heads contiguous) / a {tuple(a.shape)} do not fit "
                         f"{table.num_tokens} tokens")
    w = scratch((heads, tokens), dt.device)
    cum = scratch((heads, tokens), dt.device)
    block_h = min(16, triton.next_power_of_2(heads))
    _chunk_cumsum_kernel[(table.num_chunks, triton.cdiv(heads, block_h))](
        dt, a, dt_bias if dt_bias is not None else a, table.chunks, w, cum, heads, tokens, dt.stride(0),
        float(dt_limit[0]), float(dt_limit[1]), BLOCK_Q=triton.next_power_of_2(table.chunk_size),
        BLOCK_H=block_h, A_IS_LOG=a_is_log, HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus,
    )
    return w, cum


@triton.jit
def _chunk_qk_kernel(
    Q, K, Chunks, QK, chunk_size, d_key, stride_q_t, stride_q_g, stride_k_t, stride_k_g,
    TILES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
):
    """One group's ``[BLOCK_T, BLOCK_T]`` tile of ``q k^T`` in one chunk; tiles above the diagonal are skipped
    (``chunk_output`` never reads them)."""
    chunk = tl.program_id(0)
    group = tl.program_id(1)
    tq = tl.program_id(2) // TILES
    ts = tl.program_id(2) % TILES
    start, n = _chunk_row(Chunks, chunk)
    t = tq * BLOCK_T + tl.arange(0, BLOCK_T)
    s = ts * BLOCK_T + tl.arange(0, BLOCK_T)
    q_rows = Q + start * stride_q_t + group * stride_q_g
    k_rows = K + start * stride_k_t + group * stride_k_g
    acc = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    keys = tl.where(ts <= tq, d_key, 0)
    for n0 in range(0, keys, BLOCK_N):
        kk = n0 + tl.arange(0, BLOCK_N)
        q = tl.load(q_rows + t[:, None] * stride_q_t + kk[None, :], mask=(t < n)[:, None] & (kk < d_key)[None, :],
                    other=0.0)
        k = tl.load(k_rows + s[:, None] * stride_k_t + kk[None, :], mask=(s < n)[:, None] & (kk < d_key)[None, :],
                    other=0.0)
        acc += _dot(q, tl.trans(k), DOT)
    base = (chunk.to(tl.int64) * tl.num_programs(1) + group) * chunk_size * chunk_size
    ok = (t < chunk_size)[:, None] & (s < chunk_size)[None, :] & (ts <= tq)
    tl.store(QK + base + t[:, None] * chunk_size + s[None, :], acc, mask=ok)


def chunk_qk(q: torch.Tensor, k: torch.Tensor, table: ScanChunks) -> torch.Tensor:
    """``q``/``k`` [tokens, groups, N] (N contiguous). Returns [chunks, groups, Q, Q] fp32 of ``q_t . k_s`` within
    each chunk, for ``s <= t`` tile-wise (entries of tiles above the diagonal are left unwritten)."""
    _check_rows(q, table, "q")
    _check_rows(k, table, "k")
    _, groups, d_key = q.shape
    size = table.chunk_size
    qk = scratch((table.num_chunks, groups, size, size), q.device)
    block_t = tile(size)
    tiles = triton.cdiv(size, block_t)
    _chunk_qk_kernel[(table.num_chunks, groups, tiles * tiles)](
        q, k, table.chunks, qk, size, d_key, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        TILES=tiles, BLOCK_T=block_t, BLOCK_N=min(64, triton.next_power_of_2(d_key)), DOT=_precision(q.dtype),
        num_warps=QK_WARPS,
    )
    return qk


@triton.jit(do_not_specialize=["num_tokens"])
def _chunk_states_kernel(
    V, K, W, Cum, Chunks, States, num_tokens, heads_per_group, d_value, d_key, n_blocks,
    stride_v_t, stride_v_h, stride_k_t, stride_k_g,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_W: tl.constexpr,
    DOT: tl.constexpr,
):
    """One chunk's head, a ``[BLOCK_P, BLOCK_N]`` tile of its own state: ``sum_s exp(cum_last - cum_s) w_s v_s
    k_s^T`` (v scaled in fp32, then rounded to the inputs' dtype for the product)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    p = (tl.program_id(2) // n_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    kk = (tl.program_id(2) % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = head // heads_per_group
    start, n = _chunk_row(Chunks, chunk)
    along = head.to(tl.int64) * num_tokens + start
    cum_last = tl.load(Cum + along + n - 1)
    v_rows = V + start * stride_v_t + head * stride_v_h
    k_rows = K + start * stride_k_t + group * stride_k_g
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for s0 in range(0, n, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < n
        scale = tl.exp(cum_last - tl.load(Cum + along + s, mask=s_ok, other=0.0))
        if HAS_W:
            scale *= tl.load(W + along + s, mask=s_ok, other=0.0)
        scale = tl.where(s_ok, scale, 0.0)
        v = tl.load(v_rows + s[:, None] * stride_v_t + p[None, :], mask=s_ok[:, None] & (p < d_value)[None, :],
                    other=0.0)
        k = tl.load(k_rows + s[:, None] * stride_k_t + kk[None, :], mask=s_ok[:, None] & (kk < d_key)[None, :],
                    other=0.0)
        v = (v.to(tl.float32) * scale[:, None]).to(k.dtype)
        acc += _dot(tl.trans(v), k, DOT)
    own = States + (chunk.to(tl.int64) * tl.num_programs(1) + head) * d_value * d_key
    tl.store(own + p[:, None] * d_key + kk[None, :], acc,
             mask=(p < d_value)[:, None] & (kk < d_key)[None, :])


def chunk_states(v: torch.Tensor, k: torch.Tensor, w: torch.Tensor | None, cum: torch.Tensor,
                 table: ScanChunks) -> torch.Tensor:
    """``v`` [tokens, heads, P], ``k`` [tokens, groups, N] (last dims contiguous, same dtype), ``w``/``cum``
    [heads, tokens] (``chunk_cumsum``'s; ``w`` None: 1). Returns each chunk's own state [chunks, heads, P, N] fp32."""
    _check_rows(v, table, "v")
    _check_rows(k, table, "k")
    _, heads, d_value = v.shape
    groups, d_key = k.shape[1:]
    if heads % groups or v.dtype != k.dtype or cum.shape != (heads, table.num_tokens):
        raise ValueError(f"v {tuple(v.shape)} {v.dtype} / k {tuple(k.shape)} {k.dtype} / cum {tuple(cum.shape)} "
                         "do not fit")
    states = scratch((table.num_chunks, heads, d_value, d_key), v.device)
    block_p = min(64, triton.next_power_of_2(d_value))
    block_n = min(64, triton.next_power_of_2(d_key))
    n_blocks = triton.cdiv(d_key, block_n)
    _chunk_states_kernel[(table.num_chunks, heads, triton.cdiv(d_value, block_p) * n_blocks)](
        v, k, w if w is not None else cum, cum, table.chunks, states, table.num_tokens, heads // groups, d_value,
        d_key, n_blocks, v.stride(0), v.stride(1), k.stride(0), k.stride(1), BLOCK_S=tile(table.chunk_size),
        BLOCK_P=block_p, BLOCK_N=block_n, HAS_W=w is not None, DOT=_precision(v.dtype), num_warps=STATES_WARPS,
    )
    return states


@triton.jit(do_not_specialize=["num_tokens"])
def _pass_states_kernel(
    States, Cum, Chunks, Seqs, Slots, heads, num_tokens, state_numel, stride_slot, stride_head,
    BLOCK_E: tl.constexpr,
):
    """One sequence's head, ``BLOCK_E`` elements of its state, carried from chunk to chunk. A sequence whose
    slot is negative has no state: it starts from zero and writes nothing back."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < state_numel
    slot = tl.load(Seqs + seq * _SF + 2).to(tl.int64)
    fresh = tl.load(Seqs + seq * _SF + 3) != 0
    first = tl.load(Seqs + seq * _SF + 4)
    count = tl.load(Seqs + seq * _SF + 5)
    valid = slot >= 0
    at = Slots + tl.where(valid, slot, 0) * stride_slot + head.to(tl.int64) * stride_head + e
    h = tl.load(at, mask=e_ok & valid & ~fresh, other=0.0).to(tl.float32)
    for chunk in range(first, first + count):
        start, n = _chunk_row(Chunks, chunk)
        decay = tl.exp(tl.load(Cum + head.to(tl.int64) * num_tokens + start + n - 1))
        local = States + (head.to(tl.int64) + chunk * heads) * state_numel + e
        own = tl.load(local, mask=e_ok, other=0.0)
        tl.store(local, h, mask=e_ok)
        h = h * decay + own
    tl.store(at, h, mask=e_ok & valid)


def pass_states(states: torch.Tensor, cum: torch.Tensor, table: ScanChunks, slots: torch.Tensor) -> None:
    """``states`` [chunks, heads, P, N] (``chunk_states``'s) become the states entering each chunk; ``slots``
    [num_slots, heads, P, N] fp32 (a state pool's view, each slot's [P, N] contiguous): each sequence's initial
    state is read from its slot (the zero state when fresh) and its final state written there."""
    _, heads, d_value, d_key = states.shape
    if slots.dtype != torch.float32 or slots.shape[1:] != states.shape[1:] or slots.stride(3) != 1 \
            or slots.stride(2) != d_key:
        raise ValueError(f"state slots {tuple(slots.shape)} {slots.dtype} must be float32 [slots, {heads}, "
                         f"{d_value}, {d_key}], each head's state contiguous")
    numel = d_value * d_key
    block_e = min(1024, triton.next_power_of_2(numel))
    _pass_states_kernel[(table.num_seqs, heads, triton.cdiv(numel, block_e))](
        states, cum, table.chunks, table.seqs, slots, heads, table.num_tokens, numel, slots.stride(0),
        slots.stride(1), BLOCK_E=block_e,
    )


def _check_rows(t: torch.Tensor, table: ScanChunks, name: str) -> None:
    if t.ndim != 3 or t.shape[0] != table.num_tokens or t.stride(2) != 1 or t.dtype not in DTYPES:
        raise ValueError(f"{name} must be [{table.num_tokens}, *, *] (last dim contiguous, fp16/bf16/fp32), got "
                         f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")


@triton.jit(do_not_specialize=["num_tokens"])
def _chunk_output_kernel(
    V, Qry, QK, W, Cum, States, Chunks, Dskip, Z, Y,
    num_tokens, heads_per_group, d_value, d_key, chunk_size, tiles,
    stride_v_t, stride_v_h, stride_q_t, stride_q_g, stride_z, stride_y,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_W: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, DOT: tl.constexpr,
):
    """One chunk's ``BLOCK_T`` tokens of one head, ``BLOCK_P`` value rows: the state entering the chunk read
    by the queries, then the causal tiles of keys up to these tokens (``chunk_qk``'s, same tile size)."""
    chunk = tl.program_id(0) // tiles
    tq = tl.program_id(0) % tiles
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < d_value
    group = head // heads_per_group
    start, n = _chunk_row(Chunks, chunk)
    t = tq * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n
    along = head.to(tl.int64) * num_tokens + start
    cum_t = tl.load(Cum + along + t, mask=t_ok, other=0.0)
    acc = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    h_in = States + (chunk.to(tl.int64) * tl.num_programs(1) + head) * d_value * d_key
    q_rows = Qry + start * stride_q_t + group * stride_q_g
    v_rows = V + start * stride_v_t + head * stride_v_h
    for n0 in range(0, d_key, BLOCK_N):
        kk = n0 + tl.arange(0, BLOCK_N)
        q = tl.load(q_rows + t[:, None] * stride_q_t + kk[None, :], mask=t_ok[:, None] & (kk < d_key)[None, :],
                    other=0.0)
        h = tl.load(h_in + p[None, :] * d_key + kk[:, None], mask=(kk < d_key)[:, None] & p_ok[None, :], other=0.0)
        acc += _dot(q, h.to(q.dtype), DOT)
    acc *= tl.exp(cum_t)[:, None]
    qk = QK + (chunk.to(tl.int64) * (tl.num_programs(1) // heads_per_group) + group) * chunk_size * chunk_size
    for s0 in range(0, tl.minimum((tq + 1) * BLOCK_T, n), BLOCK_T):
        s = s0 + tl.arange(0, BLOCK_T)
        s_ok = s < n
        causal = (t[:, None] >= s[None, :]) & s_ok[None, :] & t_ok[:, None]
        scores = tl.load(qk + t[:, None] * chunk_size + s[None, :], mask=causal, other=0.0)
        gap = cum_t[:, None] - tl.load(Cum + along + s, mask=s_ok, other=0.0)[None, :]
        scores *= tl.exp(tl.where(causal, gap, float("-inf")))
        if HAS_W:
            scores *= tl.load(W + along + s, mask=s_ok, other=0.0)[None, :]
        v = tl.load(v_rows + s[:, None] * stride_v_t + p[None, :], mask=s_ok[:, None] & p_ok[None, :], other=0.0)
        acc += _dot(tl.where(causal, scores, 0.0).to(v.dtype), v, DOT)
    ok = t_ok[:, None] & p_ok[None, :]
    if HAS_D:
        v_t = tl.load(v_rows + t[:, None] * stride_v_t + p[None, :], mask=ok, other=0.0)
        acc += tl.load(Dskip + head).to(tl.float32) * v_t.to(tl.float32)
    columns = head * d_value + p[None, :]
    if HAS_Z:
        z = tl.load(Z + start * stride_z + t[:, None] * stride_z + columns, mask=ok, other=0.0).to(tl.float32)
        acc *= z / (1.0 + tl.exp(-z))
    tl.store(Y + start * stride_y + t[:, None] * stride_y + columns, acc.to(Y.dtype.element_ty), mask=ok)


def chunk_output(v: torch.Tensor, q: torch.Tensor, qk: torch.Tensor, w: torch.Tensor | None, cum: torch.Tensor,
                 states: torch.Tensor, table: ScanChunks, d_skip: torch.Tensor | None = None,
                 z: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``y`` [tokens, heads * P] in ``out_dtype``: ``v`` [tokens, heads, P], ``q`` [tokens, groups, N] (last dims
    contiguous), ``qk`` (``chunk_qk``'s), ``w``/``cum`` (``chunk_cumsum``'s; ``w`` None: 1), ``states``
    (``pass_states``'s: entering each chunk); plus ``d_skip`` [heads] times ``v``, then times ``silu(z)`` with
    ``z`` [tokens, heads * P] (its columns contiguous), each when given."""
    _check_rows(v, table, "v")
    _check_rows(q, table, "q")
    tokens, heads, d_value = v.shape
    groups, d_key = q.shape[1:]
    if states.shape != (table.num_chunks, heads, d_value, d_key) or qk.shape[:2] != (table.num_chunks, groups):
        raise ValueError(f"states {tuple(states.shape)} / qk {tuple(qk.shape)} do not fit v {tuple(v.shape)} and "
                         f"q {tuple(q.shape)}")
    if z is not None and (z.shape != (tokens, heads * d_value) or z.stride(1) != 1):
        raise ValueError(f"z must be [{tokens}, {heads * d_value}] with contiguous columns, got {tuple(z.shape)}")
    y = torch.empty(tokens, heads * d_value, dtype=out_dtype, device=v.device)
    block_t = tile(table.chunk_size)
    tiles = triton.cdiv(table.chunk_size, block_t)
    block_p = min(64, triton.next_power_of_2(d_value))
    _chunk_output_kernel[(table.num_chunks * tiles, heads, triton.cdiv(d_value, block_p))](
        v, q, qk, w if w is not None else cum, cum, states, table.chunks, d_skip if d_skip is not None else cum,
        z if z is not None else y, y, table.num_tokens, heads // groups, d_value, d_key, table.chunk_size, tiles,
        v.stride(0), v.stride(1), q.stride(0), q.stride(1), z.stride(0) if z is not None else 0, y.stride(0),
        BLOCK_T=block_t, BLOCK_P=block_p, BLOCK_N=min(128, triton.next_power_of_2(d_key)), HAS_W=w is not None,
        HAS_D=d_skip is not None, HAS_Z=z is not None, DOT=_precision(v.dtype), num_warps=OUTPUT_WARPS,
    )
    return y
