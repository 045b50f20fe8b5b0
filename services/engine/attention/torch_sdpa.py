"""``torch_sdpa``: gather each request's context into a padded batch, then one masked SDPA call.

Each request's whole context is gathered through its block table into a padded batch::

    block_table[i] = [7, 2, 9]        block_size = 4, context_len[i] = 10
    gathered keys  = blocks 7,2,9 -> positions 0..11, of which 0..9 are valid

and scaled-dot-product attention runs once for the batch with a mask that is causal, hides
padding and, for sliding-window layers, hides keys older than the window. The K/V views come
from the layout spec, so the result does not depend on which layout the cache uses.

Portable (any device torch runs on: the CPU path and the reference the other backends are tested
against), but it pays for that on a GPU: every layer of every step copies the whole context out of
the cache, and the explicit mask keeps SDPA off its flash kernel. ``triton_paged`` reads the cache
in place instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.engine.attention.base import AttentionBackend, AttentionBatch, GroupAttentionMetadata
from services.engine.kv_cache.kv_scales import UNIT_SCALE
from services.engine.ops import kv_fp8

# cuDNN's SDPA builds a new execution plan for every new shape (~1 ms of CPU per call), and a
# serving step's context length changes every step; the other backends have no such cost.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def build_mask(query_lens: torch.Tensor, context_lens: torch.Tensor, max_query_len: int, max_context_len: int,
               sliding_window: int | None) -> torch.Tensor:
    """Boolean [num_reqs, 1, max_query_len, max_context_len] mask; padded query rows see key 0.

    Built on the device of ``query_lens``/``context_lens`` without a host sync (a decode graph
    builds it inside its captured region).
    """
    device = context_lens.device
    q_lens = query_lens.long()
    ctx = context_lens.long()
    q_idx = torch.arange(max_query_len, device=device)
    k_pos = torch.arange(max_context_len, device=device)
    # Position of query row j of request i; padded rows get position 0 (see key 0 only: no NaN).
    q_pos = ctx[:, None] - q_lens[:, None] + q_idx[None, :]
    q_pos = torch.where(q_idx[None, :] < q_lens[:, None], q_pos, torch.zeros_like(q_pos))
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return mask[:, None]


def query_slots(batch: AttentionBatch) -> torch.Tensor:
    """Slot of each token in the padded [num_reqs * max_query_len] query batch (device ops only)."""
    device = batch.query_start.device
    if batch.max_query_len == 1:  # one token per request (decode)
        return torch.arange(batch.num_reqs, device=device)
    starts = batch.query_start.long()
    tokens = torch.arange(batch.num_tokens, device=device)
    request = torch.searchsorted(starts[1:], tokens, right=True)  # ends <= token: the token's request
    return request * batch.max_query_len + tokens - starts[request]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, batch: AttentionBatch, block_tables: torch.Tensor, write_blocks: torch.Tensor,
                       write_offsets: torch.Tensor, sliding_window: int | None) -> GroupAttentionMetadata:
        return GroupAttentionMetadata(
            backend=self, write_blocks=write_blocks, write_offsets=write_offsets, block_tables=block_tables,
            sliding_window=sliding_window,
            mask=build_mask(batch.query_lens, batch.context_lens, batch.max_query_len, batch.max_context_len,
                            sliding_window),
            query_slots=query_slots(batch),
        )

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                meta: GroupAttentionMetadata, scale: float, softcap: float | None,
                fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_scale: tuple[float, float] = UNIT_SCALE, sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        b, qm, lm = batch.num_reqs, batch.max_query_len, batch.max_context_len
        kv_heads = k_cache.shape[2]
        group = num_heads // kv_heads
        padded_q = q.new_zeros(b * qm, num_heads, head_dim)
        padded_q[meta.query_slots] = q
        # Fold each KV head's query heads into the query axis: [b, kv_heads, group * qm, d]. Every
        # SDPA backend then sees plain multi-head attention (no GQA expansion of K/V), and a decode
        # step is one long query row per KV head instead of `group` tiny ones.
        folded_q = padded_q.view(b, qm, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        folded_q = folded_q.reshape(b, kv_heads, group * qm, head_dim)
        mask = meta.mask if group == 1 else meta.mask.expand(b, group, qm, lm).reshape(b, 1, group * qm, lm)

        # An FP8 cache is gathered as it is (a byte per element), then dequantized: what every backend reads.
        keys = kv_fp8.from_cache(gather_context(k_cache, meta.block_tables, lm), kv_scale[0], q.dtype)
        values = kv_fp8.from_cache(gather_context(v_cache, meta.block_tables, lm), kv_scale[1], q.dtype)
        if softcap is None and sinks is None:
            with sdpa_kernel(SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(folded_q, keys, values, attn_mask=mask, scale=scale)
        else:  # folded row r of KV head h is query head h * group + r // qm: its sink, repeated over the rows
            row_sinks = None if sinks is None else sinks.view(kv_heads, group, 1).expand(kv_heads, group, qm)
            out = _explicit_attention(folded_q, keys, values, mask, scale, softcap,
                                      None if row_sinks is None else row_sinks.reshape(kv_heads, group * qm, 1))
        v_dim = values.shape[-1]  # the head dim, or narrower (MLA's latent values: the rows without the rope key)
        out = out.view(b, kv_heads, group, qm, v_dim).permute(0, 3, 1, 2, 4).reshape(b * qm, num_heads * v_dim)
        return out[meta.query_slots]


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                        softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Scores in float32, soft-capped, masked; with ``sinks`` [kv_heads, rows, 1] a sink column joins each row's
    softmax and is dropped after it (its value is zero)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
    with_sink = torch.cat((scores, sinks.float().expand(scores.shape[0], -1, -1, -1)), dim=-1)
    return torch.matmul(with_sink.softmax(dim=-1)[..., :-1].to(v.dtype), v)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """[num_reqs, kv_heads, max_context_len, head_dim] from the blocks each request owns."""
    b, nb = block_tables.shape
    _, bs, h, d = cache.shape
    rows = cache[block_tables].reshape(b, nb * bs, h, d)[:, :max_context_len]
    return rows.transpose(1, 2)
