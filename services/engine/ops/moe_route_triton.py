"""Triton kernels of ``moe_fused``'s routing: the router's scores to each token's experts and weights, and the
(token, expert) pairs sorted by expert for the grouped GEMMs, in one launch for a decode step and two for prefill,
with no host sync (a step with them is captured in a CUDA graph).

**Route** (``_route_kernel``, one program per ``BLOCK_T`` tokens, all experts of a token in one tile): the router's
logits to scores (``SCORE``: the logits themselves, softmax over every expert, or sigmoid), plus the correction
bias for the choice only (DeepSeek-V3), the group limit (a group's merit is the sum of its two best choice scores;
only the ``TOPK_GROUP`` best groups keep their experts), then ``TOP_K`` rounds of "highest remaining, the lowest
index among equals" (``torch.topk``'s order, descending; a NaN score ranks below every other, so a padding row full
of NaN still picks valid experts), then the weights: a softmax over the chosen logits, or the chosen scores renormalised
(``renorm_eps`` added to the sum, as DeepSeek adds 1e-20) and scaled.

**Align**: pair ``p = t * TOP_K + j`` goes to sorted row ``start[e] + (pairs of expert e before p)``: within a chunk
of tokens a cumulative sum over the tile, across chunks each chunk's expert counts (``Hist`` [chunks, E]).
``SINGLE`` (one chunk: every decode batch up to 32 tokens) places the pairs in the routing launch itself;
otherwise the routing launch writes the counts and each pair's rank in its chunk and ``_place_kernel`` adds the
chunks before it. Outputs: ``sorted_pairs`` [P] (each sorted row's pair), ``pos_of_pair`` [P] (its inverse), ``ends``
[E] (each expert's end row). ``_count_kernel`` is the align alone for experts chosen elsewhere (any ids, repeats
within a token included).
"""

from __future__ import annotations

import triton
import triton.language as tl

SCORE_LOGITS, SCORE_SOFTMAX, SCORE_SIGMOID = 0, 1, 2


