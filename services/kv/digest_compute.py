"""Run a digest job where the KV lives: the Triton kernel for CUDA buffers, the host arithmetic otherwise."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.kv.digest import DigestJob, check_job, corrupt_blocks, digest_units_host, layer_views
from services.kv.layout import KVLayoutSpec


def digest_job(layout: KVLayoutSpec, buffers: Sequence[torch.Tensor], job: DigestJob,
               views_cache: dict | None = None) -> np.ndarray:
    """The job's unit digests (uint64, one per unit from ``start // unit``), computed on the buffers' device.

    ``views_cache``: a dict the owner of ``buffers`` keeps (a rank's buffers never change), so each
    group's layer views are made once."""
    check_job(layout, job)
    cache = {} if views_cache is None else views_cache
    views = cache.get((layout, job.group_id))
    if views is None:
        views = cache[layout, job.group_id] = layer_views(layout, buffers, job.group_id)
    block_size = layout.block_size(job.group_id)
    if job.corrupt:
        corrupt_blocks(views, block_size, job)
    if views[0][2].is_cuda:
        from services.kv.digest_triton import digest_units_cuda  # Triton only where a GPU digest runs

        sums = digest_units_cuda(views, block_size, job)
    else:
        sums = digest_units_host(views, block_size, job)
    return sums.cpu().numpy().view(np.uint64)


def warm_up(layout: KVLayoutSpec, buffers: Sequence[torch.Tensor], views_cache: dict) -> None:
    """Compile the CUDA digest kernel for this layout now (a first compile takes most of a second),
    not in the first request's pull; a no-op on CPU."""
    if not buffers or not buffers[0].is_cuda:
        return
    for group in layout.groups:
        bs = group.block_size
        digest_job(layout, buffers, DigestJob(group.group_id, [0], 0, bs, bs, 0, layout.kv_heads(group.group_id), 0),
                   views_cache)
