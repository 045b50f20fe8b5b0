"""CUDA graphs for decode steps: one captured forward per (batch, context) bucket, replayed.

An eager decode step of an 8B model launches ~1,700 kernels; at small batches the CPU cannot
launch them as fast as the GPU runs them. A graph replays them all with one launch. A graph's
shapes and addresses are fixed, so a step is padded up to a bucket and copied into that
bucket's static input buffer::

    3 requests, contexts 300, 517, 9   -> bucket (batch 4, context 768)
    rows 0..2  the requests; block-table tails padded with the scratch block (masked out)
    row 3      padding: token 0 at position 0, every block the scratch block, so it writes K/V
               into the scratch block only, attends to its key 0 only, and its logits are dropped
               (a model with state layers: its state slot is the state pool's scratch slot)

The host sends one int64 vector per step -- token ids, context lengths, block tables -- and the
graph derives positions, write slots and each group's attention metadata from it (the backend's
``build_metadata`` runs inside the captured region), so nothing computed on the host can be left
stale in a replay. The context bucket fixes ``max_context_len``: for ``torch_sdpa`` the gather
length and mask width, for ``triton_paged`` only the split count (its kernel reads each request's
real context length from the device buffer and visits only those keys).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from services.engine.attention import AttentionBatch, cache_group_backends
from services.engine.kv_cache.buffers import KVCache
from services.engine.kv_cache.state_pool import StateBatch, StatePool
from services.engine.models import DecoderModel
from services.engine.runner.step import Chunk, DeviceTokens

T = TypeVar("T")

# Smallest context bucket (tokens). Buckets are powers of two and the midpoints between them, so
# a step's bound is at most a third above its longest context (what torch_sdpa gathers and masks).
MIN_CONTEXT_BUCKET = 256


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``max_batch_size``, then ``max_batch_size`` itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = []
    size = 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch_size)


def context_buckets(max_context_len: int, granularity: int, min_bucket: int = MIN_CONTEXT_BUCKET) -> tuple[int, ...]:
    """Context lengths in tokens, each a multiple of ``granularity`` (every group's block size).

    ``min_bucket``, 1.5x, 2x, 3x, 4x, ... up to ``max_context_len`` rounded up to ``granularity``.
    """
    if max_context_len < 1 or granularity < 1 or min_bucket < 1:
        raise ValueError("max_context_len, granularity and min_bucket must be >= 1")
    top = _round_up(max_context_len, granularity)
    sizes = {top}
    size = min_bucket
    while size < top:
        sizes.update(_round_up(s, granularity) for s in (size, size * 3 // 2))
        size *= 2
    return tuple(s for s in sorted(sizes) if s <= top)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def capture_mode(device: torch.device, capture: bool | None) -> bool:
    """Whether a graph runner captures (default: on CUDA) or runs its static-buffer forward eagerly."""
    capture = device.type == "cuda" if capture is None else capture
    if capture and device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device")
    return capture


def capture_graph(device: torch.device, pool: object | None, forward: Callable[[], T]
                  ) -> tuple[torch.cuda.CUDAGraph, object, T]:
    """Warm ``forward`` up on a side stream (lazy inits must not be captured), then capture it with memory from
    ``pool`` (a new pool when None; graphs that never run at once can share one). Returns the graph, the pool and
    what the captured call returned (its static output)."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        forward()
    current.wait_stream(side)
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = forward()
    return graph, pool, out


@dataclass
class _Bucket:
    """Static buffers of one (batch, context) graph; the tensors are views into ``packed``."""

    batch_size: int
    context_len: int
    packed: torch.Tensor  # int64 [batch * (2 + sum of block-table widths)]
    input_ids: torch.Tensor  # [batch]
    context_lens: torch.Tensor  # [batch]; padding rows hold 1
    block_tables: tuple[torch.Tensor, ...]  # per group [batch, context_len // block_size]
    state_slots: torch.Tensor | None  # [batch] each request's state slot (models with state layers); padding: scratch
    query_start: torch.Tensor  # arange(batch + 1): one query per request
    query_lens: torch.Tensor  # ones(batch)
    logits: torch.Tensor | None = None  # [batch, vocab] fp32, the graph's output
    graph: torch.cuda.CUDAGraph | None = field(default=None, repr=False)


class DecodeGraphRunner:
    """Runs batches whose chunks are one token each through per-bucket CUDA graphs.

    Graphs are captured lazily on a bucket's first use and share one memory pool. With
    ``capture=False`` (the default off CUDA) the same static-buffer forward runs eagerly, which
    is how the padding logic is tested on CPU.
    """

    def __init__(self, model: DecoderModel, kv_cache: KVCache, max_batch_size: int, max_context_len: int,
                 *, capture: bool | None = None, min_context_bucket: int = MIN_CONTEXT_BUCKET,
                 attention_backend: str = "auto", state_pool: StatePool | None = None) -> None:
        if kv_cache.scratch_block is None:
            raise ValueError("decode graphs need a KV cache with a scratch block for padded rows")
        self.model = model
        self.state_pool = state_pool  # a model with state layers: each row's slot is a static input too
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.capture = capture_mode(self.device, capture)
        spec = kv_cache.spec
        self.groups = spec.groups
        self.kv_views, self.layer_groups = kv_cache.views_by_layer(model.config.kv_sharing, model.config.num_layers,
                                                                   model.config.state_layer_ids)
        self.group_backends = cache_group_backends(attention_backend, kv_cache)
        self.scratch_block = kv_cache.scratch_block
        self.batch_sizes = batch_buckets(max_batch_size)
        granularity = 1
        for g in self.groups:
            granularity = max(granularity, g.block_size)  # block sizes are powers of two: max = lcm
        self.context_lens = context_buckets(max_context_len, granularity, min_context_bucket)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = None
        self.num_runs = 0
        self.capture_s = 0.0  # wall time spent warming up and capturing

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(batch, context) buckets built so far."""
        return sorted(self._buckets)

    def can_run(self, chunks: Sequence[Chunk]) -> bool:
        """One token per chunk, no full-logit request, and a batch and context within the buckets; with state
        layers, no chunk at token 0 (its state is zeroed first, on the host's word)."""
        return (
            0 < len(chunks) <= self.batch_sizes[-1]
            and all(c.num_tokens == 1 and not c.return_logits for c in chunks)
            and max(c.start for c in chunks) < self.context_lens[-1]
            and (self.state_pool is None or all(c.start > 0 for c in chunks))
        )

    def run(self, chunks: Sequence[Chunk], device_tokens: DeviceTokens | None = None) -> torch.Tensor:
        """Logits [len(chunks), vocab] (fp32) of each chunk's token.

        ``device_tokens``: the input tokens of some rows are still on the device (sampled by the
        step before, whose results the host has not seen); they are copied in on the device.
        A view of the graph's static output: valid until the next ``run``.
        """
        context_lens = [c.start + 1 for c in chunks]
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, len(chunks))]
        context = self.context_lens[bisect.bisect_left(self.context_lens, max(context_lens))]
        bucket = self._buckets.get((batch, context)) or self._build(batch, context)
        self._fill(bucket, chunks, context_lens)
        if device_tokens is not None:
            device_tokens.copy_into(bucket.input_ids)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.logits = self._forward(bucket)
        self.num_runs += 1
        return bucket.logits[: len(chunks)]

    # ---- static buffers ------------------------------------------------------------------------
    def _build(self, batch: int, context: int) -> _Bucket:
        widths = [context // g.block_size for g in self.groups]
        slots = 1 if self.state_pool is not None else 0
        packed = torch.zeros(batch * (2 + sum(widths) + slots), dtype=torch.int64, device=self.device)
        tables, offset = [], 2 * batch
        for width in widths:
            tables.append(packed[offset: offset + batch * width].view(batch, width))
            offset += batch * width
        bucket = _Bucket(
            batch_size=batch, context_len=context, packed=packed, input_ids=packed[:batch],
            context_lens=packed[batch: 2 * batch], block_tables=tuple(tables),
            state_slots=packed[offset: offset + batch] if slots else None,
            query_start=torch.arange(batch + 1, dtype=torch.int32, device=self.device),
            query_lens=torch.ones(batch, dtype=torch.int32, device=self.device),
        )
        if self.capture:
            self._capture(bucket)
        self._buckets[(batch, context)] = bucket
        return bucket

    def _fill(self, bucket: _Bucket, chunks: Sequence[Chunk], context_lens: list[int]) -> None:
        """Copy the step into the bucket's static input with one host-to-device copy."""
        pad = bucket.batch_size - len(chunks)
        scratch = self.scratch_block
        values = [c.token_ids[0] for c in chunks] + [0] * pad
        values += context_lens + [1] * pad
        for g, table in zip(self.groups, bucket.block_tables, strict=True):
            width = table.shape[1]
            for c in chunks:
                blocks = c.block_ids[g.group_id][:width]
                values += blocks
                values += [scratch] * (width - len(blocks))
            values += [scratch] * (width * pad)
        if self.state_pool is not None:
            values += [c.state_slot for c in chunks] + [self.state_pool.scratch_slot] * pad
        pin = self.device.type == "cuda"
        bucket.packed.copy_(torch.tensor(values, dtype=torch.int64, pin_memory=pin), non_blocking=pin)

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream (lazy inits must not be captured), then capture the forward.

        The buffers hold an all-padding step meanwhile, so warm-up writes only the scratch block.
        """
        start = time.perf_counter()
        self._fill(bucket, (), [])
        bucket.graph, self._pool, bucket.logits = capture_graph(self.device, self._pool, lambda: self._forward(bucket))
        self.capture_s += time.perf_counter() - start

    # ---- the captured forward ------------------------------------------------------------------
    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        """Everything derived from the static inputs happens here, inside the graph.

        A padding row (context 1, position 0, every block the scratch block) writes its K/V into
        the scratch block and attends to its own key 0 only, with either backend.
        """
        positions = bucket.context_lens - 1
        step = AttentionBatch(
            num_reqs=bucket.batch_size, num_tokens=bucket.batch_size, max_query_len=1,
            max_context_len=bucket.context_len, query_start=bucket.query_start, query_lens=bucket.query_lens,
            context_lens=bucket.context_lens,
        )
        groups = []
        for g, tables, backend in zip(self.groups, bucket.block_tables, self.group_backends, strict=True):
            write_blocks = tables.gather(1, (positions // g.block_size)[:, None])[:, 0]
            groups.append(backend.build_metadata(step, tables, write_blocks, positions % g.block_size,
                                                 g.sliding_window))
        batch = step.with_groups(tuple(groups))
        if self.state_pool is None:
            hidden = self.model(bucket.input_ids, positions, batch, self.kv_views, self.layer_groups)
        else:  # padding rows read and write the scratch slot
            hidden = self.model(bucket.input_ids, positions, batch, self.kv_views, self.layer_groups,
                                states=StateBatch.on_device(bucket.state_slots), state_pool=self.state_pool)
        return self.model.compute_logits(hidden)
