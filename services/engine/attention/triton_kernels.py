"""Triton kernels of ``triton_paged`` and ``triton_mla``: paged flash attention (optionally split over
the keys), the split-K reduction, and absorbed latent attention (``_mla_kernel``). Imported only when
one of those backends is used.

Interpreter or compiler: Triton decides inside ``triton.jit``, at decoration time, from
``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``), and its own library functions
(``tl.max``, ``tl.sum``, ``tl.cdiv``) are decorated when ``triton.language`` is first imported. So
interpreted kernels (the only way to run on CPU tensors) need ``TRITON_INTERPRET=1`` in the
environment before anything imports triton, and then every kernel of the process is interpreted.
The kernels here are plain functions wrapped on first use by ``kernels``, which checks that mode:
CPU tensors without it are a clear error instead of a failure deep inside a launch.

One program of ``_attention_kernel`` owns (request, tile of query tokens, KV head, split)::

    tile rows (BLOCK_M) = TOKENS_PER_TILE tokens x GROUP query heads of one KV head
        row m -> token first_tok + m // GROUP, query head kv_head * GROUP + m % GROUP

so each K/V tile read from the cache serves every query head of its KV head (GQA folded into M;
a decode row of Llama-3-8B is 4 rows of a 16-row tile). Keys are walked BLOCK_N at a time; each
key's page comes from the block table (``page = table[n // BLOCK_SIZE]``, slot ``n % BLOCK_SIZE``)
and its address from the view's four strides, so any [num_blocks, block_size, kv_heads, head_dim]
view works (NHD/HND, per-layer/cross-layer) and nothing is gathered. Scores use an online softmax
in base 2 (flash-attention style); keys past a row's position, older than the window, or outside
the program's range get -inf. Only the keys some row of the tile can see are visited: from the
window start of the tile's first token to the tile's last token.

With ``MODES`` (a ``DensePlan``: long prefill chunks whose fresh tokens a dense kernel already
attended to, its output in ``Out`` and its log-sum-exp in ``Lse``) each request has a mode: paged
as above, prefix only (keys before the chunk, then the two halves merged by their log-sum-exp in
the epilogue), or skipped (no prefix: the dense half is the answer).

With ``SPLIT`` the visited key range is cut into ``num_splits`` contiguous parts (multiples of
BLOCK_N), one per program; each stores its unnormalised accumulator, running max and sum, and
``_reduce_kernel`` merges them (flash-decoding). The partition is computed from the request's
own lengths, read on the device, so a decode graph captured for a context bucket splits each
request's real context evenly.

With ``FP8`` (an e4m3 cache, ``ops.kv_fp8``) each K/V tile is cast to q's dtype as it is loaded (exact: every
e4m3 value is a float16/bfloat16/float32 value) and the layer's scales are applied where they are one
number: the k scale folded into ``qk_scale`` on the host (a score is linear in its key), the v scale once
on the accumulator after the key loop (every value of the weighted sum carries it), before any split or
dense merge. Without ``FP8`` the kernels are what they were: the branches are constexpr.

With ``SINKS`` (gpt-oss) each query head has a learned logit that joins its softmax with a zero value: it adds
``exp(sink)`` to the denominator once, where the row's sum is final (the unsplit epilogue, the dense merge, or
``_reduce_kernel`` after the splits), never per split.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from services.engine.triton_pdl import pdl_enter

LOG2E = 1.4426950408889634  # for the host
_LOG2E = tl.constexpr(LOG2E)  # for the kernels
# Row reductions, rebound under the interpreter by ``kernels`` (see ``_fast_interpreter_reductions``).
_max = tl.max
_sum = tl.sum


def _attention_kernel(
    Q, K, V, Out, PartAcc, PartMax, PartSum,
    BlockTables, QueryStart, ContextLens,
    Modes, Lse,  # used with MODES: per-request mode, and the dense half's log-sum-exp (natural log)
    Sinks,  # used with SINKS: float32 [heads], each head's sink logit (natural log, unscaled)
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    stride_lh, stride_lt,
    num_heads, num_splits, q_tiles,
    qk_scale,  # scale * log2(e); with SOFTCAP, scale alone
    softcap,  # used with SOFTCAP
    window,  # used with WINDOW
    v_scale,  # used with FP8 (the k scale is folded into qk_scale on the host)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache page
    GROUP: tl.constexpr,  # query heads per KV head
    TOKENS_PER_TILE: tl.constexpr,  # BLOCK_M // GROUP
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    MODES: tl.constexpr,  # a DensePlan's per-request modes: 0 paged, 1 prefix then merge, 2 skip
    FP8: tl.constexpr,  # K/V pages are e4m3: cast to q's dtype on load, scores and output scaled (see above)
    SINKS: tl.constexpr,  # a sink logit per head joins the softmax's denominator (unsplit epilogue or the reduce)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32 rounding); 16-bit inputs ignore it
    PDL: tl.constexpr,  # programmatic dependent launch (``triton_pdl``)
):
    pdl_enter(PDL, not SPLIT)  # split: the reduce follows, with nothing to load before it waits
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = pid // q_tiles
    tile = pid % q_tiles
    mode = tl.load(Modes + req) if MODES else 0
    if mode == 2:
        return

    q_start = tl.load(QueryStart + req)
    q_len = tl.load(QueryStart + req + 1) - q_start
    first_tok = tile * TOKENS_PER_TILE
    if first_tok >= q_len:
        return
    ctx = tl.load(ContextLens + req).to(tl.int32)
    first_pos = ctx - q_len  # position of the request's first query token

    rows = tl.arange(0, BLOCK_M)
    tok_in_req = first_tok + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < TOKENS_PER_TILE) & (tok_in_req < q_len)
    pos = first_pos + tok_in_req
    token = (q_start + tok_in_req).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys some row of this tile can see: [k_lo, k_hi).
    last_tok = tl.minimum(q_len, first_tok + TOKENS_PER_TILE) - 1
    k_hi = first_pos + last_tok + 1
    if mode == 1:  # the fresh tokens were attended densely: only the prefix is left
        k_hi = first_pos
    k_lo = tl.maximum(first_pos + first_tok - window + 1, 0) if WINDOW else 0
    start = (k_lo // BLOCK_N) * BLOCK_N
    per_split = ((k_hi - start + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    s_lo = start + split * per_split
    s_hi = tl.minimum(k_hi, s_lo + per_split)

    table = BlockTables + req.to(tl.int64) * stride_bt
    k_head = K + kv_head.to(tl.int64) * stride_kh
    v_head = V + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        n = n0 + cols
        n_ok = (n >= k_lo) & (n < s_hi)
        page = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = (n % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + page[:, None] * stride_kb + slot[:, None] * stride_ks + d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        if FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFTCAP:
            # softcap * tanh(s * scale / softcap), tanh from exp(-2|x|) (no overflow), then to base 2.
            x = s * qk_scale / softcap
            e = tl.exp2(tl.abs(x) * (-2.0 * _LOG2E))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * (softcap * _LOG2E)
        else:
            s = s * qk_scale
        visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        if WINDOW:
            visible = visible & (n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, _max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + _sum(p, 1)
        v = tl.load(v_head + page[:, None] * stride_vb + slot[:, None] * stride_vs + d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        if FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if FP8:
        acc = acc * v_scale  # every value of the sum carries the one scale: applied once, before any merge

    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = (token * num_heads + head) * num_splits + split
        tl.store(PartAcc + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(PartMax + part, m_i, mask=row_ok)
        tl.store(PartSum + part, l_i, mask=row_ok)
    else:
        out_ptrs = Out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
        # A sink is one more logit with a zero value: it only adds exp(sink) to the denominator (base 2 here).
        if SINKS:
            sink = tl.load(Sinks + head, mask=row_ok, other=0.0) * _LOG2E
        else:
            sink = tl.full([BLOCK_M], float("-inf"), tl.float32)
        if mode == 1:
            # Merge with the dense half in Out: both halves weighted by their sums of exp (base 2),
            # the prefix's kept as (acc, m_i, l_i) unnormalised, the dense half's as its LSE.
            dense = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
            lse = tl.load(Lse + head * stride_lh + token * stride_lt, mask=row_ok, other=0.0) * _LOG2E
            top = tl.maximum(tl.maximum(m_i, lse), sink)
            w_prefix = tl.exp2(m_i - top)
            w_dense = tl.exp2(lse - top)
            denom = l_i * w_prefix + w_dense + tl.exp2(sink - top)
            out = (acc * w_prefix[:, None] + dense * w_dense[:, None]) / denom[:, None]
        elif SINKS:
            top = tl.maximum(m_i, sink)
            w = tl.exp2(m_i - top)
            out = acc * w[:, None] / (l_i * w + tl.exp2(sink - top))[:, None]
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=out_mask)


def _reduce_kernel(
    Out, PartAcc, PartMax, PartSum,
    Sinks,  # used with SINKS: float32 [heads] sink logits (natural log)
    stride_ot, stride_oh, stride_od,
    num_heads, num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,  # num_splits rounded up to a power of two
    SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the splits of one (token, query head): weights exp2(max_s - max), divided by the total sum (plus the
    head's sink, with SINKS)."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    s_ok = s < num_splits
    part = (token * num_heads + head) * num_splits + s
    m = tl.load(PartMax + part, mask=s_ok, other=float("-inf"))
    total = tl.load(PartSum + part, mask=s_ok, other=0.0)
    m_max = _max(m, 0)
    if SINKS:
        sink = tl.load(Sinks + head) * _LOG2E
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # an empty split (max -inf) weighs 0
    denom = _sum(total * w, 0)
    if SINKS:
        denom += tl.exp2(sink - m_max)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(PartAcc + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = _sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(Out + token * stride_ot + head * stride_oh + d * stride_od, out.to(Out.dtype.element_ty), mask=d_ok)


def _mla_kernel(
    Q, Rows, Out, PartAcc, PartMax, PartSum,
    BlockTables, QueryStart, ContextLens,
    stride_qt, stride_qh, stride_qd,
    stride_rb, stride_rs, stride_rd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    num_heads, num_splits, q_tiles,
    qk_scale,  # scale * log2(e); with FP8 times the row scale
    row_scale,  # used with FP8: what the latent values are multiplied by
    BLOCK_SIZE: tl.constexpr,  # tokens per cache page
    HEADS: tl.constexpr,  # query heads per tile (a power of two)
    TOKENS_PER_TILE: tl.constexpr,  # BLOCK_M // HEADS
    LATENT: tl.constexpr,  # the latent part of a row (keys and values)
    BLOCK_L: tl.constexpr,  # LATENT rounded up to a power of two
    ROPE: tl.constexpr,  # the rope part of a row (keys only)
    BLOCK_R: tl.constexpr,  # ROPE rounded up to a power of two (>= 16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    FP8: tl.constexpr,  # rows are e4m3: cast to q's dtype on load, scores and output scaled
    DOT_PRECISION: tl.constexpr,
):
    """Absorbed multi-head latent attention: every query head against one shared row per key.

    Rows are ``[latent | rope]``; a key's score for a row m is ``q_lat . latent + q_rope . rope`` and its
    value is the latent itself, so each latent tile is loaded once and serves both dots. Programs own
    (request, tile of query tokens, tile of heads, split) with rows m -> token ``first_tok + m // HEADS``,
    head ``head_tile * HEADS + m % HEADS``; the masks, the online softmax (base 2) and the split partials
    are those of ``_attention_kernel`` (``_reduce_kernel`` merges the splits, with HEAD_DIM = LATENT).
    """
    pid = tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    req = pid // q_tiles
    tile = pid % q_tiles
    q_start = tl.load(QueryStart + req)
    q_len = tl.load(QueryStart + req + 1) - q_start
    first_tok = tile * TOKENS_PER_TILE
    if first_tok >= q_len:
        return
    ctx = tl.load(ContextLens + req).to(tl.int32)
    first_pos = ctx - q_len

    rows = tl.arange(0, BLOCK_M)
    tok_in_req = first_tok + rows // HEADS
    head = head_tile * HEADS + rows % HEADS
    row_ok = (rows // HEADS < TOKENS_PER_TILE) & (tok_in_req < q_len) & (head < num_heads)
    pos = first_pos + tok_in_req
    token = (q_start + tok_in_req).to(tl.int64)
    lat = tl.arange(0, BLOCK_L)
    lat_ok = lat < LATENT
    rope = tl.arange(0, BLOCK_R)
    rope_ok = rope < ROPE
    q_row = Q + token[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(q_row + lat[None, :] * stride_qd, mask=row_ok[:, None] & lat_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + (LATENT + rope)[None, :] * stride_qd, mask=row_ok[:, None] & rope_ok[None, :],
                     other=0.0)

    last_tok = tl.minimum(q_len, first_tok + TOKENS_PER_TILE) - 1
    k_hi = first_pos + last_tok + 1
    per_split = ((k_hi + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    s_lo = split * per_split
    s_hi = tl.minimum(k_hi, s_lo + per_split)

    table = BlockTables + req.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        n = n0 + cols
        n_ok = n < s_hi
        page = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        key = Rows + page[:, None] * stride_rb + (n % BLOCK_SIZE).to(tl.int64)[:, None] * stride_rs
        latent = tl.load(key + lat[None, :] * stride_rd, mask=n_ok[:, None] & lat_ok[None, :], other=0.0)
        k_rope = tl.load(key + (LATENT + rope)[None, :] * stride_rd, mask=n_ok[:, None] & rope_ok[None, :],
                         other=0.0)
        if FP8:
            latent = latent.to(q_lat.dtype)
            k_rope = k_rope.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        s = s * qk_scale
        s = tl.where((n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, _max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + _sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        m_i = m_new
    if FP8:
        acc = acc * row_scale

    out_mask = row_ok[:, None] & lat_ok[None, :]
    if SPLIT:
        part = (token * num_heads + head) * num_splits + split
        tl.store(PartAcc + part[:, None] * LATENT + lat[None, :], acc, mask=out_mask)
        tl.store(PartMax + part, m_i, mask=row_ok)
        tl.store(PartSum + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + lat[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=out_mask)


class Kernels(NamedTuple):
    attention: Any
    reduce: Any
    mla: Any


_KERNELS: list[Kernels] = []


def interpreting() -> bool:
    """Whether triton.language was imported in interpreter mode (TRITON_INTERPRET=1 at the time)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.cdiv, InterpretedFunction)


def _fast_interpreter_reductions() -> None:
    """The interpreter runs ``tl.max``/``tl.sum`` as interpreted library calls, re-patching the
    language on every call (milliseconds each); ``tl.reduce`` with the library's own combine
    functions takes its numpy path instead, with the same result. Halves the tests' kernel time."""
    global _max, _sum
    max_combine = getattr(tl.standard, "_elementwise_max", None)
    sum_combine = getattr(tl.standard, "_sum_combine", None)
    if max_combine is not None and sum_combine is not None:
        _max = lambda x, axis: tl.reduce(x, axis, max_combine)
        _sum = lambda x, axis: tl.reduce(x, axis, sum_combine)


def kernels(device_type: str) -> Kernels:
    """The kernels, compiled, or interpreted under TRITON_INTERPRET=1."""
    if device_type == "cpu" and not interpreting():
        raise RuntimeError(
            "triton_paged on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 in the environment "
            "before triton is first imported")
    if not _KERNELS:
        if interpreting():
            _fast_interpreter_reductions()
        _KERNELS.append(Kernels(triton.jit(_attention_kernel), triton.jit(_reduce_kernel), triton.jit(_mla_kernel)))
    return _KERNELS[0]
