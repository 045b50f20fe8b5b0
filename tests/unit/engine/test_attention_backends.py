"""Attention backends: ``triton_paged`` against the ``torch_sdpa`` reference, kernel and engine level.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. The interpreter is
chosen when ``triton.language`` is first imported (``TRITON_INTERPRET``, read at decoration time),
so this module sets the variable before anything imports triton: pytest imports test modules at
collection, before any test runs, and nothing else in the suite imports triton. If triton was
imported earlier without it, ``triton_kernels.kernels`` raises a clear error rather than
misbehaving. With a GPU the same tests run the compiled kernels on CUDA (and bf16 too, which the
interpreter's ``tl.dot`` cannot do).

Kernel cases are mixed batches (decode rows, a prefill chunk after a cached prefix, a fresh
prefill) over real layout views (NHD/HND, per-layer and the strided middle layer of a cross-layer
buffer), GQA ratios 1/2/4/8, block sizes 16 and 64, sliding windows, soft-capping, split-K on and
off. The Triton kernel reads a copy of the cache in which everything it must never read --
block-table padding, blocks wholly outside every row's window, the unwritten slots of each
request's last block -- is NaN, so a stray read shows as NaN in the output.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see the module docstring)
pytest.importorskip("triton")

from services.contract.sampling_params import SamplingParams  # noqa: E402
from services.engine.attention import (  # noqa: E402
    AttentionBatch,
    group_backends,
    resolve_backend_name,
    step_batch,
    triton_paged,
)
from services.engine.attention.torch_sdpa import TorchSDPABackend  # noqa: E402
from services.engine.attention.triton_mla import MLA_MIN_KEYS_PER_SPLIT, MLA_PROGRAMS_PER_SM  # noqa: E402
from services.engine.attention.triton_paged import (  # noqa: E402
    KernelConfig,
    TritonPagedBackend,
    choose_num_splits,
    kernel_config,
)
from services.engine.engine_config import EngineConfig  # noqa: E402
from services.engine.kv_cache.buffers import KVCache  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.engine.runner.cuda_graphs import DecodeGraphRunner  # noqa: E402
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec  # noqa: E402
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.parity import run_to_completion  # noqa: E402
from tests.sm90_compile import compile_script_lines

ROOT = Path(__file__).resolve().parents[3]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CPU = DEVICE.type == "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # max abs error / max abs value
NHD_PER_LAYER = (LayoutKind.PER_LAYER, BlockOrder.NHD)
HND_PER_LAYER = (LayoutKind.PER_LAYER, BlockOrder.HND)
NHD_CROSS = (LayoutKind.CROSS_LAYER, BlockOrder.NHD)
HND_CROSS = (LayoutKind.CROSS_LAYER, BlockOrder.HND)
# (query_len, context_len) per request: decode rows, a chunk after a 30-token prefix, a fresh prefill.
MIXED = ((1, 37), (7, 37), (1, 5), (9, 9), (1, 70))


class Problem:
    """A paged attention problem over a real layout view, with a NaN-poisoned copy for the kernel."""

    def __init__(self, requests, heads: int, kv_heads: int, head_dim: int, block_size: int, layout,
                 dtype: torch.dtype, window: int | None, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        q_lens, ctx_lens = [q for q, _ in requests], [c for _, c in requests]
        blocks_per_req = [-(-c // block_size) for c in ctx_lens]
        num_blocks = sum(blocks_per_req) + 2  # + the NaN block, + one never used
        kind, order = layout
        kind_group = (AttentionKind.FULL, None) if window is None else (AttentionKind.SLIDING_WINDOW, window)
        group = KVCacheGroupSpec(0, kind_group[0], (0, 1, 2), block_size, kind_group[1])
        dtype_name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
        spec = KVLayoutSpec(kind, order, num_blocks, kv_heads, head_dim, dtype_name, (group,))
        self.ref_cache, self.kernel_cache = KVCache(spec, DEVICE), KVCache(spec, DEVICE)
        for ref, poisoned in zip(self.ref_cache.buffers, self.kernel_cache.buffers, strict=True):
            ref.copy_(torch.randn(ref.shape, generator=gen).to(dtype))
            poisoned.copy_(ref)
        self.nan_block = num_blocks - 1
        order_ids = torch.randperm(num_blocks - 2, generator=gen).tolist()  # scattered, not in order
        width = max(blocks_per_req) + 2  # wider than any request needs: padding columns
        ref_tables, kernel_tables = [], []
        k_view, v_view = self.kernel_cache.views[1]  # the middle layer: offset and strided in cross-layer
        for (q_len, ctx), n in zip(requests, blocks_per_req, strict=True):
            table, order_ids = order_ids[:n], order_ids[n:]
            ref_tables.append(table + [0] * (width - n))
            poisoned = table + [self.nan_block] * (width - n)
            if window is not None:  # blocks no row of this request can see (the engine frees them)
                first_visible = max(0, ctx - q_len - window + 1)
                poisoned = [self.nan_block if (i + 1) * block_size <= first_visible else b
                            for i, b in enumerate(poisoned)]
            kernel_tables.append(poisoned)
            if ctx % block_size:  # unwritten slots of the last block
                k_view[table[-1], ctx % block_size:] = float("nan")
                v_view[table[-1], ctx % block_size:] = float("nan")
        k_view[self.nan_block] = float("nan")
        v_view[self.nan_block] = float("nan")
        self.ref_tables = torch.tensor(ref_tables, device=DEVICE)
        self.kernel_tables = torch.tensor(kernel_tables, device=DEVICE)
        self.step = step_batch(q_lens, ctx_lens, DEVICE)
        self.q = torch.randn(self.step.num_tokens, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        self.window = window

    def run(self, backend, tables: torch.Tensor, cache: KVCache, softcap: float | None,
            step: AttentionBatch | None = None, fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
        step = step or self.step
        none = torch.empty(0, dtype=torch.long, device=DEVICE)
        meta = backend.build_metadata(step, tables, none, none, self.window)
        k_cache, v_cache = cache.views[1]
        scale = self.q.shape[-1] ** -0.5
        return backend.forward(self.q, k_cache, v_cache, step.with_groups((meta,)), meta, scale, softcap, fresh,
                               sinks=sinks)

    def with_sinks(self, sinks: torch.Tensor, softcap: float | None) -> torch.Tensor:
        """Attention with a sink logit per head, written out per request and token in float64 from the cache:
        the scores of the visible keys and the head's sink, softmaxed together, the sink's share dropped."""
        k_view, v_view = self.ref_cache.views[1]
        heads, head_dim = self.q.shape[1:]
        group = heads // k_view.shape[2]
        out, row = torch.zeros(self.q.shape, dtype=torch.float64), 0
        for i, (q_len, ctx) in enumerate(zip(*self.step.host_lens, strict=True)):
            positions = torch.arange(ctx, device=DEVICE)
            blocks = self.ref_tables[i][positions // k_view.shape[1]]
            keys = k_view[blocks, positions % k_view.shape[1]].double().repeat_interleave(group, 1).cpu()
            values = v_view[blocks, positions % k_view.shape[1]].double().repeat_interleave(group, 1).cpu()
            for pos in range(ctx - q_len, ctx):
                lo = 0 if self.window is None else max(0, pos - self.window + 1)
                scores = torch.einsum("hd,khd->hk", self.q[row].double().cpu(), keys[lo: pos + 1]) * head_dim**-0.5
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                weights = torch.cat((scores, sinks.double().cpu()[:, None]), 1).softmax(1)[:, :-1]
                out[row] = torch.einsum("hk,khd->hd", weights, values[lo: pos + 1])
                row += 1
        return out.reshape(self.q.shape[0], -1)

    def fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's K/V rows as the layer computed them: each request's last query-length positions."""
        k_view, v_view = self.ref_cache.views[1]
        rows = []
        for i, (q_len, ctx) in enumerate(zip(*self.step.host_lens, strict=True)):
            positions = torch.arange(ctx - q_len, ctx, device=DEVICE)
            blocks = self.ref_tables[i][positions // k_view.shape[1]]
            rows.append((blocks, positions % k_view.shape[1]))
        blocks, slots = torch.cat([b for b, _ in rows]), torch.cat([s for _, s in rows])
        return k_view[blocks, slots], v_view[blocks, slots]

    def reference(self, softcap: float | None) -> torch.Tensor:
        return self.run(TorchSDPABackend(), self.ref_tables, self.ref_cache, softcap)

    def kernel(self, backend: TritonPagedBackend, softcap: float | None, step: AttentionBatch | None = None,
               fresh: tuple[torch.Tensor, torch.Tensor] | None = None, sinks: torch.Tensor | None = None):
        return self.run(backend, self.kernel_tables, self.kernel_cache, softcap, step, fresh, sinks)


def _rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert not got.isnan().any(), "the kernel read something it must not (NaN in the output)"
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


# (requests, heads, kv_heads, head_dim, block_size, layout, window, softcap, splits)
CASES = {
    "gqa1-nhd-b16": (MIXED, 2, 2, 16, 16, NHD_PER_LAYER, None, None, 1),
    "gqa2-hnd-b16-window": (MIXED, 4, 2, 16, 16, HND_PER_LAYER, 12, None, 1),
    "gqa4-cross-nhd-softcap-split3": (MIXED, 8, 2, 32, 16, NHD_CROSS, None, 3.0, 3),
    "gqa4-cross-hnd-b64-window-softcap-split2": (MIXED, 4, 1, 16, 64, HND_CROSS, 20, 2.0, 2),
    "gqa2-b64-split4": (MIXED, 4, 2, 16, 64, NHD_PER_LAYER, None, None, 4),
    "gqa1-cross-hnd-window-split2": (MIXED, 2, 2, 16, 16, HND_CROSS, 8, None, 2),
    "gqa8-prefill-tiles": (((12, 40), (1, 19)), 8, 1, 16, 16, NHD_CROSS, None, None, 1),
    "head-dim-40": (((3, 21), (1, 9)), 4, 2, 40, 16, HND_PER_LAYER, None, 1.5, 2),
    # decode only, many splits: most splits of the short contexts are empty
    "decode-split8": (((1, 1), (1, 3), (1, 40), (1, 17)), 4, 2, 16, 16, NHD_CROSS, 6, None, 8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_sdpa(name: str) -> None:
    requests, heads, kv_heads, head_dim, block_size, layout, window, softcap, splits = CASES[name]
    problem = Problem(requests, heads, kv_heads, head_dim, block_size, layout, torch.float32, window)
    expected = problem.reference(softcap)
    got = problem.kernel(TritonPagedBackend(num_splits=splits), softcap)
    assert got.shape == expected.shape
    assert _rel_error(got, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    ON_CPU, reason="Triton's interpreter cannot tl.dot bfloat16"))])
