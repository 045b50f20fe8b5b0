"""The engine's KV cache: buffers allocated from a layout spec, and per-layer strided views."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from services.engine.kv_cache.kv_scales import UNIT_SCALE, KVScales
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
from services.kv.spec.layout import DTYPE_SIZES, KVLayoutSpec

if TYPE_CHECKING:
    from services.engine.model_config.hf import ModelConfig
    from services.engine.parallel import ParallelConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float8_e4m3fn": torch.float8_e4m3fn}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class LayerKV(tuple):
    """One layer's cache views (``(K, V)``; MLA ``(rows,)``; a state layer ``()``), and ``scales``: the
    ``(k_scale, v_scale)`` its values are stored with (``KVScales``), which the layer hands to attention.

    A tuple, so a model indexes it as before (``kv[0]``, ``kv[1]``) and reads ``kv.scales`` beside.
    """

    scales: tuple[float, float]
    fp8_scales: tuple[float, float]

    def __new__(cls, views: tuple[torch.Tensor, ...], scales: tuple[float, float],
                fp8_scales: tuple[float, float] = UNIT_SCALE) -> LayerKV:
        layer = super().__new__(cls, views)
        layer.scales = scales
        layer.fp8_scales = fp8_scales  # what an FP8 cache of the model stores it with (``attention.kv_rounding``)
        return layer


class KVCache:
    """Owns the KV buffers. ``views[layer] = (K, V)``, each [num_blocks, block_size, heads, head_dim];
    an MLA layer's is ``(rows,)``, its one plane of latent rows [num_blocks, block_size, 1, row width].

    The buffers are plain contiguous tensors so a transfer agent can register them by address;
    the views are ``as_strided`` windows onto them as the spec dictates.

    ``scratch_block`` (if set) is a block of the spec that the block manager never hands out:
    padded rows of a decode CUDA graph write their K/V there, so no request's block is touched.
    The spec counts it (the buffers really hold it); the manager's pool does not.

    ``scales`` (``KVScales``): what each layer's K and V are divided by in an FP8 cache; ``views_by_layer``
    hands them to the layers with their views. None: 1.0 everywhere. ``fp8_scales``: the scales an FP8 cache of
    the model would use (a 16-bit cache rounds some requests' K/V with them: ``attention.kv_rounding``).
    """

    def __init__(self, spec: KVLayoutSpec, device: torch.device, scratch_block: int | None = None,
                 scales: KVScales | None = None, fp8_scales: KVScales | None = None) -> None:
        if scratch_block is not None and not 0 <= scratch_block < spec.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is outside the {spec.num_blocks} blocks of the layout")
        if scales is not None and scales.dtype != spec.dtype:
            raise ValueError(f"KV scales for a {scales.dtype} cache given to a {spec.dtype} layout")
        self.spec = spec
        self.scales = scales
        self.fp8_scales = fp8_scales
        self.device = device
        self.scratch_block = scratch_block
        dtype = TORCH_DTYPES[spec.dtype]
        self.buffers = [
            torch.zeros(b.num_bytes // spec.element_size, dtype=dtype, device=device) for b in spec.buffers()
        ]
        self.views: dict[int, tuple[torch.Tensor, ...]] = {
            layer: tuple(self._view(layer, kv) for kv in range(spec.group_of_layer(layer).num_kv_planes))
            for layer in spec.layer_ids
        }

    def scale_of(self, layer: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` layer ``layer``'s values are stored with (1.0 without ``scales``)."""
        return UNIT_SCALE if self.scales is None else self.scales.of(layer)

    def _view(self, layer: int, kv: int) -> torch.Tensor:
        v = self.spec.view(layer, kv)
        return torch.as_strided(self.buffers[v.buffer_index], v.shape, v.strides, v.offset)

    def views_by_layer(self, kv_sharing: dict[int, int], num_layers: int, state_layers: Collection[int] = ()
                       ) -> tuple[list[LayerKV], list[int]]:
        """(K, V) views (MLA: ``(rows,)``) with their scales, and KV group of every layer; a KV-sharing layer
        gets its source's (views and scales: it reads what the source wrote).

        A state layer (Mamba2: no KV) gets no views and group -1.
        """
        sources = [kv_sharing.get(i, i) for i in range(num_layers)]
        fp8 = self.fp8_scales
        return ([LayerKV((), UNIT_SCALE) if s in state_layers
                 else LayerKV(self.views[s], self.scale_of(s), UNIT_SCALE if fp8 is None else fp8.of(s))
                 for s in sources],
                [-1 if s in state_layers else self.spec.group_of_layer(s).group_id for s in sources])

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


def kv_cache_groups(config: ModelConfig, block_size: int, parallel: ParallelConfig) -> tuple[KVCacheGroupSpec, ...]:
    """The model's KV-cache groups: one per (attention kind, window, KV heads, head dim).

    MLA layers (DeepSeek) state one "KV head" as wide as their latent row, so they form one MLA group
    whose page is one row per token and layer.

    Only layers that compute KV are in a group (a state layer, Mamba2, computes none); a layer that
    reads another layer's KV (Gemma-4's KV-shared layers) owns none and reads its source's pages.
    Groups are numbered by their first
    layer, and each carries this TP rank's heads and its head dim so the layout needs no guess::

        Gemma-4-like, 6 layers, layer 5 reads layer 3:
        types  S S S F S(->3) F(->... )     group 0: sliding, layers 0,1,2   (first layer 0)
                                            group 1: full,    layers 3       (first layer 3)

    Separate pools per group, not one pool of equal-sized pages (vLLM's hybrid allocator): groups
    here may differ in page size (head dims and heads differ per group), and a separate pool lets
    the sliding-window group free out-of-window blocks without fragmenting the full group's runs.
    """
    by_shape: dict[tuple, list[int]] = {}
    for i, layer in enumerate(config.layers):
        if layer.kv_source is not None or i in config.state_layer_ids:
            continue
        key = (layer.attention, layer.sliding_window, parallel.num_local_kv_heads(layer.num_kv_heads), layer.head_dim)
        by_shape.setdefault(key, []).append(i)
    return tuple(
        KVCacheGroupSpec(gid, kind, tuple(layers), block_size, window, heads, head_dim)
        for gid, ((kind, window, heads, head_dim), layers) in enumerate(by_shape.items())
    )
