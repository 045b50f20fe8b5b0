"""Paged attention over a batch of variable-length chunks, reading KV through layout views.

A step's tokens arrive flattened (``[num_tokens, heads, head_dim]``); request ``i`` owns the
tokens ``query_start[i] : query_start[i+1]`` at context positions
``context_len[i] - q_len[i] .. context_len[i] - 1``. New K/V rows are scattered into their slots,
then each request's whole context is gathered through its block table into a padded batch::

    block_table[i] = [7, 2, 9]        block_size = 4, context_len[i] = 10
    gathered keys  = blocks 7,2,9 -> positions 0..11, of which 0..9 are valid

and scaled-dot-product attention runs once for the batch with a mask that is causal, hides
padding and, for sliding-window layers, hides keys older than the window. The K/V views come
from the layout spec, so the result does not depend on which layout the cache uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's SDPA builds a new execution plan for every new shape (~1 ms of CPU per call), and a
# serving step's context length changes every step; the other backends have no such cost.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class GroupAttentionMetadata:
    """Per KV-cache group: where new tokens are written, what each request reads, the mask."""

    write_blocks: torch.Tensor  # [num_tokens] block id of each new token
    write_offsets: torch.Tensor  # [num_tokens] offset inside that block
    block_tables: torch.Tensor  # [num_reqs, max_blocks], padded with block 0 (masked out)
    mask: torch.Tensor  # [num_reqs, 1, max_query_len, max_context_len] bool, True = attend
    max_context_len: int


@dataclass(frozen=True)
class AttentionBatch:
    """What every attention layer of one forward pass needs."""

    num_reqs: int
    max_query_len: int
    query_slots: torch.Tensor  # [num_tokens] index of each token in the padded [num_reqs * max_query_len]
    groups: tuple[GroupAttentionMetadata, ...]


@dataclass(frozen=True)
class TailBatch:
    """The step's tokens whose output is read, for the layers after the last one that writes KV.

    Layers that only read earlier layers' KV (KV-shared layers) write nothing a later token needs,
    so past the last KV-writing layer only tokens whose logits are used must go on: the last token
    of each sampling chunk, every token of a chunk that returns logits, none of a chunk in the
    middle of a chunked prefill. Each request's tail rows are a suffix of its chunk, so ``batch``
    is the same attention problem with shorter queries over the same contexts::

        chunk of 5 tokens at positions 3..7, samples   -> tail row: position 7 (query length 1)
        chunk of 4 tokens at positions 0..3, mid-prefill -> no tail rows

    ``rows`` index the step's flattened tokens; ``batch`` holds only requests with tail rows.
    """

    rows: torch.Tensor
    batch: AttentionBatch | None  # None when no token of the step needs output


def build_mask(
    query_lens: list[int],
    context_lens: list[int],
    max_query_len: int,
    max_context_len: int,
    sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor:
    """Boolean [num_reqs, 1, max_query_len, max_context_len] mask; padded query rows see key 0."""
    q_lens = torch.tensor(query_lens, device=device)
    ctx = torch.tensor(context_lens, device=device)
    q_idx = torch.arange(max_query_len, device=device)
    k_pos = torch.arange(max_context_len, device=device)
    # Position of query row j of request i; padded rows get position 0 (see key 0 only: no NaN).
    q_pos = ctx[:, None] - q_lens[:, None] + q_idx[None, :]
    q_pos = torch.where(q_idx[None, :] < q_lens[:, None], q_pos, torch.zeros_like(q_pos))
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return mask[:, None]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    meta: GroupAttentionMetadata,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Store this step's K/V in the cache, then attend. Returns [num_tokens, heads * head_dim].

    ``k_cache``/``v_cache`` are [num_blocks, block_size, kv_heads, head_dim] views (any strides).
    ``k``/``v`` None: a layer that reads another layer's KV and writes none. ``softcap``: scores
    become ``softcap * tanh(scores / softcap)`` before the mask (Gemma-2), which SDPA cannot do.
    """
    if k is not None:
        k_cache[meta.write_blocks, meta.write_offsets] = k
        v_cache[meta.write_blocks, meta.write_offsets] = v

    num_tokens, num_heads, head_dim = q.shape
    b, qm, lm = batch.num_reqs, batch.max_query_len, meta.max_context_len
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    padded_q = q.new_zeros(b * qm, num_heads, head_dim)
    padded_q[batch.query_slots] = q
    # Fold each KV head's query heads into the query axis: [b, kv_heads, group * qm, d]. Every
    # SDPA backend then sees plain multi-head attention (no GQA expansion of K/V), and a decode
    # step is one long query row per KV head instead of `group` tiny ones.
    folded_q = padded_q.view(b, qm, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    folded_q = folded_q.reshape(b, kv_heads, group * qm, head_dim)
    mask = meta.mask if group == 1 else meta.mask.expand(b, group, qm, lm).reshape(b, 1, group * qm, lm)

    keys = _gather(k_cache, meta.block_tables, lm)
    values = _gather(v_cache, meta.block_tables, lm)
    if softcap is None:
        with sdpa_kernel(_SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(folded_q, keys, values, attn_mask=mask, scale=scale)
    else:
        out = _softcapped_attention(folded_q, keys, values, mask, scale, softcap)
    out = out.view(b, kv_heads, group, qm, head_dim).permute(0, 3, 1, 2, 4).reshape(b * qm, num_heads * head_dim)
    return out[batch.query_slots]


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          softcap: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """[num_reqs, kv_heads, max_context_len, head_dim] from the blocks each request owns."""
    b, nb = block_tables.shape
    _, bs, h, d = cache.shape
    rows = cache[block_tables].reshape(b, nb * bs, h, d)[:, :max_context_len]
    return rows.transpose(1, 2)
