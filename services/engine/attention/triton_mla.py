"""``triton_mla``: multi-head latent attention for CUDA (DeepSeek), both forms.

* **absorbed** (decode steps): ``triton_kernels._mla_kernel`` walks each request's block table and
  reads every latent row once, in place, for all query heads of a tile: one dot against the latent
  part plus one against the rope part gives the score, and the same latent tile is the value. Few
  programs (small batches) split each context over the GPU as ``triton_paged`` does, merged by its
  reduction kernel. No host sync, so decode graphs capture it.
* **expanded** (prefill chunks): per request, its context's rows are gathered through the block table
  (one row per token, ~1 KiB), projected up to per-head keys and values, and attended with SDPA under a
  lower-right causal mask (the chunk's last query sees the whole context), so no padded batch and no
  explicit boolean mask are built. The backends are ``torch_sdpa``'s (flash, memory-efficient; not cuDNN,
  which plans anew for every shape). Values narrower than keys (128 / 192) are zero-padded to the key
  width, which lets SDPA take its flash kernel instead of the memory-efficient one (1.4-1.5x faster on
  the H200 at 2k-8k tokens, ``bench/mla_moe.py``). That needs each request's lengths on the host; a step without them
  (a captured graph) takes ``torch_mla``'s padded gather instead.

Chosen over ``torch_mla`` on CUDA by ``bench/mla_moe.py`` (``bench/RESULTS.md`` has the numbers). The
kernel's tile (``mla_kernel_config``) keeps the [tile rows, latent] fp32 accumulator in registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from services.engine.attention.base import AttentionBatch, GroupAttentionMetadata
from services.engine.attention.mla import ExpandRows, MLABackend, TorchMLABackend
from services.engine.attention.torch_sdpa import SDPA_BACKENDS
from services.engine.attention.triton_paged import (
    KernelConfig,
    TritonPagedBackend,
    _next_pow2,
    _num_sms,
    choose_num_splits,
    split_partials,
)
from services.engine.ops import fp8_format, kv_fp8

# The widest row (latent + rope part) whose latent accumulator the kernel's tiles hold (DeepSeek-V2/V3: 512 + 64).
MAX_ROW_WIDTH = 576


def mla_kernel_config(num_heads: int, max_query_len: int, latent: int, dtype: torch.dtype) -> KernelConfig:
    """The tile for a step: 16 rows (query heads x tokens) with a 512-wide latent, more for narrower ones,
    32 keys per iteration (16 in fp32, whose full-precision dots need more registers)."""
    block_m = 16 if latent > 256 else 32 if latent > 128 else 64
    if max_query_len * num_heads <= 16:
        block_m = 16
    block_n = 16 if dtype == torch.float32 else 32
    return KernelConfig(block_m, block_n, num_warps=4, num_stages=2)


# The split rule the latent kernel was measured with (``bench/mla_moe.py``): about two programs per SM, at
# least 128 keys per split. The paged kernel's rule (four, 64) came from its own sweep, not re-run for MLA.
MLA_PROGRAMS_PER_SM = 2
MLA_MIN_KEYS_PER_SPLIT = 128


class TritonMLABackend(TritonPagedBackend, MLABackend):
    """``triton_paged``'s metadata (block tables and write slots, no dense plan) and split function, with the
    latent kernel's own constants (``MLA_PROGRAMS_PER_SM``, ``MLA_MIN_KEYS_PER_SPLIT``); the MLA forms above.
    ``num_splits``/``config``: fixed instead of chosen per step (tests and the benchmark)."""

    name = "triton_mla"

    def __init__(self, num_splits: int | None = None, config: KernelConfig | None = None,
                 pad_values: bool = True) -> None:
        super().__init__(num_splits=num_splits, config=config, dense_min_query=0)
        self._padded = TorchMLABackend()
        self.pad_values = pad_values  # zero-pad values to the key width, which lets SDPA take its flash kernel

    def rows_unsupported_reason(self, row_width: int, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why this backend cannot serve a group of ``row_width``-wide rows in ``dtype`` (None: it can)."""
        if row_width > MAX_ROW_WIDTH:
            return f"row width {row_width} (the kernel supports up to {MAX_ROW_WIDTH})"
        return self.unsupported_reason(16, dtype, device)

    def forward_absorbed(self, q: torch.Tensor, rows: torch.Tensor, latent_dim: int, batch: AttentionBatch,
                         meta: GroupAttentionMetadata, scale: float, row_scale: float = 1.0) -> torch.Tensor:
        from services.engine.attention.triton_kernels import LOG2E, kernels

        num_tokens, num_heads, width = q.shape
        quantized = fp8_format.is_fp8(rows)
        if (rows.dtype != q.dtype and not quantized) or rows.shape[-1] != width:
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit a {tuple(rows.shape)} {rows.dtype} row cache")
        if num_tokens == 0:
            return q.new_empty(0, num_heads * latent_dim)
        config = self.config or mla_kernel_config(num_heads, batch.max_query_len, latent_dim, q.dtype)
        heads = min(_next_pow2(num_heads), config.block_m)
        q_tiles = -(-batch.max_query_len // (config.block_m // heads))
        head_tiles = -(-num_heads // heads)
        if self.num_splits is not None:
            splits = self.num_splits
        elif q_tiles == 1:
            splits = choose_num_splits(batch.num_reqs * head_tiles, batch.max_context_len, _num_sms(q.device),
                                       MLA_PROGRAMS_PER_SM, MLA_MIN_KEYS_PER_SPLIT)
        else:
            splits = 1
        out = q.new_empty(num_tokens, num_heads, latent_dim)
        part_acc, part_max, part_sum = split_partials(out, splits, latent_dim)
        compiled = kernels(q.device.type)
        block_l = max(16, _next_pow2(latent_dim))
        compiled.mla[(batch.num_reqs * q_tiles, head_tiles, splits)](
            q, rows, out, part_acc, part_max, part_sum,
            meta.block_tables, batch.query_start, batch.context_lens,
            *q.stride(), rows.stride(0), rows.stride(1), rows.stride(3), meta.block_tables.stride(0), *out.stride(),
            num_heads, splits, q_tiles, float(scale) * LOG2E * (row_scale if quantized else 1.0),
            float(row_scale) if quantized else 1.0,
            BLOCK_SIZE=rows.shape[1], HEADS=heads, TOKENS_PER_TILE=config.block_m // heads, LATENT=latent_dim,
            BLOCK_L=block_l, ROPE=width - latent_dim, BLOCK_R=max(16, _next_pow2(width - latent_dim)),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, SPLIT=splits > 1, FP8=quantized,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if splits > 1:
            compiled.reduce[(num_tokens, num_heads)](
                out, part_acc, part_max, part_sum, out, *out.stride(), num_heads, splits,
                HEAD_DIM=latent_dim, BLOCK_D=block_l, SPLITS=_next_pow2(splits), SINKS=False, PDL=False, num_warps=4,
            )
        return out.reshape(num_tokens, num_heads * latent_dim)

    def forward_expanded(self, q: torch.Tensor, rows: torch.Tensor, batch: AttentionBatch,
                         meta: GroupAttentionMetadata, scale: float, expand: ExpandRows,
                         row_scale: float = 1.0) -> torch.Tensor:
        # Imported here: torch.nn.attention.bias imports triton, which must not happen before a test process
        # has chosen Triton's interpreter (triton_kernels.py).
        from torch.nn.attention.bias import causal_lower_right

        if batch.host_lens is None:  # a captured step: the padded gather needs no host lengths
            padded = self._padded.build_metadata(batch, meta.block_tables, meta.write_blocks, meta.write_offsets,
                                                 None)
            return self._padded.forward_expanded(q, rows, batch, padded, scale, expand, row_scale)
        num_heads, block_size, width = q.shape[1], rows.shape[1], rows.shape[-1]
        outs = []
        start = 0
        for i, (q_len, ctx) in enumerate(zip(*batch.host_lens, strict=True)):
            num_blocks = -(-ctx // block_size)
            context = rows[meta.block_tables[i, :num_blocks]].reshape(num_blocks * block_size, width)[:ctx]
            context = kv_fp8.from_cache(context, row_scale, q.dtype)
            keys, values = expand(context)  # [ctx, heads, dim] each
            v_dim = values.shape[-1]
            if self.pad_values and v_dim < keys.shape[-1]:
                values = F.pad(values, (0, keys.shape[-1] - v_dim))
            # [1, heads, len, dim]: SDPA's fused kernels take 4-D inputs only (3-D ones run its math path)
            query, keys, values = (x.transpose(0, 1)[None] for x in (q[start: start + q_len], keys, values))
            mask = causal_lower_right(q_len, ctx) if 1 < q_len < ctx else None
            with sdpa_kernel(SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                     is_causal=1 < q_len == ctx, scale=scale)
            outs.append(out[0, ..., :v_dim].transpose(0, 1).reshape(q_len, num_heads * v_dim))
            start += q_len
        return torch.cat(outs)
