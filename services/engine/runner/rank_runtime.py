"""One rank's runtime: its model shard, the KV layout of its heads, its KV cache and the runner.

Rank 0 (``LLMEngine``) and the follower ranks (``services.engine.tp.follower``) build the same
``RankRuntime``, so every rank holds the same layers, groups and block count, differing only in
which heads and weight rows it owns (one runtime per rank, as in nano-vllm).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from services.engine import ops
from services.engine.attention.triton_paged import configure_dense_min_query
from services.engine.engine_config import KV_CACHE_DTYPES, EngineConfig
from services.engine.kv_cache.buffers import TORCH_DTYPES, KVCache, kv_cache_groups
from services.engine.kv_cache.kv_scales import KVScales
from services.engine.kv_cache.state_pool import StatePool
from services.engine.loading.fp8_model import fp8_compute_chosen, keep_fp8_projections
from services.engine.loading.mxfp4_model import mxfp4_experts_chosen
from services.engine.loading.quant.stream import checkpoint_tensors
from services.engine.loading.source import ModelSource
from services.engine.loading.weights import dummy_quantized_checkpoint, dummy_weights
from services.engine.models import DecoderModel, build_model
from services.engine.runner.cuda_graphs import DecodeGraphRunner
from services.engine.runner.model_runner import ModelRunner
from services.engine.runner.prefill_graphs import PrefillGraphRunner, prefill_graphs_for
from services.engine.triton_support import configure_pdl
from services.kv.spec.layout import KVLayoutSpec

CPU_KV_CACHE_BYTES = 1 << 30

log = logging.getLogger(__name__)


def use_device(device: torch.device) -> None:
    """Make ``device`` current before any CUDA work: kernels, NCCL and graph capture use the
    current device's stream, so a worker on cuda:1 that never set it would capture on GPU 0's."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def load_model(config: EngineConfig, source: ModelSource, dtype: str, device: torch.device) -> DecoderModel:
    """This rank's shard of the model, with the checkpoint's weights or seeded dummy ones; an FP8 checkpoint's
    projections kept in FP8 and an MXFP4 checkpoint's experts in MXFP4 where ``--quantization`` says so
    (``loading.fp8_model``, ``loading.mxfp4_model``), the rest dequantized."""
    scheme = source.quantization
    mxfp4 = mxfp4_experts_chosen(config.quantization, scheme, device, source.name)
    model = build_model(source.config, config.parallel, TORCH_DTYPES[dtype], device, mxfp4_experts=mxfp4)
    keep: frozenset[str] = model.mxfp4_modules() if mxfp4 else frozenset()
    if not mxfp4 and fp8_compute_chosen(config.quantization, scheme, device, source.name):
        keep = keep_fp8_projections(model, scheme)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the replaced bf16 storage: free memory sizes the KV cache
    if source.weights is not None:
        weights = source.weights(keep)
    elif scheme is not None:
        weights = checkpoint_tensors(dummy_quantized_checkpoint(model, scheme, config.seed), scheme, keep)
    else:
        weights = dummy_weights(model, config.seed)
    with torch.no_grad():
        model.load_weights(weights)
    return model.eval()


def kv_layout(config: EngineConfig, source: ModelSource, dtype: str, num_blocks: int) -> KVLayoutSpec:
    """This rank's KV layout: its heads of every group, ``num_blocks`` blocks (scratch included), in the KV
    cache's ``dtype`` (``EngineConfig.resolve_kv_cache_dtype``: an FP8 cache's blocks cost a byte per element)."""
    mc = source.config
    kind, order = config.kv_layout_choice()
    return KVLayoutSpec(
        kind=kind,
        order=order,
        num_blocks=num_blocks,
        num_kv_heads=config.parallel.num_local_kv_heads(mc.num_kv_heads),
        head_dim=mc.head_dim,
        dtype=dtype,
        groups=kv_cache_groups(mc, config.block_size, config.parallel),
    )


def num_blocks_for(config: EngineConfig, source: ModelSource, dtype: str, device: torch.device) -> int:
    """Blocks the layout holds (scratch block included): ``num_kv_blocks + 1``, or what fits the budget.

    Under TP every rank computes this from its own memory and the ranks agree on the smallest.
    """
    if config.num_kv_blocks:
        return config.num_kv_blocks + 1
    layout = kv_layout(config, source, dtype, 1)
    # Every group has num_blocks blocks: one block id costs a block in each group.
    per_block = sum(layout.block_bytes(g.group_id) for g in layout.groups)
    budget = config.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(free - total * (1.0 - config.gpu_memory_utilization))
        else:
            budget = CPU_KV_CACHE_BYTES
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise ValueError(f"KV-cache budget of {budget} bytes holds no block of {per_block} bytes "
                         "beside the scratch block")
    return int(num_blocks)


def log_kv_pool(layout: KVLayoutSpec, num_kv_blocks: int, rank: int) -> None:
    """The start-up line of the pool's size: blocks, the tokens they hold (per group: each block id is a block
    of every group), the dtype and the bytes (scratch block included), so an FP8 pool's 2x shows."""
    tokens = ", ".join(f"{num_kv_blocks * g.block_size} tokens in group {g.group_id}" for g in layout.groups)
    log.info("rank %d KV cache: %d blocks (%s), %s, %.3f GiB", rank, num_kv_blocks, tokens, layout.dtype,
             layout.total_bytes / 2**30)


