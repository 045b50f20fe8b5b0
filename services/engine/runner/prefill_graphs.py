"""CUDA graphs for short prefill steps: one captured forward per (tokens, requests, context) bucket.

An eager 512-token prefill of an 8B model spends longer launching its kernels than the GPU spends
running them (H100: 22.7 ms of CPU for 11.9 ms of GPU). A step whose shape fits a bucket is
padded up to it and replayed from a graph instead, as decode steps are (``cuda_graphs.py``)::

    2 requests: a 300-token chunk after 64 cached tokens, a 50-token prompt (350 tokens)
      -> bucket (384 tokens, 2 requests, context 512): rows 0..2 of the static buffers
    row 0   query 300, context 364      row 1   query 50, context 50
    row 2   the padding row: query 34 (384 - 350), context 34, every block the scratch block,
            so its tokens (token id 0, positions 0..33) write K/V into the scratch block only
            and attend to that block only; its logits are dropped

A bucket of ``n`` requests has ``n + 1`` rows, the last always the padding row (query 0 when the
step fills the bucket exactly); rows between the step's requests and it are empty (query 0, which
the attention kernel skips). The host copies one int64 vector per step (token ids, each row's
query start, query and context length, block tables cut or padded to the context bucket); the
graph derives each token's row, position and write slot and each group's attention metadata from
it (``build_metadata`` runs inside the captured region), and computes logits for each row's last
token only (eager steps, too, compute only the sampled rows' logits).

Which steps fit (``can_run``): at most ``max_requests`` chunks of at most ``max_tokens`` in all, one
of more than one token (decode-only steps are the decode graphs'), no chunk asking for every
position's logits, no chunk as long as a dense-attention threshold (``triton_paged`` sends those
to cuDNN, whose plan is built on the host per shape: not captured), and contexts within the
largest context bucket. Everything else runs eagerly, as does every step
at TP > 1 and of a model that skips KV-shared layers to the tail (``TailBatch`` rows are chosen on
the host): ``prefill_graphs_for`` does not build a runner for those, nor for ``torch_sdpa``
groups, whose gather and mask grow with the padded (requests x tokens x context) shape.

What capture costs: graphs are captured lazily, on a bucket's first use (one warm-up forward and
one captured forward, plus Triton compiles for a new tile shape: tens to hundreds of ms for an 8B
model), at most ``max_graphs`` of them (later new shapes run eagerly). They share one memory pool,
one input vector and one output buffer (rows x vocab fp32), so the pool holds about one
forward's activations at the largest bucket (8B, 1024 tokens: a few hundred MB) and each further
graph costs only its own kernel nodes.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.engine.attention import (
    AttentionBackend,
    AttentionBatch,
    cache_group_backends,
    resolve_backend_name,
    triton_paged,
)
from services.engine.kv_cache.buffers import KVCache
from services.engine.models import DecoderModel
from services.engine.runner.cuda_graphs import (
    MIN_CONTEXT_BUCKET,
    batch_buckets,
    capture_graph,
    capture_mode,
    context_buckets,
)
from services.engine.runner.step import Chunk

if TYPE_CHECKING:
    from services.engine.engine_config import EngineConfig

# Overrides EngineConfig.prefill_graph_tokens when set (0: off), so one benchmark run can A/B it.
PREFILL_GRAPH_TOKENS_ENV = "PDSERVE_PREFILL_GRAPH_TOKENS"
# Smallest token bucket: a shorter step is padded to it (its cost is launches, not FLOPs).
MIN_TOKEN_BUCKET = 64
# Requests per captured step: 1, 2, 4, 8. More (a decode batch beside a chunk) run eagerly.
MAX_REQUESTS = 8
# Graphs captured at most (each on its bucket's first use); a step needing another runs eagerly.
MAX_GRAPHS = 64


def token_buckets(max_tokens: int, min_bucket: int = MIN_TOKEN_BUCKET) -> tuple[int, ...]:
    """``min_bucket``, 1.5x, 2x, 3x, 4x, ... up to ``max_tokens``: a step pads by less than half."""
    return context_buckets(max_tokens, 1, min_bucket)


def dense_query_limit(backends: Sequence[AttentionBackend], device: torch.device) -> int | None:
    """The shortest chunk an eager step would send through ``triton_paged``'s dense kernel, or None."""
    limits = [b.dense_threshold(device) for b in backends if isinstance(b, triton_paged.TritonPagedBackend)]
    return min((limit for limit in limits if limit), default=None)


@dataclass
class _Bucket:
    """Static inputs of one graph: views into the runner's shared int64 input vector."""

    num_tokens: int
    num_rows: int  # requests + 1: the last row takes the padding tokens
    context_len: int
    packed: torch.Tensor  # the prefix of the shared vector this bucket's layout fills
    input_ids: torch.Tensor  # [num_tokens]
    query_start: torch.Tensor  # [num_rows + 1]
    query_lens: torch.Tensor  # [num_rows]
    context_lens: torch.Tensor  # [num_rows]
    block_tables: tuple[torch.Tensor, ...]  # per group [num_rows, context_len // block_size]
    graph: torch.cuda.CUDAGraph | None = field(default=None, repr=False)