@triton.jit
def _group_limit(choice, e, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):
    """``choice`` with -inf for the experts outside each token's ``TOPK_GROUP`` best groups (a group's merit: its
    two best choice scores summed, a tie for the best counting twice, as ``topk(2).values.sum()``)."""
    g_idx = tl.arange(0, BLOCK_G)
    merit = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
    group = e // GROUP_SIZE
    for g in tl.static_range(N_GROUP):
        vals = tl.where((group == g)[None, :], choice, float("-inf"))
        best = tl.max(vals, 1)
        first = tl.min(tl.where(vals == best[:, None], e[None, :], BLOCK_E), 1)
        second = tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), vals), 1)
        merit = tl.where(g_idx[None, :] == g, (best + second)[:, None], merit)
    kept = tl.zeros((BLOCK_T, BLOCK_G), tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        left = tl.where(kept, float("-inf"), merit)
        best = tl.max(left, 1)
        pick = tl.min(tl.where(~kept & (g_idx[None, :] < N_GROUP) & (left == best[:, None]), g_idx[None, :],
                               BLOCK_G), 1)
        kept = kept | (g_idx[None, :] == pick[:, None])
    allowed = tl.zeros((BLOCK_T, BLOCK_E), tl.int1)
    for g in tl.static_range(N_GROUP):
        kept_g = tl.sum(tl.where(g_idx[None, :] == g, kept.to(tl.int32), 0), 1) > 0
        allowed = allowed | (kept_g[:, None] & (group == g)[None, :])
    return tl.where(allowed, choice, float("-inf"))


@triton.jit
def _scores(Logits, t, t_ok, e, e_ok, stride_lt, SCORE: tl.constexpr):
    """The tile's scores [BLOCK_T, BLOCK_E] in fp32 (0 past the experts)."""
    logits = tl.load(Logits + t[:, None].to(tl.int64) * stride_lt + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                     other=0.0).to(tl.float32)
    if SCORE == 1:  # softmax over every expert
        top = tl.max(tl.where(e_ok[None, :], logits, float("-inf")), 1)
        ex = tl.where(e_ok[None, :], tl.exp(logits - top[:, None]), 0.0)
        return ex / tl.sum(ex, 1)[:, None]
    if SCORE == 2:
        return 1.0 / (1.0 + tl.exp(-logits))
    return logits


@triton.jit
def _weights(vals, kk, renorm_eps, scale, TOP_K: tl.constexpr, SCORE: tl.constexpr, RENORM: tl.constexpr):
    """The chosen slots' weights [BLOCK_T, BLOCK_K] from their scores (slots past TOP_K: 0)."""
    live = kk[None, :] < TOP_K
    if SCORE == 0:  # a softmax over the chosen logits
        top = tl.max(tl.where(live, vals, float("-inf")), 1)
        ex = tl.exp(tl.where(live, vals - top[:, None], float("-inf")))
        w = ex / tl.sum(ex, 1)[:, None]
    else:
        w = tl.where(live, vals, 0.0)
        if RENORM:
            w = w / (tl.sum(w, 1)[:, None] + renorm_eps)
    return w * scale


@triton.jit
def _starts(hist):
    """Each expert's first sorted row, from the counts."""
    return tl.cumsum(hist, 0) - hist


@triton.jit
def _route_kernel(Logits, Bias, Weights, Ids, Hist, Rank, SortedPairs, PosOfPair, Ends, T, E, stride_lt,
                  renorm_eps, scale, TOP_K: tl.constexpr, SCORE: tl.constexpr, RENORM: tl.constexpr,
                  HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  SINGLE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_G: tl.constexpr):
    c = tl.program_id(0)
    t = c * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    kk = tl.arange(0, BLOCK_K)
    scores = _scores(Logits, t, t_ok, e, e_ok, stride_lt, SCORE)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(Bias + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    # NaN (a padding row's) ranks below every score and above what may never be chosen (-inf: experts past E,
    # outside the kept groups, and those already chosen), so every round picks a valid expert
    choice = tl.where(choice != choice, -3.4028234663852886e38, choice)
    choice = tl.where(e_ok[None, :], choice, float("-inf"))
    if TOPK_GROUP < N_GROUP:
        choice = _group_limit(choice, e, N_GROUP, TOPK_GROUP, GROUP_SIZE, BLOCK_T, BLOCK_E, BLOCK_G)
    chosen = tl.zeros((BLOCK_T, BLOCK_E), tl.int1)
    ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    vals = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, 1)
        pick = tl.min(tl.where(~chosen & (choice == best[:, None]), e[None, :], BLOCK_E), 1)
        hit = e[None, :] == pick[:, None]
        chosen = chosen | hit
        choice = tl.where(hit, float("-inf"), choice)
        ids = tl.where(kk[None, :] == j, pick[:, None], ids)
        # the weight's score: the choice's, but for the bias (DeepSeek weights by the uncorrected sigmoid)
        val = tl.sum(tl.where(hit, scores, 0.0), 1) if HAS_BIAS else best
        vals = tl.where(kk[None, :] == j, val[:, None], vals)
    w = _weights(vals, kk, renorm_eps, scale, TOP_K, SCORE, RENORM)
    out_ok = t_ok[:, None] & (kk[None, :] < TOP_K)
    pair = t[:, None] * TOP_K + kk[None, :]
    tl.store(Weights + pair, w.to(Weights.dtype.element_ty), mask=out_ok)
    tl.store(Ids + pair, ids.to(Ids.dtype.element_ty), mask=out_ok)
    # Align: a token picks an expert once, so its pair's rank in the chunk is the tokens before it that chose it.
    taken = (chosen & t_ok[:, None]).to(tl.int32)
    before = tl.cumsum(taken, 0) - taken
    hist = tl.sum(taken, 0)
    if SINGLE:
        starts = _starts(hist)
        tl.store(Ends + e, starts + hist, mask=e_ok)
        before += starts[None, :]
    else:
        tl.store(Hist + c * BLOCK_E + e, hist)
    for j in tl.static_range(TOP_K):
        id_j = tl.sum(tl.where(kk[None, :] == j, ids, 0), 1)
        rank = tl.sum(tl.where(e[None, :] == id_j[:, None], before, 0), 1)
        p = t * TOP_K + j
        if SINGLE:
            tl.store(SortedPairs + rank, p, mask=t_ok)
            tl.store(PosOfPair + p, rank, mask=t_ok)
        else:
            tl.store(Rank + p, rank, mask=t_ok)


@triton.jit
def _count_kernel(Ids, Hist, Rank, SortedPairs, PosOfPair, Ends, num_pairs, E, PAIRS_PER_CHUNK,
                  SINGLE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """The align of any [tokens, k] expert ids: each pair's rank among its chunk's pairs of the same expert."""
    c = tl.program_id(0)
    p = c * PAIRS_PER_CHUNK + tl.arange(0, BLOCK_P)
    p_ok = (tl.arange(0, BLOCK_P) < PAIRS_PER_CHUNK) & (p < num_pairs)
    e = tl.arange(0, BLOCK_E)
    ids = tl.load(Ids + p, mask=p_ok, other=BLOCK_E).to(tl.int32)
    hit = ((e[None, :] == ids[:, None]) & p_ok[:, None]).to(tl.int32)
    before = tl.cumsum(hit, 0) - hit
    hist = tl.sum(hit, 0)
    if SINGLE:
        starts = _starts(hist)
        tl.store(Ends + e, starts + hist, mask=e < E)
        before += starts[None, :]
    else:
        tl.store(Hist + c * BLOCK_E + e, hist)
    rank = tl.sum(tl.where(hit > 0, before, 0), 1)
    if SINGLE:
        tl.store(SortedPairs + rank, p, mask=p_ok)
        tl.store(PosOfPair + p, rank, mask=p_ok)
    else:
        tl.store(Rank + p, rank, mask=p_ok)


@triton.jit
def _place_kernel(Ids, Hist, Rank, SortedPairs, PosOfPair, Ends, num_pairs, E, num_chunks, PAIRS_PER_CHUNK,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    """The second launch of a multi-chunk align: chunk ``c``'s pairs placed after every earlier chunk's."""
    c = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), tl.int32)
    earlier = tl.zeros((BLOCK_E,), tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        h = tl.load(Hist + cs[:, None] * BLOCK_E + e[None, :], mask=(cs < num_chunks)[:, None], other=0)
        total += tl.sum(h, 0)
        earlier += tl.sum(tl.where((cs < c)[:, None], h, 0), 0)
    starts = _starts(total)
    if c == 0:
        tl.store(Ends + e, starts + total, mask=e < E)
    p = c * PAIRS_PER_CHUNK + tl.arange(0, BLOCK_P)
    p_ok = (tl.arange(0, BLOCK_P) < PAIRS_PER_CHUNK) & (p < num_pairs)
    ids = tl.load(Ids + p, mask=p_ok, other=BLOCK_E).to(tl.int32)
    base = tl.sum(tl.where(e[None, :] == ids[:, None], (starts + earlier)[None, :], 0), 1)
    pos = base + tl.load(Rank + p, mask=p_ok, other=0)
    tl.store(SortedPairs + pos, p, mask=p_ok)
    tl.store(PosOfPair + p, pos, mask=p_ok)
