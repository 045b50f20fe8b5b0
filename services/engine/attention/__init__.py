"""Paged attention behind one interface, with interchangeable backends.

* ``base.py``: the step metadata (``AttentionBatch``, per-group ``GroupAttentionMetadata``,
  ``TailBatch``), the ``AttentionBackend`` interface, and ``paged_attention``, which every model
  layer calls: it writes the layer's new K/V into the cache and runs the group's backend.
* ``torch_sdpa.py``: gather + masked SDPA (portable; the CPU path and the tests' reference).
* ``triton_paged.py`` / ``triton_kernels.py``: a Triton kernel reading the paged cache in place.
* ``mla.py``: multi-head latent attention (DeepSeek) over a cache of latent rows, in its expanded
  and absorbed forms: the ``MLABackend`` interface and ``torch_mla``; ``triton_mla.py``: the CUDA one.
* ``registry.py``: backends by name, ``auto``, and the per-group choice with its fallback.
* ``kv_rounding.py``: the K/V of requests for an FP8-KV reader rounded through e4m3 in a 16-bit cache.
"""

from services.engine.attention.base import (
    AttentionBackend,
    AttentionBatch,
    GroupAttentionMetadata,
    Rope,
    TailBatch,
    paged_attention,
    step_batch,
    write_kv,
)
from services.engine.attention.kv_rounding import KVRounding
from services.engine.attention.mla import MLABackend, write_rows
from services.engine.attention.registry import (
    BACKEND_CHOICES,
    BACKENDS,
    cache_group_backends,
    group_backends,
    make_backend,
    resolve_backend_name,
)

__all__ = [
    "BACKENDS",
    "BACKEND_CHOICES",
    "AttentionBackend",
    "AttentionBatch",
    "GroupAttentionMetadata",
    "KVRounding",
    "MLABackend",
    "Rope",
    "TailBatch",
    "cache_group_backends",
    "group_backends",
    "make_backend",
    "paged_attention",
    "resolve_backend_name",
    "step_batch",
    "write_kv",
    "write_rows",
]
