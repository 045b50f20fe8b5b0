"""``triton_paged``: a Triton flash-attention kernel that reads K/V in place through the block table.

Where ``torch_sdpa`` copies every request's whole context out of the cache (every layer, every
step) and runs SDPA under an explicit mask, this backend's kernel walks each request's block table
and loads the K/V pages where they lie: the bytes a step reads are the context's K/V once per KV
head, nothing is copied, and no [num_reqs, max_query_len, max_context_len] mask is built. A mixed
batch (decode rows, prefill chunks after a prefix hit) is one launch; decode steps with few
programs split each request's keys across programs (flash-decoding) so a batch of one still
spreads over the whole GPU. See ``triton_kernels.py`` for the kernel itself.

Host side, per layer: pick the tile shape (``kernel_config``) and split count
(``choose_num_splits``) from integers fixed for a step -- query heads per KV head, head dim, the
step's ``max_query_len``/``max_context_len`` (a decode graph's are fixed at capture) -- allocate
the output (and split partials) and launch. No host sync, so decode graphs capture it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from services.engine.attention.base import (
    PAGED,
    PREFIX_MERGE,
    SKIP,
    AttentionBackend,
    AttentionBatch,
    DensePlan,
    DenseRequest,
    GroupAttentionMetadata,
)
from services.engine.attention.dense_causal import dense_causal, dense_unsupported_reason
from services.engine.kv_cache.kv_scales import UNIT_SCALE
from services.engine.ops import fp8_format, kv_fp8
from services.engine.triton_support import overridden_by_env, pdl_enabled, triton_import_error

# Head dims up to this compile to tiles without register spills on sm_90 (512: Gemma-4's full
# layers, with 16-32 row tiles of 16 keys); a group with wider heads falls back to torch_sdpa.
MAX_HEAD_DIM = 512
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Split-K (flash-decoding): a decode step's (request, KV head) programs split their keys until the grid
# holds about PROGRAMS_PER_SM programs per SM, each split keeping at least MIN_KEYS_PER_SPLIT keys (one
# 64-key tile), at most MAX_SPLITS. Chosen by ``bench/attention.py --splits N`` on an H200 (Llama-3-8B
# heads, batches 1-64 x contexts 512-8k): at every batch the fastest split count put ~512 programs on its
# 132 SMs. The earlier rule (no split once there were as many programs as SMs) left batch 32 unsplit, 1.4x
# slower at 2k context.
MIN_KEYS_PER_SPLIT = 64
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4

# A chunk of at least this many fresh tokens attends to itself through the dense kernel
# (``dense_causal``) on CUDA; shorter ones stay in the paged kernel, where a dense call's host cost
# (~80 us per layer in eager mode) would outweigh what it saves. Chosen by ``bench/attention.py``. The process's
# threshold is the engine's ``dense_min_query`` (``configure_dense_min_query``; this default before an engine
# starts), or ``PDSERVE_DENSE_MIN_QUERY`` when set (0: never): the A/B switch of ``bench/engine.py`` runs.
DENSE_MIN_QUERY_ENV = "PDSERVE_DENSE_MIN_QUERY"
DENSE_MIN_QUERY = 1024
_dense_min_query = int(os.environ.get(DENSE_MIN_QUERY_ENV, str(DENSE_MIN_QUERY)))
# A chunk after more cached context than this many times its own length stays paged: the merge
# costs about what the dense triangle saves once the prefix's rectangle dominates (H100: a
# 2048-token chunk after 6144 cached tokens took 1048 us split and merged against 1010 us paged).
DENSE_MAX_PREFIX_RATIO = 1.0


def configure_dense_min_query(tokens: int) -> None:
    """The engine's ``dense_min_query`` (``EngineConfig``) as this process's threshold for backends without their
    own; ``PDSERVE_DENSE_MIN_QUERY``, when set, wins over it (the A/B switch of a benchmark run)."""
    global _dense_min_query
    if not overridden_by_env(DENSE_MIN_QUERY_ENV):
        _dense_min_query = tokens


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch parameters of the attention kernel."""

    block_m: int  # query rows per program: tokens x query heads of one KV head
    block_n: int  # keys per iteration
    num_warps: int = 4
    num_stages: int = 2


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def kernel_config(head_dim: int, group: int, max_query_len: int, dtype: torch.dtype) -> KernelConfig:
    """The tile for a step.

    BLOCK_M: 16 rows when every request's query rows (query tokens x ``group``) fit in 16 (decode),
    up to 128 for prefill; BLOCK_N shrinks as the head dim grows, to keep the K/V tiles and the
    fp32 accumulator in registers (checked with ptxas for sm_90: no spills for 16-bit dtypes).
    fp32 dots run in full precision on FMA units, which need smaller tiles.
    """
    rows = max_query_len * group
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
    if head_dim > 128:
        block_m = min(block_m, 64 if head_dim <= 256 else 32)
    block_n = 64 if head_dim <= 128 else 32 if head_dim <= 256 else 16
    if dtype == torch.float32:  # full-precision fp32 dots run on FMA units: far more registers per tile
        block_m = min(block_m, 32 if head_dim <= 128 else 16)
        block_n = 32 if head_dim <= 64 else 16
    block_m = max(block_m, _next_pow2(group))  # one token's query heads always fit a tile
    num_warps = 8 if block_m >= 64 or head_dim > 256 else 4
    return KernelConfig(block_m, block_n, num_warps=num_warps, num_stages=2)