class PrefillGraphRunner:
    """Runs steps of a few prefill chunks (decode rows may ride along) through per-bucket graphs.

    ``run`` returns the logits of each chunk's last token. With ``capture=False`` (the default off
    CUDA) the same static-buffer forward runs eagerly, which is how the padding is tested on CPU.
    """

    def __init__(self, model: DecoderModel, kv_cache: KVCache, max_tokens: int, max_context_len: int,
                 *, max_requests: int = MAX_REQUESTS, capture: bool | None = None,
                 min_token_bucket: int = MIN_TOKEN_BUCKET, min_context_bucket: int = MIN_CONTEXT_BUCKET,
                 attention_backend: str = "auto", max_graphs: int = MAX_GRAPHS) -> None:
        if kv_cache.scratch_block is None:
            raise ValueError("prefill graphs need a KV cache with a scratch block for padding tokens")
        if max_tokens < 1 or max_graphs < 1:
            raise ValueError("max_tokens and max_graphs must be >= 1")
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.capture = capture_mode(self.device, capture)
        self.groups = kv_cache.spec.groups
        self.kv_views, self.layer_groups = kv_cache.views_by_layer(model.config.kv_sharing, model.config.num_layers)
        self.group_backends = cache_group_backends(attention_backend, kv_cache)
        self.scratch_block = kv_cache.scratch_block
        self.token_sizes = token_buckets(max_tokens, min_token_bucket)
        self.request_sizes = batch_buckets(max_requests)
        granularity = max(g.block_size for g in self.groups)  # block sizes are powers of two: max = lcm
        # The padding row may hold a whole bucket of tokens: contexts reach the largest token bucket.
        self.context_sizes = context_buckets(max(max_context_len, self.token_sizes[-1]), granularity,
                                             min_context_bucket)
        self.max_graphs = max_graphs
        rows = self.request_sizes[-1] + 1
        self._packed = torch.zeros(self._packed_len(self.token_sizes[-1], rows, self.context_sizes[-1]),
                                   dtype=torch.int64, device=self.device)
        self._logits = torch.zeros(rows, model.config.vocab_size, dtype=torch.float32, device=self.device)
        self._buckets: dict[tuple[int, int, int], _Bucket] = {}
        self._pool = None
        self.num_runs = 0
        self.capture_s = 0.0  # wall time spent warming up and capturing

    @property
    def captured(self) -> list[tuple[int, int, int]]:
        """(tokens, requests, context) buckets built so far."""
        return sorted((t, r - 1, c) for t, r, c in self._buckets)

    def can_run(self, chunks: Sequence[Chunk]) -> bool:
        """Whether the step fits a bucket (see the module docstring); cheap, on the host only."""
        if not 0 < len(chunks) <= self.request_sizes[-1] or all(c.num_tokens == 1 for c in chunks):
            return False  # a decode-only step is the decode graphs' (or eager, where they cannot take it)
        dense_limit = dense_query_limit(self.group_backends, self.device)  # read each step: tests and benches set it
        if any(c.return_logits or (dense_limit is not None and c.num_tokens >= dense_limit) for c in chunks):
            return False
        key = self._key(chunks)
        return key is not None and (key in self._buckets or len(self._buckets) < self.max_graphs)

    def run(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Logits [len(chunks), vocab] (fp32) of each chunk's last token, whether it samples or not.

        A view of the runners' shared output: valid until the next ``run``.
        """
        key = self._key(chunks)
        if key is None:
            raise ValueError("the step fits no prefill-graph bucket (check can_run first)")
        bucket = self._buckets.get(key) or self._build(*key)
        self._fill(bucket, chunks)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            self._forward(bucket)
        self.num_runs += 1
        return self._logits[: len(chunks)]

    def _key(self, chunks: Sequence[Chunk]) -> tuple[int, int, int] | None:
        """(tokens, rows, context) of the smallest bucket holding the step, or None."""
        num_tokens = sum(c.num_tokens for c in chunks)
        if num_tokens > self.token_sizes[-1]:
            return None
        tokens = self.token_sizes[bisect.bisect_left(self.token_sizes, num_tokens)]
        requests = self.request_sizes[bisect.bisect_left(self.request_sizes, len(chunks))]
        longest = max(tokens, max(c.start + c.num_tokens for c in chunks))
        if longest > self.context_sizes[-1]:
            return None
        return tokens, requests + 1, self.context_sizes[bisect.bisect_left(self.context_sizes, longest)]

    # ---- static buffers ------------------------------------------------------------------------
    def _packed_len(self, num_tokens: int, num_rows: int, context_len: int) -> int:
        widths = sum(context_len // g.block_size for g in self.groups)
        return num_tokens + (num_rows + 1) + 2 * num_rows + num_rows * widths

    def _build(self, num_tokens: int, num_rows: int, context_len: int) -> _Bucket:
        packed = self._packed[: self._packed_len(num_tokens, num_rows, context_len)]
        views, offset = [], 0
        for n in (num_tokens, num_rows + 1, num_rows, num_rows):
            views.append(packed[offset: offset + n])
            offset += n
        tables = []
        for g in self.groups:
            width = context_len // g.block_size
            tables.append(packed[offset: offset + num_rows * width].view(num_rows, width))
            offset += num_rows * width
        bucket = _Bucket(num_tokens, num_rows, context_len, packed, *views, block_tables=tuple(tables))
        if self.capture:
            self._capture(bucket)
        self._buckets[(num_tokens, num_rows, context_len)] = bucket
        return bucket

    def _fill(self, bucket: _Bucket, chunks: Sequence[Chunk]) -> None:
        """Copy the step into the bucket's layout with one host-to-device copy."""
        n, rows, scratch = len(chunks), bucket.num_rows, self.scratch_block
        total = sum(c.num_tokens for c in chunks)
        pad = bucket.num_tokens - total
        empty = rows - 1 - n  # rows between the step's requests and the padding row
        values: list[int] = []
        for c in chunks:
            values += c.token_ids
        values += [0] * pad
        start = 0
        values.append(0)
        for c in chunks:
            start += c.num_tokens
            values.append(start)
        values += [total] * empty + [bucket.num_tokens]
        values += [c.num_tokens for c in chunks] + [0] * empty + [pad]
        values += [c.start + c.num_tokens for c in chunks] + [0] * empty + [pad]
        for g, table in zip(self.groups, bucket.block_tables, strict=True):
            width = table.shape[1]
            for c in chunks:
                blocks = c.block_ids[g.group_id][:width]
                values += blocks
                values += [scratch] * (width - len(blocks))
            values += [scratch] * (width * (empty + 1))
        pin = self.device.type == "cuda"
        bucket.packed.copy_(torch.tensor(values, dtype=torch.int64, pin_memory=pin), non_blocking=pin)

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream (lazy inits must not be captured), then capture the forward.

        The buffers hold an all-padding step meanwhile, so warm-up writes only the scratch block.
        """
        start = time.perf_counter()
        self._fill(bucket, ())
        bucket.graph, self._pool, _ = capture_graph(self.device, self._pool, lambda: self._forward(bucket))
        self.capture_s += time.perf_counter() - start

    # ---- the captured forward ------------------------------------------------------------------
    def _forward(self, bucket: _Bucket) -> None:
        """Everything derived from the static inputs happens here, inside the graph.

        Token t belongs to the row whose query range holds it (``searchsorted`` over the rows'
        ends: empty rows own no token); its position is that row's first position plus its offset.
        """
        tokens = torch.arange(bucket.num_tokens, device=self.device)
        rows = torch.searchsorted(bucket.query_start[1:], tokens, right=True)
        positions = bucket.context_lens[rows] - bucket.query_lens[rows] + tokens - bucket.query_start[rows]
        step = AttentionBatch(
            num_reqs=bucket.num_rows, num_tokens=bucket.num_tokens, max_query_len=bucket.num_tokens,
            max_context_len=bucket.context_len, query_start=bucket.query_start, query_lens=bucket.query_lens,
            context_lens=bucket.context_lens,
        )
        groups = []
        for g, tables, backend in zip(self.groups, bucket.block_tables, self.group_backends, strict=True):
            groups.append(backend.build_metadata(step, tables, tables[rows, positions // g.block_size],
                                                 positions % g.block_size, g.sliding_window))
        hidden = self.model(bucket.input_ids, positions, step.with_groups(tuple(groups)), self.kv_views,
                            self.layer_groups)
        last = bucket.query_start[1:] - 1  # an empty row's points at a neighbour's token: dropped
        self._logits[: bucket.num_rows].copy_(self.model.compute_logits(hidden[last]))


def prefill_graphs_for(config: EngineConfig, model: DecoderModel, kv_cache: KVCache, max_context_len: int
                       ) -> PrefillGraphRunner | None:
    """The engine's prefill graphs, or None where every prefill step runs eagerly: off
    (``prefill_graph_tokens`` 0, ``enforce_eager``), not CUDA, TP > 1, a model that skips to its
    tail, or a KV group whose backend is not ``triton_paged``."""
    env = os.environ.get(PREFILL_GRAPH_TOKENS_ENV)
    max_tokens = min(int(env) if env else config.prefill_graph_tokens, config.max_num_batched_tokens)
    paged = triton_paged.TritonPagedBackend.name
    if (max_tokens < 1 or config.enforce_eager or kv_cache.device.type != "cuda" or config.parallel.tp_size > 1
            or (config.kv_shared_prefill_skip and model.skips_to_tail)
            or resolve_backend_name(config.attention_backend, kv_cache.device) != paged):
        return None
    runner = PrefillGraphRunner(model, kv_cache, max_tokens, max_context_len,
                                max_requests=min(MAX_REQUESTS, config.max_num_seqs),
                                attention_backend=config.attention_backend)
    if any(b.name != paged for b in runner.group_backends):  # a group fell back to torch_sdpa
        return None
    return runner
