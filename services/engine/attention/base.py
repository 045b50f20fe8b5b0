"""The attention interface: per-step metadata, per-group metadata, and what a backend implements.

A step's tokens arrive flattened (``[num_tokens, heads, head_dim]``); request ``i`` owns the
tokens ``query_start[i] : query_start[i+1]`` at context positions
``context_lens[i] - query_lens[i] .. context_lens[i] - 1`` (a decode row has query length 1, a
prefill chunk may follow a prefix-cache hit)::

    request 0: decode      query_len 1, context_len 300 -> token at position 299
    request 1: prefill     query_len 5, context_len 21  -> tokens at 16..20 (16 cached tokens)
    query_start = [0, 1, 6]

Building the metadata is split in two. The runner (or the decode-graph runner, inside its
captured forward) makes one ``AttentionBatch`` of device tensors per step, then asks each KV
group's backend for that group's ``GroupAttentionMetadata`` (``AttentionBackend.build_metadata``):
only the chosen backend's extras are built (the boolean mask exists only for ``torch_sdpa``). Each
layer then calls ``paged_attention``, which writes the layer's new K/V into the paged cache (one
fused launch that also applies the layer's RoPE to q and k when given a ``Rope``) and runs the
group's backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from services.engine import ops
from services.engine.attention.kv_rounding import KVRounding
from services.engine.kv_cache.kv_scales import UNIT_SCALE


@dataclass(frozen=True)
class GroupAttentionMetadata:
    """Per KV-cache group: where new tokens are written, what each request reads, and the
    extras of the group's backend (``None`` / default where that backend needs none)."""

    backend: AttentionBackend
    write_blocks: torch.Tensor  # [num_tokens] block id of each new token
    write_offsets: torch.Tensor  # [num_tokens] offset inside that block
    block_tables: torch.Tensor  # [num_reqs, max_blocks]; entries past a request's context are padding
    sliding_window: int | None  # keys older than this many positions are hidden
    # torch_sdpa only: [num_reqs, 1, max_query_len, max_context_len] bool (True = attend), and the
    # slot of each token in the padded [num_reqs * max_query_len] query batch.
    mask: torch.Tensor | None = None
    query_slots: torch.Tensor | None = None
    # triton_paged only: the requests whose fresh tokens attend to each other through a dense kernel.
    dense: DensePlan | None = None


@dataclass(frozen=True)
class DenseRequest:
    """A request whose chunk is long enough for a dense causal kernel over its own fresh tokens."""

    index: int  # in the step's requests
    token_start: int  # its first row of the step's flattened tokens
    num_tokens: int  # its query length
    prefix_len: int  # context before the chunk (prefix-cache hits, earlier chunks): read from the pages


@dataclass(frozen=True)
class DensePlan:
    """How one group's attention splits for a prefill-shaped step.

    The fresh tokens of each dense request attend to each other through a dense causal kernel on
    this step's contiguous K/V; their earlier context, if any, through the paged kernel, and the two
    halves merge by their log-sum-exp. ``modes`` [num_reqs] int32 tells the paged kernel what to do
    per request: ``PAGED`` (everything, as without a plan), ``PREFIX_MERGE`` (the prefix only, then
    merge with the dense half already in the output) or ``SKIP`` (no prefix: the dense half is all).
    """

    requests: tuple[DenseRequest, ...]
    modes: torch.Tensor
    any_paged: bool  # some request needs the paged kernel at all


PAGED, PREFIX_MERGE, SKIP = 0, 1, 2


@dataclass(frozen=True)
class AttentionBatch:
    """What every attention layer of one forward pass needs: the step's shape and per-group metadata.

    ``max_query_len`` and ``max_context_len`` are host integers: exact in an eager step, upper
    bounds fixed at capture in a decode graph (1 and the context bucket). The tensors live on
    the model's device; ``context_lens`` may be int32 or int64.
    """

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_context_len: int
    query_start: torch.Tensor  # [num_reqs + 1] cumulative query lengths
    query_lens: torch.Tensor  # [num_reqs]
    context_lens: torch.Tensor  # [num_reqs] tokens in context after this step (cached + new)
    groups: tuple[GroupAttentionMetadata, ...] = ()
    # (query lens, context lens) on the host: known for eager steps, None in a captured graph.
    host_lens: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # Requests whose K/V this 16-bit cache rounds through e4m3 (``kv_rounding``), else None.
    kv_rounding: KVRounding | None = None

    def with_groups(self, groups: tuple[GroupAttentionMetadata, ...]) -> AttentionBatch:
        return replace(self, groups=groups)


def step_batch(query_lens: Sequence[int], context_lens: Sequence[int], device: torch.device) -> AttentionBatch:
    """The step part of an ``AttentionBatch`` (no groups yet) from host lengths, in one host-to-device copy."""
    n = len(query_lens)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    packed = torch.tensor([*starts, *query_lens, *context_lens], dtype=torch.int32, device=device)
    return AttentionBatch(
        num_reqs=n, num_tokens=starts[-1], max_query_len=max(query_lens), max_context_len=max(context_lens),
        query_start=packed[: n + 1], query_lens=packed[n + 1: 2 * n + 1], context_lens=packed[2 * n + 1:],
        host_lens=(tuple(query_lens), tuple(context_lens)),
    )


