"""The engine's KV cache: buffers allocated from a layout spec, and per-layer strided views."""

from __future__ import annotations

import torch

from services.kv.groups import AttentionKind, KVCacheGroupSpec
from services.kv.layout import DTYPE_SIZES, KVLayoutSpec

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class KVCache:
    """Owns the KV buffers. ``views[layer] = (K, V)``, each [num_blocks, block_size, heads, head_dim].

    The buffers are plain contiguous tensors so a transfer agent can register them by address;
    the views are ``as_strided`` windows onto them as the spec dictates.

    ``scratch_block`` (if set) is a block of the spec that the block manager never hands out:
    padded rows of a decode CUDA graph write their K/V there, so no request's block is touched.
    The spec counts it (the buffers really hold it); the manager's pool does not.
    """

    def __init__(self, spec: KVLayoutSpec, device: torch.device, scratch_block: int | None = None) -> None:
        if scratch_block is not None and not 0 <= scratch_block < spec.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is outside the {spec.num_blocks} blocks of the layout")
        self.spec = spec
        self.device = device
        self.scratch_block = scratch_block
        dtype = TORCH_DTYPES[spec.dtype]
        self.buffers = [
            torch.zeros(b.num_bytes // spec.element_size, dtype=dtype, device=device) for b in spec.buffers()
        ]
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            layer: (self._view(layer, 0), self._view(layer, 1)) for layer in spec.layer_ids
        }

    def _view(self, layer: int, kv: int) -> torch.Tensor:
        v = self.spec.view(layer, kv)
        return torch.as_strided(self.buffers[v.buffer_index], v.shape, v.strides, v.offset)

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: str) -> int:
    """Bytes one block costs across all layers, K and V (for sizing the pool from a memory budget)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * DTYPE_SIZES[dtype]


def kv_groups_for(num_layers: int, block_size: int, sliding_window: int | None) -> tuple[KVCacheGroupSpec, ...]:
    """KV-cache groups of a model whose layers all attend alike (one group).

    Hybrids (some layers windowed, some full) will return one group per attention kind.
    """
    layers = tuple(range(num_layers))
    if sliding_window is None:
        return (KVCacheGroupSpec(0, AttentionKind.FULL, layers, block_size),)
    return (KVCacheGroupSpec(0, AttentionKind.SLIDING_WINDOW, layers, block_size, sliding_window),)