def max_model_len_for(config: EngineConfig, source: ModelSource, num_kv_blocks: int) -> int:
    """The context length: ``config.max_model_len``, or what the model and the KV pool allow.

    ValueError when ``config.max_model_len`` asks for more than that.
    """
    capacity = num_kv_blocks * config.block_size
    positions = source.config.max_position_embeddings
    limit = min(positions, capacity)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds what the model ({positions} positions)"
            f" and the KV cache ({capacity} tokens) allow"
        )
    return config.max_model_len


class RankRuntime:
    """What one rank runs a step with: model shard, KV layout and cache, and the model runner.

    ``agree_num_blocks`` turns the block count this rank's memory allows into the one every rank
    allocates (under TP the smallest; rank 0 asks the followers, a follower asks rank 0). The
    layout's last block is the scratch block: allocated, never given to the block manager, so
    pool ids are ``0 .. num_kv_blocks - 1`` and ``num_kv_blocks`` is the placeholder entry.
    """

    def __init__(self, config: EngineConfig, source: ModelSource,
                 agree_num_blocks: Callable[[int], int] | None = None) -> None:
        self.config = config
        self.source = source
        self.device = config.resolve_device()
        use_device(self.device)
        self.dtype = config.resolve_dtype(self.device, source.checkpoint_dtype)
        # The speed switches are process-wide (each follower rank sets its own); a PDSERVE_* override wins.
        ops.configure(config.fused_ops, fused_kv_write=config.fused_kv_write, decode_gemv=config.decode_gemv)
        configure_pdl(config.pdl)
        configure_dense_min_query(config.dense_min_query)
        self.model = load_model(config, source, self.dtype, self.device)
        self.kv_dtype = config.resolve_kv_cache_dtype(self.dtype)
        # What each layer's K/V is divided by in an FP8 cache (1.0 otherwise): a later compat check reads these.
        self.kv_scales = KVScales.for_cache(self.kv_dtype, source.config.num_layers, source.kv_scales)
        num_blocks = num_blocks_for(config, source, self.kv_dtype, self.device)
        if agree_num_blocks is not None:
            num_blocks = agree_num_blocks(num_blocks)
        self.kv_layout = kv_layout(config, source, self.kv_dtype, num_blocks)
        self.num_kv_blocks = self.kv_layout.num_blocks - 1
        # A 16-bit cache rounds the K/V of requests for an FP8 reader with the scales an FP8 cache would use.
        fp8_scales = None if self.kv_scales.quantized else KVScales.for_cache(
            KV_CACHE_DTYPES["fp8_e4m3"], source.config.num_layers, source.kv_scales)
        self.kv_cache = KVCache(self.kv_layout, self.device, scratch_block=self.num_kv_blocks, scales=self.kv_scales,
                                fp8_scales=fp8_scales)
        log_kv_pool(self.kv_layout, self.num_kv_blocks, config.parallel.tp_rank)
        # One state row per sequence seat: a running request always has its slot (StateSlots); states keep the
        # model dtype whatever the KV cache's.
        self.state_pool = StatePool.for_model(source.config, config.max_num_seqs, TORCH_DTYPES[self.dtype],
                                              self.device, config.parallel)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, decode_graphs=self._decode_graphs(),
                                  kv_shared_prefill_skip=config.kv_shared_prefill_skip,
                                  attention_backend=config.attention_backend,
                                  prefill_graphs=self._prefill_graphs(), state_pool=self.state_pool)

    @functools.cached_property
    def max_model_len(self) -> int:
        """The context length (computed on first use: only rank 0 schedules, so only it asks)."""
        return max_model_len_for(self.config, self.source, self.num_kv_blocks)

    def _decode_graphs(self) -> DecodeGraphRunner | None:
        """CUDA graphs for pure-decode steps, unless disabled or unsupported (CPU, TP > 1, a model that
        cannot be captured: every rank then runs every step eagerly)."""
        config = self.config
        if (config.enforce_eager or self.device.type != "cuda" or config.parallel.tp_size > 1
                or not self.model.supports_cuda_graphs):
            return None
        return DecodeGraphRunner(self.model, self.kv_cache, config.max_num_seqs, self.max_model_len,
                                 attention_backend=config.attention_backend, state_pool=self.state_pool)

    def _prefill_graphs(self) -> PrefillGraphRunner | None:
        """CUDA graphs for short prefill steps, on CUDA at TP 1 for a model that can be captured and has no state
        layers (``prefill_graphs_for`` says when else none)."""
        if (self.device.type != "cuda" or self.config.parallel.tp_size > 1 or not self.model.supports_cuda_graphs
                or self.state_pool is not None):  # a state layer's prefill scan reads its chunk lengths on the host
            return None
        return prefill_graphs_for(self.config, self.model, self.kv_cache, self.max_model_len)