@dataclass(frozen=True)
class TailBatch:
    """The step's tokens whose output is read, for the layers after the last one that writes KV.

    Layers that only read earlier layers' KV (KV-shared layers) write nothing a later token needs,
    so past the last KV-writing layer only tokens whose logits are used must go on: the last token
    of each sampling chunk, every token of a chunk that returns logits, none of a chunk in the
    middle of a chunked prefill. Each request's tail rows are a suffix of its chunk, so ``batch``
    is the same attention problem with shorter queries over the same contexts::

        chunk of 5 tokens at positions 3..7, samples   -> tail row: position 7 (query length 1)
        chunk of 4 tokens at positions 0..3, mid-prefill -> no tail rows

    ``rows`` index the step's flattened tokens; ``batch`` holds only requests with tail rows.
    """

    rows: torch.Tensor
    batch: AttentionBatch | None  # None when no token of the step needs output


class AttentionBackend(ABC):
    """One way to attend over the paged cache. Stateless per step: all step state is metadata.

    ``build_metadata`` runs once per step and KV group (inside the captured region for decode
    graphs, so it must not sync with the device: device tensor ops and host integers only);
    ``forward`` runs once per layer.
    """

    name: ClassVar[str]

    def unsupported_reason(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why this backend cannot serve a group of this head dim and dtype, or None if it can."""
        return None

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch, block_tables: torch.Tensor, write_blocks: torch.Tensor,
                       write_offsets: torch.Tensor, sliding_window: int | None) -> GroupAttentionMetadata:
        """This group's metadata for the step described by ``batch`` (whose ``groups`` are not set yet)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                meta: GroupAttentionMetadata, scale: float, softcap: float | None,
                fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_scale: tuple[float, float] = UNIT_SCALE, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q`` [num_tokens, heads, head_dim] over the cache (this step's K/V already
        written). ``fresh``: this step's K/V rows as computed (absent in layers that write none), for a
        backend that attends to them without the pages. ``kv_scale``: the layer's (k, v) scales, which
        an FP8 cache's values are multiplied by when read (``ops.kv_fp8``). ``sinks``: float32 [heads], one
        learned logit per head that joins every softmax with a zero value (gpt-oss's attention sinks: a row
        may give part of its weight to nothing). Returns [num_tokens, heads * head_dim] in ``q``'s dtype."""


@dataclass(frozen=True)
class Rope:
    """The rotate-half RoPE a layer's q and k still need: ``paged_attention`` applies it in the
    launch that writes K/V. ``cos``/``sin`` and ``positions`` as in ``ops.apply_rope``: a table over
    positions (with ``positions``), or the step's own per-token angles (without)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None = None


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: GroupAttentionMetadata, kv_scale: tuple[float, float] = UNIT_SCALE) -> None:
    """Store this step's K/V rows ([num_tokens, kv_heads, head_dim]) in their cache slots (one launch;
    an FP8 cache gets them quantized with ``kv_scale``)."""
    ops.write_kv(k, v, k_cache, v_cache, meta.write_blocks, meta.write_offsets, kv_scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    meta: GroupAttentionMetadata,
    scale: float,
    softcap: float | None = None,
    rope: Rope | None = None,
    kv_scale: tuple[float, float] = UNIT_SCALE,
    rounding_scale: tuple[float, float] = UNIT_SCALE,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this step's K/V in the cache, then attend with the group's backend.

    ``k_cache``/``v_cache`` are [num_blocks, block_size, kv_heads, head_dim] views (any strides).
    ``k``/``v`` None: a layer that reads another layer's KV and writes none. ``softcap``: scores
    become ``softcap * tanh(scores / softcap)`` before the mask (Gemma-2). ``rope``: q and k are not
    rotated yet; they are rotated in the same launch that writes K/V (on the Triton path).
    ``kv_scale``: the (k, v) scales of the layer whose cache this is (``LayerKV.scales``): an FP8
    cache stores ``K / k_scale`` and ``V / v_scale`` in e4m3 and attention reads them scaled back.
    ``rounding_scale``: the (k, v) scales an FP8 cache of the model would use for the layer
    (``LayerKV.fp8_scales``), which the rows ``batch.kv_rounding`` marks are rounded with.
    ``sinks``: the layer's attention-sink logits (float32 [heads]; see ``AttentionBackend.forward``).
    Returns [num_tokens, heads * head_dim].
    """
    if k is None:
        if rope is not None:
            q, _ = ops.apply_rope(q, None, rope.cos, rope.sin, rope.positions)
        return meta.backend.forward(q, k_cache, v_cache, batch, meta, scale, softcap, kv_scale=kv_scale, sinks=sinks)
    if batch.kv_rounding is not None:  # rotate first: the rounding is of the keys as stored
        if rope is not None:
            q, k = ops.apply_rope(q, k, rope.cos, rope.sin, rope.positions)
            rope = None
        k, v = batch.kv_rounding.apply(k, rounding_scale[0]), batch.kv_rounding.apply(v, rounding_scale[1])
    if rope is None:
        write_kv(k, v, k_cache, v_cache, meta, kv_scale)
    else:
        q, k = ops.rope_and_write_kv(q, k, v, rope.cos, rope.sin, rope.positions, k_cache, v_cache,
                                     meta.write_blocks, meta.write_offsets, kv_scale)
    return meta.backend.forward(q, k_cache, v_cache, batch, meta, scale, softcap, fresh=(k, v), kv_scale=kv_scale,
                                sinks=sinks)