def choose_num_splits(programs: int, max_context_len: int, num_sms: int, programs_per_sm: int = PROGRAMS_PER_SM,
                      min_keys: int = MIN_KEYS_PER_SPLIT) -> int:
    """Splits of each request's keys (decode-shaped steps only, where ``programs`` -- requests x KV
    heads -- can be too few for the GPU): the largest power of two that keeps the grid within
    ``programs_per_sm`` programs per SM and ``min_keys`` keys per split (at most ``MAX_SPLITS``), else 1.

    Llama-3-8B (8 KV heads) on 132 SMs: bs 1 at 2k context -> 32 splits (256 programs of 64 keys);
    bs 8 -> 8; bs 32 -> 2; bs 64 -> 1.
    """
    limit = min(programs_per_sm * num_sms // max(programs, 1), max_context_len // min_keys, MAX_SPLITS)
    return 1 if limit < 2 else 1 << (limit.bit_length() - 1)


def split_partials(out: torch.Tensor, splits: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split-K partials (fp32 accumulator [tokens, heads, splits, width], running max and sum) for an output
    ``out`` [tokens, heads, ...]; with one split the kernel writes ``out`` directly and reads none of them."""
    if splits == 1:
        return out, out, out
    num_tokens, num_heads = out.shape[:2]
    acc = torch.empty(num_tokens, num_heads, splits, width, dtype=torch.float32, device=out.device)
    running_max = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=out.device)
    return acc, running_max, torch.empty_like(running_max)


def _reduce_splits(reduce_kernel: Any, out: torch.Tensor, partials: tuple[torch.Tensor, ...],
                   sinks: torch.Tensor | None, pdl: bool) -> None:
    """Merge the split-K partials into ``out`` [tokens, heads, head_dim] (the sinks joining each denominator)."""
    from services.engine.triton_pdl import launch_options

    num_tokens, num_heads, head_dim = out.shape
    splits = partials[1].shape[2]
    reduce_kernel[(num_tokens, num_heads)](
        out, *partials, out if sinks is None else sinks, *out.stride(), num_heads, splits,
        HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)), SPLITS=_next_pow2(splits),
        SINKS=sinks is not None, PDL=pdl, num_warps=4, **launch_options(pdl),
    )


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention output ``out`` [L, heads, d] with log-sum-exp ``lse`` [heads, L] renormalised with one more logit per
    head (``sinks`` [heads]) whose value is zero."""
    keep = torch.sigmoid(lse - sinks[:, None].float())  # exp(lse) / (exp(lse) + exp(sink))
    return (out.float() * keep.t()[:, :, None]).to(out.dtype)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the CPU interpreter runs programs one by one: splitting only adds work


class TritonPagedBackend(AttentionBackend):
    """``num_splits``/``config``: fixed instead of chosen per step (tests and the benchmark).
    ``dense_min_query``: the chunk length from which fresh tokens go through ``dense_causal`` (default: the
    process's threshold on CUDA, off on CPU; 0 turns it off); ``dense_max_prefix_ratio``: cached context per
    fresh token beyond which a chunk stays paged."""

    name = "triton_paged"

    def __init__(self, num_splits: int | None = None, config: KernelConfig | None = None,
                 dense_min_query: int | None = None, dense_max_prefix_ratio: float = DENSE_MAX_PREFIX_RATIO
                 ) -> None:
        if num_splits is not None and not 1 <= num_splits <= 1024:
            raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
        if dense_min_query is not None and dense_min_query < 0:
            raise ValueError(f"dense_min_query must be >= 0, got {dense_min_query}")
        self.num_splits = num_splits
        self.config = config
        self.dense_min_query = dense_min_query
        self.dense_max_prefix_ratio = dense_max_prefix_ratio

    def unsupported_reason(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
        error = triton_import_error()
        if error is not None:
            return error
        if device.type not in ("cuda", "cpu"):
            return f"device {device.type} (Triton runs on CUDA, or interpreted on CPU)"
        if head_dim > MAX_HEAD_DIM:
            return f"head dim {head_dim} (the kernel supports up to {MAX_HEAD_DIM})"
        if dtype not in _DTYPES and dtype != fp8_format.FP8_DTYPE:
            return f"dtype {dtype} (the kernel supports float16, bfloat16 and float32, and float8_e4m3fn caches)"
        if dtype == fp8_format.FP8_DTYPE and not fp8_format.fp8_kernels_run_on(device):
            return "a float8_e4m3fn cache below compute capability 8.9 (Triton compiles e4m3 from Ada on)"
        return None

    def build_metadata(self, batch: AttentionBatch, block_tables: torch.Tensor, write_blocks: torch.Tensor,
                       write_offsets: torch.Tensor, sliding_window: int | None) -> GroupAttentionMetadata:
        # Everything the kernel reads is already in the batch (query_start, context_lens) or here.
        return GroupAttentionMetadata(backend=self, write_blocks=write_blocks, write_offsets=write_offsets,
                                      block_tables=block_tables, sliding_window=sliding_window,
                                      dense=self._dense_plan(batch, sliding_window, block_tables.device))

    def dense_threshold(self, device: torch.device) -> int:
        """The chunk length from which fresh tokens go through the dense kernel on ``device`` (0: never)."""
        if self.dense_min_query is not None:
            return self.dense_min_query
        return _dense_min_query if device.type == "cuda" else 0

    def _dense_plan(self, batch: AttentionBatch, sliding_window: int | None, device: torch.device
                    ) -> DensePlan | None:
        """Which requests' fresh tokens go through the dense kernel this step (eager steps with a
        long chunk only; a windowed group keeps the paged kernel, which skips what the window hides)."""
        threshold = self.dense_threshold(device)
        if not threshold or batch.host_lens is None or batch.max_query_len < threshold or sliding_window:
            return None
        requests, modes = [], []
        start = 0
        for i, (q_len, ctx) in enumerate(zip(*batch.host_lens, strict=True)):
            if q_len >= threshold and ctx - q_len <= self.dense_max_prefix_ratio * q_len:
                requests.append(DenseRequest(i, start, q_len, ctx - q_len))
                modes.append(PREFIX_MERGE if ctx > q_len else SKIP)
            else:
                modes.append(PAGED)
            start += q_len
        if not requests:
            return None
        return DensePlan(tuple(requests), torch.tensor(modes, dtype=torch.int32, device=device),
                         any_paged=any(m != SKIP for m in modes))

    def _dense_half(self, q: torch.Tensor, fresh: tuple[torch.Tensor, torch.Tensor], plan: DensePlan,
                    num_reqs: int, scale: float, sinks: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out with every dense request's rows filled, lse [heads, num_tokens] where a prefix follows). A request
        without a prefix is final here (the paged kernel skips it), so its rows take the sinks' share off here:
        ``out * exp(lse) / (exp(lse) + exp(sink))``."""
        k, v = fresh
        num_tokens, num_heads, head_dim = q.shape
        if num_reqs == 1:  # the whole step is one chunk: its dense output is the output
            out, lse = dense_causal(q, k, v, scale)
            if sinks is not None and not plan.any_paged:
                out = _with_sinks(out, lse, sinks)
            return out, lse
        out = q.new_empty(num_tokens, num_heads, head_dim)
        lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device)
        for req in plan.requests:
            rows = slice(req.token_start, req.token_start + req.num_tokens)
            part, part_lse = dense_causal(q[rows], k[rows], v[rows], scale)
            if req.prefix_len:
                lse[:, rows] = part_lse
            elif sinks is not None:
                part = _with_sinks(part, part_lse, sinks)
            out[rows] = part
        return out, lse

    def plan(self, batch: AttentionBatch, num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> tuple[KernelConfig, int, int]:
        """(tile config, query tiles per request, splits) for one layer of this step."""
        group = num_heads // kv_heads
        config = self.config or kernel_config(head_dim, group, batch.max_query_len, dtype)
        if config.block_m < group:
            raise ValueError(f"a {config.block_m}-row tile cannot hold the {group} query heads of a KV head")
        q_tiles = -(-batch.max_query_len // (config.block_m // group))
        if self.num_splits is not None:
            splits = self.num_splits
        elif q_tiles == 1:  # every request in one query tile: decode rows, short chunks
            splits = choose_num_splits(batch.num_reqs * kv_heads, batch.max_context_len, _num_sms(device))
        else:  # prefill tiles fill the GPU; splitting them would only add the partials' traffic
            splits = 1
        return config, q_tiles, splits

    @staticmethod
    def _usable_plan(plan: DensePlan | None, fresh: tuple[torch.Tensor, torch.Tensor] | None, softcap: float | None,
                     q: torch.Tensor) -> DensePlan | None:
        """The step's dense plan, unless the layer writes no KV, is softcapped or has a shape dense_causal lacks."""
        if plan is None or fresh is None or softcap is not None:
            return None
        return plan if dense_unsupported_reason(q.shape[-1], q.dtype, q.device) is None else None

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                meta: GroupAttentionMetadata, scale: float, softcap: float | None,
                fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_scale: tuple[float, float] = UNIT_SCALE, sinks: torch.Tensor | None = None) -> torch.Tensor:
        from services.engine.attention.triton_kernels import LOG2E, kernels
        from services.engine.triton_pdl import launch_options

        num_tokens, num_heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        quantized = fp8_format.is_fp8(k_cache)  # e4m3 pages: the k scale folds into qk_scale (x1.0 otherwise: exact)
        cache_dtype = fp8_format.FP8_DTYPE if quantized else q.dtype
        if num_heads % kv_heads or k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype:
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit a {kv_heads}-head {k_cache.dtype} cache")
        if num_tokens == 0:
            return q.new_empty(0, num_heads * head_dim)
        plan = self._usable_plan(meta.dense, fresh, softcap, q)
        if plan is not None:
            if quantized:  # attend to the fresh tokens as the cache holds them, as a later step (or a peer) reads them
                fresh = (kv_fp8.round_trip(fresh[0], kv_scale[0]), kv_fp8.round_trip(fresh[1], kv_scale[1]))
            out, lse = self._dense_half(q, fresh, plan, batch.num_reqs, scale, sinks)
            if not plan.any_paged:
                return out.reshape(num_tokens, num_heads * head_dim)
            modes = plan.modes
        else:
            out = q.new_empty(num_tokens, num_heads, head_dim)
            lse = modes = out  # not read
        sink_ptr = out if sinks is None else sinks  # not read without sinks
        group = num_heads // kv_heads
        config, q_tiles, splits = self.plan(batch, num_heads, kv_heads, head_dim, q.dtype, q.device)
        if plan is not None and splits > 1:
            raise ValueError("a dense plan needs an unsplit launch (fix num_splits to 1)")
        block_d = max(16, _next_pow2(head_dim))
        compiled = kernels(q.device.type)
        attention_kernel = compiled.attention
        part_acc, part_max, part_sum = split_partials(out, splits, head_dim)
        window = meta.sliding_window
        pdl = pdl_enabled(q.device)
        qk_scale = (float(scale) if softcap is not None else float(scale) * LOG2E) * (kv_scale[0] if quantized else 1.0)
        attention_kernel[(batch.num_reqs * q_tiles, kv_heads, splits)](
            q, k_cache, v_cache, out, part_acc, part_max, part_sum,
            meta.block_tables, batch.query_start, batch.context_lens, modes, lse, sink_ptr,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), meta.block_tables.stride(0), *out.stride(),
            *(lse.stride() if plan is not None else (0, 0)),
            num_heads, splits, q_tiles,
            qk_scale,
            float(softcap) if softcap is not None else 0.0,
            int(window) if window is not None else 0,
            float(kv_scale[1]) if quantized else 1.0,
            BLOCK_SIZE=block_size, GROUP=group, TOKENS_PER_TILE=config.block_m // group, HEAD_DIM=head_dim,
            BLOCK_D=block_d, BLOCK_M=config.block_m, BLOCK_N=config.block_n, SOFTCAP=softcap is not None,
            WINDOW=window is not None, SPLIT=splits > 1, MODES=plan is not None, FP8=quantized,
            SINKS=sinks is not None and splits == 1,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl,
            num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
        )
        if splits > 1:
            _reduce_splits(compiled.reduce, out, (part_acc, part_max, part_sum), sinks, pdl)
        return out.reshape(num_tokens, num_heads * head_dim)
