"""A prefill step's depthwise causal convolution, all sequences in one launch, with each conv state updated in place.

Per sequence with conv state ``w`` [channels, d_conv - 1] (its last inputs before this chunk of the prompt) and
inputs ``x`` [L, channels]: ``out_t = act(bias + sum_k weight[:, k] [w | x]_{t + k})`` over the window
``[w | x]`` (``d_conv - 1 + L`` columns), and the new state is the window's last ``d_conv - 1`` columns. Mamba2
runs it over x, B and C before its scan; a Gated DeltaNet's short convs over q, k and v are the same. The
sequences are the ``scan_chunks`` table's (a fresh sequence starts from the zero window whatever its slot holds).

Two launches: the conv reads the old states; the state update, after it in the stream, overwrites them.
fp32 sums; the output in the inputs' dtype (rounded once, after the activation), the state in its own dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.ops.scan_chunks import CHUNK_FIELDS, SEQ_FIELDS, ScanChunks
from services.engine.ops.state_slots_triton import state_strides

CONV_BLOCK_C = 128  # channels per program
CONV_BLOCK_T = 16  # tokens per program (32 spills at 4 warps)
_CF = tl.constexpr(CHUNK_FIELDS)
_SF = tl.constexpr(SEQ_FIELDS)


@triton.jit
def _seq_row(Seqs, seq):
    """(first token, tokens, slot (0 for none), whether the old state is read) of a sequence."""
    start = tl.load(Seqs + seq * _SF).to(tl.int64)
    n = tl.load(Seqs + seq * _SF + 1)
    slot = tl.load(Seqs + seq * _SF + 2).to(tl.int64)
    reads = (tl.load(Seqs + seq * _SF + 3) == 0) & (slot >= 0)
    return start, n, tl.where(slot >= 0, slot, 0), reads


@triton.jit
def _causal_conv_kernel(
    X, State, Weight, Bias, Chunks, Seqs, Out, channels, tiles, stride_x, stride_slot, stride_ch, stride_out,
    D_CONV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    """``BLOCK_T`` tokens of one chunk, ``BLOCK_C`` channels. A window column before the sequence's first token
    comes from its state (zero when fresh)."""
    chunk = tl.program_id(0) // tiles
    t = (tl.program_id(0) % tiles) * BLOCK_T + tl.arange(0, BLOCK_T)  # within the chunk
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ch_ok = ch < channels
    chunk_start = tl.load(Chunks + chunk * _CF).to(tl.int64)
    t_ok = t < tl.load(Chunks + chunk * _CF + 1)
    start, _, slot, reads = _seq_row(Seqs, tl.load(Chunks + chunk * _CF + 2))
    first = chunk_start - start + (tl.program_id(0) % tiles) * BLOCK_T  # the tile's first position in the sequence
    pos = first + tl.arange(0, BLOCK_T)
    x_rows = X + start * stride_x
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(D_CONV):
        j = pos - (D_CONV - 1) + k
        in_x = (t_ok & (j >= 0))[:, None] & ch_ok[None, :]
        value = tl.load(x_rows + j[:, None] * stride_x + ch[None, :], mask=in_x, other=0.0).to(tl.float32)
        acc += value * tl.load(Weight + ch * D_CONV + k, mask=ch_ok, other=0.0).to(tl.float32)[None, :]
    if reads & (first < D_CONV - 1):  # the sequence's first positions: their window starts in the old state
        state = State + slot * stride_slot
        for k in tl.static_range(D_CONV - 1):
            j = pos - (D_CONV - 1) + k
            in_state = (t_ok & (j < 0))[:, None] & ch_ok[None, :]
            old = tl.load(state + ch[None, :] * stride_ch + (D_CONV - 1 + j)[:, None], mask=in_state, other=0.0)
            acc += old.to(tl.float32) * tl.load(Weight + ch * D_CONV + k, mask=ch_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + ch, mask=ch_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(Out + chunk_start * stride_out + t[:, None] * stride_out + ch[None, :], acc.to(Out.dtype.element_ty),
             mask=t_ok[:, None] & ch_ok[None, :])


@triton.jit
def _conv_state_kernel(
    X, State, Seqs, channels, stride_x, stride_slot, stride_ch,
    D_CONV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One sequence's new state for ``BLOCK_C`` channels: the window's last ``D_CONV - 1`` columns (from its old
    state when the sequence is shorter). Loaded in full before the barrier, stored after it."""
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, BLOCK_K)
    start, n, slot, reads = _seq_row(Seqs, seq)
    valid = tl.load(Seqs + seq * _SF + 2) >= 0
    ok = (ch < channels)[:, None] & (k < D_CONV - 1)[None, :] & valid
    j = n - (D_CONV - 1) + k  # the source position of new column k
    from_x = ok & (j >= 0)[None, :]
    value = tl.load(X + (start + j)[None, :] * stride_x + ch[:, None], mask=from_x, other=0.0)
    state = State + slot * stride_slot + ch[:, None].to(tl.int64) * stride_ch
    old = tl.load(state + (D_CONV - 1 + j)[None, :], mask=ok & (j < 0)[None, :] & reads, other=0.0)
    new = tl.where(from_x, value.to(State.dtype.element_ty), old)
    tl.debug_barrier()
    tl.store(state + k[None, :], new, mask=ok)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                table: ScanChunks, silu: bool = True) -> torch.Tensor:
    """``x`` [tokens, channels] (channels contiguous; rows may be strided, a slice of a projection), ``conv_state``
    [slots, channels, d_conv - 1] (rows of the table's slots updated in place), ``weight`` [channels, d_conv]
    contiguous. Returns the conv output [tokens, channels] in ``x``'s dtype (SiLU'd when ``silu``)."""
    tokens, channels = x.shape
    d_conv = weight.shape[1]
    stride_slot, stride_ch, _ = state_strides(conv_state, 3, "conv_state")
    if conv_state.shape[1:] != (channels, d_conv - 1) or weight.shape[0] != channels or not weight.is_contiguous():
        raise ValueError(f"conv_state {tuple(conv_state.shape)} / weight {tuple(weight.shape)} do not fit x's "
                         f"{channels} channels")
    if x.stride(1) != 1 or tokens != table.num_tokens:
        raise ValueError(f"x must be [{table.num_tokens}, channels] with contiguous channels, got {tuple(x.shape)}")
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    block_t = min(CONV_BLOCK_T, triton.next_power_of_2(table.chunk_size))
    tiles = triton.cdiv(table.chunk_size, block_t)
    blocks = triton.cdiv(channels, CONV_BLOCK_C)
    _causal_conv_kernel[(table.num_chunks * tiles, blocks)](
        x, conv_state, weight, bias if bias is not None else weight, table.chunks, table.seqs, out, channels, tiles,
        x.stride(0), stride_slot, stride_ch, out.stride(0), D_CONV=d_conv, BLOCK_T=block_t, BLOCK_C=CONV_BLOCK_C,
        HAS_BIAS=bias is not None, SILU=silu,
    )
    _conv_state_kernel[(table.num_seqs, blocks)](
        x, conv_state, table.seqs, channels, x.stride(0), stride_slot, stride_ch, D_CONV=d_conv,
        BLOCK_K=triton.next_power_of_2(d_conv - 1), BLOCK_C=CONV_BLOCK_C,
    )
    return out
