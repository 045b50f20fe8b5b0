"""What every TP rank builds for itself: its model shard and the KV cache layout of its heads.

Rank 0 (``LLMEngine``) and the follower ranks (``services.engine.tp.follower``) call the same
functions, so every rank holds the same layers, groups and block count, differing only in which
heads and weight rows it owns.
"""

from __future__ import annotations

import torch

from services.engine.engine_config import EngineConfig
from services.engine.kv_cache.buffers import TORCH_DTYPES, kv_cache_groups
from services.engine.loading.source import ModelSource
from services.engine.loading.weights import dummy_weights
from services.engine.models import DecoderModel, build_model
from services.kv.layout import KVLayoutSpec

CPU_KV_CACHE_BYTES = 1 << 30


def use_device(device: torch.device) -> None:
    """Make ``device`` current before any CUDA work: kernels, NCCL and graph capture use the
    current device's stream, so a worker on cuda:1 that never set it would capture on GPU 0's."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def load_model(config: EngineConfig, source: ModelSource, dtype: str, device: torch.device) -> DecoderModel:
    """This rank's shard of the model, with the checkpoint's weights or seeded dummy ones."""
    model = build_model(source.config, config.parallel, TORCH_DTYPES[dtype], device)
    weights = source.weights() if source.weights is not None else dummy_weights(model, config.seed)
    with torch.no_grad():
        model.load_weights(weights)
    return model.eval()


def kv_layout(config: EngineConfig, source: ModelSource, dtype: str, num_blocks: int) -> KVLayoutSpec:
    """This rank's KV layout: its heads of every group, ``num_blocks`` blocks (scratch included)."""
    mc = source.config
    return KVLayoutSpec(
        kind=config.kv_layout,
        order=config.kv_block_order,
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

