"""Multi-head latent attention (DeepSeek) over a paged cache of latent rows: the interface and ``torch_mla``.

An MLA layer caches one row per token, shared by every query head::

    row = [ c (kv_lora_rank: the normalised KV latent) | k_rope (qk_rope_head_dim: the rotated key part) ]

and each head's key and value are linear in the latent: ``k_h = [W_UK_h c | k_rope]``,
``v_h = W_UV_h c`` (``W_UK``/``W_UV`` are the two halves of ``kv_b_proj``). So attention can run in
two forms with the same result:

* **expanded** (``forward_expanded``): gather each context's rows and project them up to per-head
  K and V, then ordinary multi-head attention. Its cost per step grows with the context times the
  heads, which many queries of a prefill chunk share.
* **absorbed** (``forward_absorbed``): fold ``W_UK_h`` into the query
  (``q_lat_h = W_UK_h^T q_nope_h``) and attend with ``[q_lat_h | q_rope_h]`` against the rows
  themselves, as one KV head shared by all query heads whose values are the latent part of each
  row; the result is one latent per head, which ``W_UV_h`` maps to the head's value (the model does
  both projections). Nothing per context is expanded: the cheap form for one query per request.

``torch_mla`` is the torch reference of both (gather, masked SDPA: ``torch_sdpa``'s metadata and
masks), usable on any device; ``triton_mla.py`` has the CUDA backend. ``registry.mla_backend``
picks one for an MLA group.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from services.engine.attention.base import AttentionBackend, AttentionBatch, GroupAttentionMetadata
from services.engine.attention.torch_sdpa import SDPA_BACKENDS, TorchSDPABackend, gather_context
from services.engine.ops import kv_fp8

# Latent rows [..., row width] -> per-head (keys [..., heads, qk_head_dim], values [..., heads, v_head_dim]).
ExpandRows = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def write_rows(rows: torch.Tensor, cache: torch.Tensor, meta: GroupAttentionMetadata, row_scale: float = 1.0) -> None:
    """Store this step's rows ([num_tokens, row width]) in their slots of the [num_blocks, block_size, 1,
    row width] cache view (any strides: every layout kind); an FP8 cache gets ``rows / row_scale`` in e4m3
    (the latent and the rotated key part alike)."""
    cache[meta.write_blocks, meta.write_offsets] = kv_fp8.to_cache(rows, cache, row_scale)[:, None, :]


class MLABackend(AttentionBackend):
    """What an MLA group's backend does beyond ``AttentionBackend``: attention in both MLA forms.

    ``build_metadata`` is the usual one; ``forward`` is plain attention with ``v_cache`` narrower than
    ``k_cache`` (which the absorbed form is).
    """

    def forward_absorbed(self, q: torch.Tensor, rows: torch.Tensor, latent_dim: int, batch: AttentionBatch,
                         meta: GroupAttentionMetadata, scale: float, row_scale: float = 1.0) -> torch.Tensor:
        """``q`` [num_tokens, heads, row width] (latent query, then rope query) against the rows as one
        shared KV head whose values are their first ``latent_dim`` elements: [num_tokens, heads * latent_dim].
        ``row_scale``: what an FP8 cache's rows are multiplied by when read."""
        return self.forward(q, rows, rows[..., :latent_dim], batch, meta, scale, None,
                            kv_scale=(row_scale, row_scale))

    @abstractmethod
    def forward_expanded(self, q: torch.Tensor, rows: torch.Tensor, batch: AttentionBatch,
                         meta: GroupAttentionMetadata, scale: float, expand: ExpandRows,
                         row_scale: float = 1.0) -> torch.Tensor:
        """``q`` [num_tokens, heads, qk_head_dim] against each context's rows (dequantized with ``row_scale``
        from an FP8 cache) expanded by ``expand`` into per-head keys and values: [num_tokens, heads * v_head_dim]."""


class TorchMLABackend(TorchSDPABackend, MLABackend):
    """Gather, then masked SDPA, in either form (``torch_sdpa``'s metadata, mask and query slots)."""

    name = "torch_mla"

    def forward_expanded(self, q: torch.Tensor, rows: torch.Tensor, batch: AttentionBatch,
                         meta: GroupAttentionMetadata, scale: float, expand: ExpandRows,
                         row_scale: float = 1.0) -> torch.Tensor:
        num_tokens, num_heads, qk_dim = q.shape
        b, qm, lm = batch.num_reqs, batch.max_query_len, batch.max_context_len
        context = kv_fp8.from_cache(gather_context(rows, meta.block_tables, lm)[:, 0], row_scale, q.dtype)
        keys, values = expand(context)  # [b, lm, heads, dim] each
        padded_q = q.new_zeros(b * qm, num_heads, qk_dim)
        padded_q[meta.query_slots] = q
        padded_q = padded_q.view(b, qm, num_heads, qk_dim).transpose(1, 2)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(padded_q, keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=meta.mask, scale=scale)
        v_dim = values.shape[-1]
        return out.transpose(1, 2).reshape(b * qm, num_heads * v_dim)[meta.query_slots]

