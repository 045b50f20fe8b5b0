"""Turns a scheduled step into tensors, runs the model, and returns the logits that matter.

The runner never sees the scheduler: it takes the step's chunks (request, start, num_tokens,
samples) and the request's block tables, and knows nothing of queues or preemption.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from services.engine.attention import (
    AttentionBackend,
    AttentionBatch,
    GroupAttentionMetadata,
    KVRounding,
    TailBatch,
    cache_group_backends,
    step_batch,
)
from services.engine.kv_cache.buffers import KVCache
from services.engine.kv_cache.state_pool import StateBatch, StatePool
from services.engine.models import DecoderModel
from services.engine.runner.cuda_graphs import DecodeGraphRunner
from services.engine.runner.prefill_graphs import PrefillGraphRunner
from services.engine.runner.step import Chunk, DeviceTokens, StepLogits


class ModelRunner:
    """Runs a step through ``decode_graphs`` when every chunk is one token (decode), through
    ``prefill_graphs`` when it fits one of their buckets (a few short chunks), else eagerly.

    ``state_pool``: the per-request states of a model with state layers (``kv_cache/state_pool.py``).

    ``attention_backend`` (``EngineConfig.attention_backend``) names the attention backend; each
    KV group gets it, or ``torch_sdpa`` where it cannot serve the group (see ``attention.registry``).
    """

    def __init__(self, model: DecoderModel, kv_cache: KVCache, device: torch.device,
                 decode_graphs: DecodeGraphRunner | None = None, kv_shared_prefill_skip: bool = True,
                 attention_backend: str = "auto", prefill_graphs: PrefillGraphRunner | None = None,
                 state_pool: StatePool | None = None) -> None:
        self.model = model
        # EngineConfig.kv_shared_prefill_skip: pass `tail` to a model that can skip to it.
        self.kv_shared_prefill_skip = kv_shared_prefill_skip
        self.kv_cache = kv_cache
        self.device = device
        self.decode_graphs = decode_graphs
        self.prefill_graphs = prefill_graphs
        spec = kv_cache.spec
        self.groups = spec.groups
        self.kv_views, self.layer_groups = kv_cache.views_by_layer(model.config.kv_sharing, model.config.num_layers,
                                                                   model.config.state_layer_ids)
        # Models with state layers (Mamba2): every eager step passes each chunk's state slot (decode graphs keep
        # theirs in their static input).
        self.state_pool = state_pool
        self.group_backends: list[AttentionBackend] = cache_group_backends(attention_backend, kv_cache)

    def runs_as_graph(self, chunks: Sequence[Chunk]) -> bool:
        """Whether ``execute`` would run these chunks through the decode graphs (the steps the engine
        may pipeline; a prefill-graph step is not one: its tokens come from the host)."""
        return self.decode_graphs is not None and not _rounds_kv(chunks) and self.decode_graphs.can_run(chunks)

    def runs_as_prefill_graph(self, chunks: Sequence[Chunk]) -> bool:
        """Whether ``execute`` would run these chunks through the prefill graphs: a step that is not
        decode-only, fits a bucket, and needs no tail rows (chosen on the host, see ``TailBatch``)."""
        return (self.prefill_graphs is not None and not self.runs_as_graph(chunks)
                and not (self.kv_shared_prefill_skip and self.model.skips_to_tail)
                and not _rounds_kv(chunks) and self.prefill_graphs.can_run(chunks))

    @torch.inference_mode()
    def execute(self, chunks: Sequence[Chunk], device_tokens: DeviceTokens | None = None) -> StepLogits:
        """``device_tokens`` (decode-graph steps only): input tokens still on the device."""
        if not chunks:
            raise ValueError("execute() needs at least one chunk")
        if self.runs_as_graph(chunks):
            return self._execute_graph(chunks, device_tokens)
        if device_tokens is not None:
            raise ValueError("tokens on the device can only feed a decode-graph step")
        if self.runs_as_prefill_graph(chunks):
            return _sampled_rows(chunks, self.prefill_graphs.run(chunks), self.device)
        input_ids, positions, batch = self._prepare(chunks)
        skip = self.kv_shared_prefill_skip and self.model.skips_to_tail
        tail = self._prepare_tail(chunks, positions) if skip else None
        if self.state_pool is None:
            hidden = self.model(input_ids, positions, batch, self.kv_views, self.layer_groups, tail)
        else:
            states = StateBatch.of([c.state_slot for c in chunks], [c.start for c in chunks], self.device)
            hidden = self.model(input_ids, positions, batch, self.kv_views, self.layer_groups, tail,
                                states=states, state_pool=self.state_pool)

        # Where each chunk's output rows sit in `hidden`: every token, or only its tail rows.
        out_lens = [_num_output_rows(c) for c in chunks] if tail is not None else [c.num_tokens for c in chunks]
        ends = torch.tensor([0] + out_lens).cumsum(0).tolist()
        sample_rows = [i for i, c in enumerate(chunks) if c.samples]
        last = torch.tensor([ends[i + 1] - 1 for i in sample_rows], device=self.device, dtype=torch.long)
        sample_logits = self.model.compute_logits(hidden[last]) if sample_rows else hidden.new_empty(0)
        all_logits = {
            i: self.model.compute_logits(hidden[ends[i]: ends[i + 1]])
            for i, c in enumerate(chunks) if c.return_logits
        }
        return StepLogits(sample_rows, sample_logits, all_logits)

    def _prepare_tail(self, chunks: Sequence[Chunk], positions: list[int]) -> TailBatch:
        """The rows past the last KV-writing layer: see ``TailBatch``."""
        rows: list[int] = []
        kept: list[tuple[Chunk, int]] = []
        start = 0
        for c in chunks:
            n = _num_output_rows(c)
            if n:
                rows.extend(range(start + c.num_tokens - n, start + c.num_tokens))
                kept.append((c, n))
            start += c.num_tokens
        dev = self.device
        if not kept:
            return TailBatch(torch.empty(0, dtype=torch.long, device=dev), None)
        q_lens = [n for _, n in kept]
        ctx_lens = [c.start + c.num_tokens for c, _ in kept]
        step = step_batch(q_lens, ctx_lens, dev)
        no_writes = torch.empty(0, dtype=torch.long, device=dev)
        groups = tuple(
            self.group_backends[g.group_id].build_metadata(
                step, self._block_tables(g.group_id, [c for c, _ in kept], step.max_context_len), no_writes,
                no_writes, g.sliding_window)
            for g in self.groups
        )
        return TailBatch(torch.tensor(rows, device=dev), step.with_groups(groups))

    def _execute_graph(self, chunks: Sequence[Chunk], device_tokens: DeviceTokens | None) -> StepLogits:
        return _sampled_rows(chunks, self.decode_graphs.run(chunks, device_tokens), self.device)

    def _prepare(self, chunks: Sequence[Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        ids: list[int] = []
        positions: list[int] = []
        for c in chunks:
            ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + c.num_tokens))
        dev = self.device
        step = step_batch([c.num_tokens for c in chunks], [c.start + c.num_tokens for c in chunks], dev)
        groups = tuple(self._group_metadata(g.group_id, chunks, positions, step) for g in self.groups)
        rounding = KVRounding.of([bool(c.kv_rounding) for c in chunks], [c.num_tokens for c in chunks], dev)
        step = replace(step, groups=groups, kv_rounding=rounding)
        return torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), step

    def _group_metadata(self, group_id: int, chunks: Sequence[Chunk], positions: list[int],
                        step: AttentionBatch) -> GroupAttentionMetadata:
        group = self.groups[group_id]
        bs = group.block_size
        write_blocks: list[int] = []
        for c in chunks:
            table = c.block_ids[group_id]
            write_blocks.extend(table[p // bs] for p in range(c.start, c.start + c.num_tokens))
        dev = self.device
        return self.group_backends[group_id].build_metadata(
            step, self._block_tables(group_id, chunks, step.max_context_len),
            torch.tensor(write_blocks, device=dev), torch.tensor([p % bs for p in positions], device=dev),
            group.sliding_window)

    def _block_tables(self, group_id: int, chunks: Sequence[Chunk], max_context_len: int) -> torch.Tensor:
        """[len(chunks), blocks covering max_context_len]: each chunk's table, cut or padded with block 0."""
        max_blocks = -(-max_context_len // self.groups[group_id].block_size)
        tables = [c.block_ids[group_id] for c in chunks]
        padded = [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in tables]
        return torch.tensor(padded, device=self.device)


def _sampled_rows(chunks: Sequence[Chunk], logits: torch.Tensor, device: torch.device) -> StepLogits:
    """The sampling chunks' rows of a graph's logits (one row per chunk), copied out of its static output."""
    sample_rows = [i for i, c in enumerate(chunks) if c.samples]
    if len(sample_rows) == len(chunks):
        return StepLogits(sample_rows, logits.clone(), {})
    rows = torch.tensor(sample_rows, dtype=torch.long).to(device, non_blocking=True)
    return StepLogits(sample_rows, logits[rows], {})


def _rounds_kv(chunks: Sequence[Chunk]) -> bool:
    """Whether a chunk's K/V are rounded through FP8 (``attention.kv_rounding``): such a step runs eagerly."""
    return any(c.kv_rounding for c in chunks)


def _num_output_rows(chunk: Chunk) -> int:
    """Tokens of a chunk whose hidden state is read: all (logits returned), the last (sampled), or none."""
    if chunk.return_logits:
        return chunk.num_tokens
    return 1 if chunk.samples else 0
