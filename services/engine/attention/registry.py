"""Attention backends by name, and the choice of one per KV-cache group.

``auto`` picks ``triton_paged`` on CUDA when Triton imports, else ``torch_sdpa``. The reason is
what each does per layer of a step: ``torch_sdpa`` gathers every request's whole context out of
the paged cache into a padded copy and runs SDPA under an explicit boolean mask (which also keeps
PyTorch off its flash kernel), so a decode step moves each context's K/V at least three times (read,
write the copy, read it again) plus the mask; ``triton_paged`` reads each K/V page once, in place,
through the block table, and splits long contexts across the GPU when the batch is small. On CPU
there is no compiled Triton (its interpreter is for tests), so ``torch_sdpa`` stays the default.

A backend that cannot serve a group (``unsupported_reason``: a head dim above the kernel's limit,
an unsupported dtype) is replaced by ``torch_sdpa`` for that group only, with a warning naming
why; every other group keeps the requested backend.

An MLA group (DeepSeek's latent rows, ``AttentionKind.MLA``) needs an ``MLABackend``: ``triton_mla``
(``triton_mla.py``) where the name resolves to ``triton_paged`` (``auto`` on CUDA), ``torch_mla``
(``mla.py``) otherwise, and for a latent wider than the kernel holds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from services.engine.attention.base import AttentionBackend
from services.engine.attention.mla import MLABackend, TorchMLABackend
from services.engine.attention.torch_sdpa import TorchSDPABackend
from services.engine.attention.triton_mla import TritonMLABackend
from services.engine.attention.triton_paged import TritonPagedBackend
from services.engine.triton_support import triton_import_error
from services.kv.spec.groups import AttentionKind

if TYPE_CHECKING:
    from services.engine.kv_cache.buffers import KVCache

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchSDPABackend.name: TorchSDPABackend,
    TritonPagedBackend.name: TritonPagedBackend,
}
BACKEND_CHOICES = ("auto", *BACKENDS)
MLA_BACKENDS: dict[str, type[MLABackend]] = {TorchMLABackend.name: TorchMLABackend,
                                             TritonMLABackend.name: TritonMLABackend}


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The backend ``name`` stands for on ``device`` (``auto`` resolved); ValueError for an unknown one."""
    if name == "auto":
        return TritonPagedBackend.name if device.type == "cuda" and triton_import_error() is None \
            else TorchSDPABackend.name
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKEND_CHOICES)}")
    return name


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """A new instance of the backend ``name`` resolves to on ``device``."""
    return BACKENDS[resolve_backend_name(name, device)]()


def group_backends(name: str, group_shapes: Sequence[tuple[int, torch.dtype]], device: torch.device
                   ) -> list[AttentionBackend]:
    """One backend per KV-cache group, given each group's (head dim, dtype).

    An explicitly requested backend that cannot run here at all (Triton missing) is an error; one
    that cannot serve a group's shape falls back to ``torch_sdpa`` for that group, with a warning.
    """
    resolved = resolve_backend_name(name, device)
    backend = BACKENDS[resolved]()
    if resolved == TritonPagedBackend.name:
        error = triton_import_error()
        if error is not None:
            raise ValueError(f"attention backend triton_paged: {error}")
        if device.type == "cpu":
            log.warning("attention backend triton_paged on CPU runs in Triton's interpreter (slow: for tests)")
    fallback: AttentionBackend | None = None
    chosen = []
    for group_id, (head_dim, dtype) in enumerate(group_shapes):
        reason = backend.unsupported_reason(head_dim, dtype, device)
        if reason is None:
            chosen.append(backend)
            continue
        if fallback is None:
            fallback = TorchSDPABackend()
        log.warning("attention backend %s does not support KV group %d: %s; that group uses %s",
                    resolved, group_id, reason, fallback.name)
        chosen.append(fallback)
    return chosen


def mla_backend(name: str, row_width: int, dtype: torch.dtype, device: torch.device) -> MLABackend:
    """The backend of an MLA group when ``name`` was asked for: ``triton_mla`` where ``name`` resolves to
    ``triton_paged`` (``auto`` on CUDA), else ``torch_mla``; a group the kernel cannot serve falls back to
    ``torch_mla`` with a warning naming why."""
    resolved = name if name in MLA_BACKENDS else resolve_backend_name(name, device)
    if resolved not in (TritonPagedBackend.name, TritonMLABackend.name):
        return TorchMLABackend()
    backend = TritonMLABackend()
    reason = backend.rows_unsupported_reason(row_width, dtype, device)
    if reason is None:
        return backend
    if name != "auto":
        log.warning("attention backend %s cannot serve the MLA group: %s; it uses %s", name, reason,
                    TorchMLABackend.name)
    return TorchMLABackend()


def cache_group_backends(name: str, kv_cache: KVCache) -> list[AttentionBackend]:
    """``group_backends`` for the groups of ``kv_cache``, indexed by group id (shapes read off its views);
    MLA groups get ``mla_backend``."""
    groups = kv_cache.spec.groups
    mla = [g.kind is AttentionKind.MLA for g in groups]
    shapes = []
    for g, is_mla in zip(groups, mla, strict=True):
        if not is_mla:
            view = kv_cache.views[g.layer_ids[0]][0]
            shapes.append((view.shape[-1], view.dtype))
    others = iter(group_backends(name, shapes, kv_cache.device) if shapes else [])
    latent = None
    if any(mla):
        rows = kv_cache.views[groups[mla.index(True)].layer_ids[0]][0]
        latent = mla_backend(name, rows.shape[-1], rows.dtype, kv_cache.device)
    return [latent if is_mla else next(others) for is_mla in mla]