def test_triton_matches_sdpa_16_bit(dtype: torch.dtype) -> None:
    problem = Problem(MIXED, 4, 2, 16, 16, NHD_CROSS, dtype, window=10)
    expected = problem.reference(softcap=4.0)
    got = problem.kernel(TritonPagedBackend(num_splits=2), softcap=4.0)
    assert got.dtype == dtype
    assert _rel_error(got, expected) < TOLERANCE[dtype]


# (requests, heads, kv_heads, head_dim, dense_min_query): long chunks after a prefix merge the dense
# half with the paged prefix; a fresh one is the dense half alone; short rows stay paged.
DENSE_CASES = {
    "mixed": (MIXED, 4, 2, 16, 5),  # (7, 37): prefix + merge; (9, 9): dense only; decode rows paged
    "one-chunk-after-prefix": (((12, 40),), 8, 2, 32, 8),  # the step is the one request: no copy
    "one-fresh-chunk": (((12, 12),), 4, 1, 16, 8),  # no paged launch at all
    "two-long-chunks": (((10, 26), (1, 3), (11, 11)), 4, 4, 16, 10),
}


@pytest.mark.parametrize("name", list(DENSE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_fresh_tokens_merge_with_the_paged_prefix(name: str, dtype: torch.dtype) -> None:
    """The fresh tokens through ``dense_causal`` (cuDNN on CUDA, torch maths on CPU), the context
    before the chunk through the paged kernel, merged by log-sum-exp: equal to the whole-context
    reference. Without the fresh K/V (a KV-shared layer) or with a softcap, the plan is ignored."""
    requests, heads, kv_heads, head_dim, threshold = DENSE_CASES[name]
    dtype = dtype if dtype != torch.float32 or ON_CPU else torch.bfloat16  # cuDNN: 16-bit only
    problem = Problem(requests, heads, kv_heads, head_dim, 16, NHD_CROSS, dtype, window=None)
    backend = TritonPagedBackend(dense_min_query=threshold, dense_max_prefix_ratio=float("inf"))
    meta = backend.build_metadata(problem.step, problem.kernel_tables, torch.empty(0), torch.empty(0), None)
    assert meta.dense is not None and meta.dense.requests
    expected = problem.reference(None)
    got = problem.kernel(backend, None, fresh=problem.fresh())
    assert got.shape == expected.shape
    assert _rel_error(got, expected) < TOLERANCE[dtype]
    assert _rel_error(problem.kernel(backend, None), expected) < TOLERANCE[dtype]  # no fresh K/V: paged
    capped = problem.kernel(backend, 3.0, fresh=problem.fresh())
    assert _rel_error(capped, problem.reference(3.0)) < TOLERANCE[dtype]


# (requests, heads, kv_heads, layout, window, softcap, splits, dense_min_query)
SINK_CASES = {
    "paged-window": (MIXED, 4, 2, HND_PER_LAYER, 12, None, 1, None),
    "split3-softcap": (MIXED, 8, 2, NHD_CROSS, None, 3.0, 3, None),
    "decode-split8-window": (((1, 1), (1, 3), (1, 40), (1, 17)), 4, 2, NHD_CROSS, 6, None, 8, None),
    "dense-merge-and-dense-only": (MIXED, 4, 2, NHD_CROSS, None, None, 1, 5),
    "one-fresh-dense-chunk": (((12, 12),), 4, 1, NHD_CROSS, None, None, 1, 8),
}


@pytest.mark.parametrize("name", list(SINK_CASES))
def test_attention_sinks_in_every_backend(name: str) -> None:
    """gpt-oss's sinks (a logit per head with a zero value) in ``torch_sdpa`` and in ``triton_paged``'s every
    path -- the unsplit epilogue, the split reduce, the dense half merged with the prefix or alone -- against the
    softmax written out with the sink column; sinks of this size change the output (they are not ignored)."""
    requests, heads, kv_heads, layout, window, softcap, splits, dense = SINK_CASES[name]
    dtype = torch.float32 if dense is None or ON_CPU else torch.float16  # cuDNN's dense half: 16-bit only
    problem = Problem(requests, heads, kv_heads, 16, 16, layout, dtype, window)
    sinks = torch.linspace(-1.0, 2.5, heads, device=DEVICE)
    expected = problem.with_sinks(sinks, softcap)
    assert _rel_error(problem.reference(softcap).cpu().double(), expected) > 0.02  # the sinks matter
    sdpa = problem.run(TorchSDPABackend(), problem.ref_tables, problem.ref_cache, softcap, sinks=sinks)
    assert _rel_error(sdpa.cpu().double(), expected) < TOLERANCE[dtype]
    backend = TritonPagedBackend(num_splits=splits, dense_min_query=dense, dense_max_prefix_ratio=float("inf"))
    fresh = problem.fresh() if dense else None
    got = problem.kernel(backend, softcap, fresh=fresh, sinks=sinks)
    assert _rel_error(got.cpu().double(), expected) < TOLERANCE[dtype]


def test_dense_plan_rules() -> None:
    batch = step_batch([1, 7, 9, 3], [37, 37, 9, 40], DEVICE)
    tables = torch.zeros(4, 3, dtype=torch.long, device=DEVICE)
    plan = TritonPagedBackend(dense_min_query=5, dense_max_prefix_ratio=5).build_metadata(
        batch, tables, tables, tables, None).dense
    assert [(r.index, r.token_start, r.num_tokens, r.prefix_len) for r in plan.requests] == [(1, 1, 7, 30),
                                                                                           (2, 8, 9, 0)]
    assert plan.modes.tolist() == [0, 1, 2, 0] and plan.any_paged
    # a chunk after more cached context than its own length stays paged by default
    plan = TritonPagedBackend(dense_min_query=5).build_metadata(batch, tables, tables, tables, None).dense
    assert [r.index for r in plan.requests] == [2] and plan.modes.tolist() == [0, 0, 2, 0]
    assert TritonPagedBackend(dense_min_query=10).build_metadata(batch, tables, tables, tables, None).dense is None
    assert TritonPagedBackend(dense_min_query=5).build_metadata(batch, tables, tables, tables, 16).dense is None
    assert TritonPagedBackend(dense_min_query=0).build_metadata(batch, tables, tables, tables, None).dense is None
    graph_like = AttentionBatch(4, 20, 9, 40, batch.query_start, batch.query_lens, batch.context_lens)
    assert TritonPagedBackend(dense_min_query=5).build_metadata(graph_like, tables, tables, tables, None).dense is None
    cpu_default = TritonPagedBackend().build_metadata(step_batch([4096], [4096], torch.device("cpu")),
                                                      tables.cpu(), tables.cpu(), tables.cpu(), None)
    assert cpu_default.dense is None  # on CPU only when asked for


def test_upper_bound_context_and_tile_override() -> None:
    """A decode graph passes its context bucket as max_context_len (only an upper bound) and the
    kernel must still read each request's real length; any valid tile shape gives the same result."""
    problem = Problem(((1, 9), (1, 30)), 4, 2, 16, 16, HND_CROSS, torch.float32, window=None)
    expected = problem.reference(None)
    s = problem.step
    padded = AttentionBatch(s.num_reqs, s.num_tokens, s.max_query_len, 64, s.query_start, s.query_lens,
                            s.context_lens.long())
    for backend in (TritonPagedBackend(), TritonPagedBackend(num_splits=4, config=KernelConfig(16, 16))):
        assert _rel_error(problem.kernel(backend, None, padded), expected) < TOLERANCE[torch.float32]


def test_split_and_tile_rules() -> None:
    # Llama-3-8B (8 KV heads) on 132 SMs: ~512 programs, the fastest split count at every batch on an H200
    assert choose_num_splits(8, 2048, 132) == 32
    assert choose_num_splits(8, 512, 132) == 8  # 64 keys per split
    assert choose_num_splits(8 * 8, 8192, 132) == 8
    assert choose_num_splits(16 * 8, 2048, 132) == 4
    assert choose_num_splits(32 * 8, 8192, 132) == 2  # 256 programs leave the 132 SMs half full
    assert choose_num_splits(64 * 8, 8192, 132) == 1  # the unsplit grid fills the GPU
    assert choose_num_splits(8, 100, 132) == 1  # too short to split
    assert choose_num_splits(1, 1 << 20, 132) == 64  # capped
    # the latent kernel's own rule (two programs per SM, 128 keys per split)
    assert choose_num_splits(32, 8192, 132, MLA_PROGRAMS_PER_SM, MLA_MIN_KEYS_PER_SPLIT) == 8
    assert choose_num_splits(132, 8192, 132, MLA_PROGRAMS_PER_SM, MLA_MIN_KEYS_PER_SPLIT) == 2
    assert choose_num_splits(1, 2048, 132, MLA_PROGRAMS_PER_SM, MLA_MIN_KEYS_PER_SPLIT) == 16
    assert kernel_config(128, 4, 1, torch.bfloat16).block_m == 16  # decode: one token's 4 heads in 16 rows
    assert kernel_config(128, 4, 512, torch.bfloat16) == KernelConfig(128, 64, 8, 2)
    assert kernel_config(512, 8, 512, torch.bfloat16).block_n == 16
    assert kernel_config(64, 32, 1, torch.bfloat16).block_m == 32  # a group wider than 16 rows
    batch = step_batch([1, 40], [50, 90], DEVICE)
    _, q_tiles, splits = TritonPagedBackend().plan(batch, 8, 2, 128, torch.bfloat16, DEVICE)
    assert q_tiles > 1 and splits == 1  # prefill tiles are never split


# Compiles the kernels for sm_90 with the ptxas Triton ships (no GPU needed): the interpreter runs
# any Python, so only this catches what the compiler rejects. Run in a subprocess without
# TRITON_INTERPRET; prints one line per case with the registers and spilled bytes cuobjdump reports.
_COMPILE_FOR_SM90 = r"""
import torch, triton
from services.engine.attention import triton_kernels as tk
from services.engine.attention.triton_paged import _next_pow2, kernel_config
from tests.sm90_compile import compile_for_sm90 as compile_

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
attention, reduce = triton.jit(tk._attention_kernel), triton.jit(tk._reduce_kernel)

for dtype, head_dim, group, max_q, modes in ((torch.bfloat16, 128, 4, 1, False), (torch.bfloat16, 128, 4, 512, False),
                                             (torch.bfloat16, 128, 4, 2048, True), (torch.float16, 256, 2, 1, False),
                                             (torch.bfloat16, 512, 8, 64, False), (torch.float32, 64, 1, 512, False)):
    c = kernel_config(head_dim, group, max_q, dtype)
    t = TYPES[dtype]
    pointers = dict(Q=t, K=t, V=t, Out=t, PartAcc="*fp32", PartMax="*fp32", PartSum="*fp32", BlockTables="*i64",
                    QueryStart="*i32", ContextLens="*i32", Modes="*i32", Lse="*fp32", Sinks="*fp32",
                    qk_scale="fp32", softcap="fp32")
    constexprs = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, BLOCK_SIZE=16, GROUP=group,
                      TOKENS_PER_TILE=c.block_m // group, HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)),
                      BLOCK_M=c.block_m, BLOCK_N=c.block_n, SOFTCAP=not modes, WINDOW=not modes,
                      SPLIT=max_q == 1, MODES=modes, SINKS=modes,
                      DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", PDL=max_q == 1)
    aligned = [n for n in pointers if n.isupper() or n[0].isupper()] + ["stride_kb", "stride_ks", "stride_kh"]
    print("attention", dtype, head_dim, group, max_q, modes, c, compile_(attention, pointers, constexprs, aligned,
                                                                  c.num_warps, c.num_stages))
print("reduce", compile_(reduce, dict(Out="*bf16", PartAcc="*fp32", PartMax="*fp32", PartSum="*fp32", Sinks="*fp32"),
                         dict(stride_od=1, HEAD_DIM=128, BLOCK_D=128, SPLITS=16, SINKS=True, PDL=True), [], 4, 2))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills() -> None:
    lines = compile_script_lines(_COMPILE_FOR_SM90)
    assert len(lines) == 7 and lines[-1].startswith("reduce"), lines


# ---- choosing backends -----------------------------------------------------------------------------


def test_auto_and_unknown_names() -> None:
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch_sdpa"
    assert resolve_backend_name("triton_paged", torch.device("cpu")) == "triton_paged"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_unsupported_group_falls_back_to_sdpa(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        chosen = group_backends("triton_paged", [(128, torch.float32), (1024, torch.float32)], DEVICE)
    assert [b.name for b in chosen] == ["triton_paged", "torch_sdpa"]
    assert "does not support KV group 1: head dim 1024" in caplog.text


def test_cpu_tensors_without_the_interpreter_are_a_clear_error() -> None:
    code = ("import torch\nfrom services.engine.attention.triton_kernels import kernels\n"
            "try:\n    kernels('cpu')\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert "ERR triton_paged on CPU tensors needs Triton's interpreter" in out.stdout


# ---- the whole engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "gemma2"])  # gemma2: soft-capping, sliding + full groups
def checkpoint(request, tmp_path_factory) -> str:
    directory, _ = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return str(directory)


def _engine(checkpoint: str, backend: str, **kwargs) -> LLMEngine:
    config = dict(model=checkpoint, device=DEVICE.type, dtype="float32", block_size=4, num_kv_blocks=96,
                  max_num_batched_tokens=16, kv_layout=LayoutKind.CROSS_LAYER, kv_block_order=BlockOrder.HND,
                  attention_backend=backend)
    return LLMEngine(EngineConfig(**{**config, **kwargs}))


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, vocab, (12,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 21)] + [shared + [7, 8, 9]]


def test_engine_greedy_parity(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same greedy tokens and logits with triton_paged as with torch_sdpa: chunked prefill (16-token
    budget), a prefix-cache hit on the second pass, decode steps split over the keys."""
    monkeypatch.setattr(triton_paged, "MIN_KEYS_PER_SPLIT", 8)  # split decode rows' short contexts
    if ON_CPU:
        monkeypatch.setattr(triton_paged, "_num_sms", lambda device: 64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_logits=True)
    runs = {}
    for backend in ("torch_sdpa", "triton_paged"):
        engine = _engine(checkpoint, backend)
        assert {b.name for b in engine.runner.group_backends} == {backend}
        prompts = _prompts(engine.model_config.vocab_size)
        _, first = run_to_completion(engine, prompts, params)
        _, second = run_to_completion(engine, prompts, params)  # prefix-cache hits
        assert all(o.num_cached_tokens > 0 for o in second)
        runs[backend] = first + second
    for ref, got in zip(runs["torch_sdpa"], runs["triton_paged"], strict=True):
        assert got.token_ids == ref.token_ids
        for (start, expected), (got_start, chunk) in zip(ref.logits, got.logits, strict=True):
            assert start == got_start
            assert _rel_error(chunk, expected) < TOLERANCE[torch.float32]


def test_engine_dense_prefill_matches_paged(checkpoint: str) -> None:
    """Prefill chunks through the dense path (fresh tokens dense, earlier chunks and prefix-cache hits
    paged, merged) give the paged kernel's greedy tokens and logits: float32 through the CPU maths,
    float16 through cuDNN on CUDA. Gemma-2's soft-capped layers keep the paged kernel throughout."""
    dtype = "float32" if ON_CPU else "float16"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_logits=True)
    runs = {}
    for threshold in (0, 4):
        engine = _engine(checkpoint, "triton_paged", dtype=dtype)
        for backend in engine.runner.group_backends:
            backend.dense_min_query, backend.dense_max_prefix_ratio = threshold, float("inf")
        prompts = _prompts(engine.model_config.vocab_size)
        _, first = run_to_completion(engine, prompts, params)
        _, second = run_to_completion(engine, prompts, params)  # prefix-cache hits
        runs[threshold] = first + second
    for ref, got in zip(runs[0], runs[4], strict=True):
        assert got.token_ids == ref.token_ids
        for (_, expected), (_, chunk) in zip(ref.logits, got.logits, strict=True):
            # Two fp16 kernels (cuDNN's and the paged one) through every layer: 3.1e-3 measured on an H100
            # with RoPE fused into the K/V write, over the single-kernel tolerance of 3e-3.
            assert _rel_error(chunk, expected) < 2 * TOLERANCE[getattr(torch, dtype)]


def test_engine_decode_graph_path(checkpoint: str) -> None:
    """The decode-graph forward (static buffers, padded batch and context bucket; run without
    capture on CPU) with triton_paged gives torch_sdpa's greedy tokens."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch_sdpa", "triton_paged"):
        engine = _engine(checkpoint, backend, enable_prefix_caching=False)
        graphs = DecodeGraphRunner(engine.model, engine.kv_cache, 4, engine.max_model_len,
                                   capture=DEVICE.type == "cuda", min_context_bucket=8, attention_backend=backend)
        engine.runner.decode_graphs = graphs
        _, outs = run_to_completion(engine, _prompts(engine.model_config.vocab_size), params)
        assert graphs.num_runs > 5 and {b.name for b in graphs.group_backends} == {backend}
        tokens[backend] = [o.token_ids for o in outs]
    assert tokens["triton_paged"] == tokens["torch_sdpa"]


def test_engine_mixed_backends_when_a_group_is_unsupported(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    """Gemma-4 (sliding layers of head dim 16, full layers of 32, KV-shared layers) with the
    kernel's limit lowered to 16: the full group runs on torch_sdpa, the sliding group on
    triton_paged, and the tokens match an all-sdpa engine."""
    directory, _ = make_checkpoint("gemma4", tmp_path)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ref = _engine(str(directory), "torch_sdpa")
    prompts = _prompts(ref.model_config.vocab_size)[:2]
    _, expected = run_to_completion(ref, prompts, params)
    monkeypatch.setattr(triton_paged, "MAX_HEAD_DIM", 16)
    engine = _engine(str(directory), "triton_paged")
    assert sorted(b.name for b in engine.runner.group_backends) == ["torch_sdpa", "triton_paged"]
    _, got = run_to_completion(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


# ---- the benchmark script ----------------------------------------------------------------------------


def test_attention_benchmark_quick() -> None:
    """The benchmark's smoke run on this test's device (Triton interpreted on CPU, compiled on CUDA)."""
    started = time.monotonic()
    env = {**os.environ, "TRITON_INTERPRET": "1"} if DEVICE.type == "cpu" else dict(os.environ)
    out = subprocess.run([sys.executable, "bench/attention.py", "--device", DEVICE.type, "--quick", "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["backend"] for r in rows} == {"torch_sdpa", "triton_paged"}
    assert {r["kind"] for r in rows} == {"decode", "prefill"}
    for r in rows:
        assert r["us"] > 0
        if r["backend"] == "triton_paged":
            assert r["rel_diff"] < 1e-4
    assert time.monotonic() - started < 300
