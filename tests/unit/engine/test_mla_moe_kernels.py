"""The CUDA paths of DeepSeek and Granite-4.0-H against their torch references: ``triton_mla`` against
``torch_mla`` (both MLA forms), the grouped experts against the expert loop, and on a GPU the engine with them
against transformers, and decode steps captured in CUDA graphs against eager ones.

Without a GPU the MLA kernel runs in Triton's interpreter on CPU tensors (``TRITON_INTERPRET`` is set before
triton is imported, as in ``test_attention_backends.py``) and the grouped experts run ``torch._grouped_mm``'s
CPU loop; with one (``PDSERVE_TEST_DEVICE=cuda`` on the GPU machine) the compiled kernel, cuBLAS-free grouped
GEMMs, bf16, and decode steps captured in CUDA graphs.

Kernel problems are mixed batches (decode rows, a chunk after a cached prefix, a fresh prefill) over real
layout views of an MLA group, with block-table padding, the unwritten slots of each request's last block and a
spare block all NaN in the kernel's copy of the cache: a stray read shows as NaN in the output.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from services.contract.sampling_params import SamplingParams  # noqa: E402
from services.engine.attention import step_batch  # noqa: E402
from services.engine.attention.base import AttentionBatch  # noqa: E402
from services.engine.attention.mla import TorchMLABackend  # noqa: E402
from services.engine.attention.registry import mla_backend  # noqa: E402
from services.engine.attention.triton_mla import TritonMLABackend  # noqa: E402
from services.engine.engine_config import EngineConfig  # noqa: E402
from services.engine.kv_cache.buffers import KVCache  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.engine.models.moe import RoutedExperts, grouped_mm_usable  # noqa: E402
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec  # noqa: E402
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind  # noqa: E402
from tests.parity import assert_matches, reference_of, run_to_completion  # noqa: E402

DEVICE = torch.device(os.environ.get("PDSERVE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
ON_CUDA = DEVICE.type == "cuda"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# (query_len, context_len) per request: decode rows, a chunk after a 30-token prefix, a fresh prefill.
MIXED = ((1, 37), (7, 37), (1, 5), (9, 9), (1, 70))
DECODE = ((1, 1), (1, 40), (1, 17), (1, 70))
NOPE, V_DIM = 16, 24  # the expanded keys' unrotated part and the values, per head


class MLAProblem:
    """Latent rows in a real layout view of one MLA group, queries, and a NaN-poisoned copy for the kernel."""

    def __init__(self, requests, heads: int, latent: int, rope: int, block_size: int, kind: LayoutKind,
                 order: BlockOrder, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        width = latent + rope
        blocks_per_req = [-(-c // block_size) for _, c in requests]
        num_blocks = sum(blocks_per_req) + 2  # + the NaN block, + one never used
        group = KVCacheGroupSpec(0, AttentionKind.MLA, (0, 1, 2), block_size, None, 1, width)
        dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
        spec = KVLayoutSpec(kind, order, num_blocks, 1, width, dtype_name, (group,))
        self.ref_cache, self.kernel_cache = KVCache(spec, DEVICE), KVCache(spec, DEVICE)
        for ref, poisoned in zip(self.ref_cache.buffers, self.kernel_cache.buffers, strict=True):
            ref.copy_(torch.randn(ref.shape, generator=gen).to(dtype))
            poisoned.copy_(ref)
        nan_block = num_blocks - 1
        free = torch.randperm(num_blocks - 2, generator=gen).tolist()  # scattered, not in order
        table_width = max(blocks_per_req) + 2
        (rows,) = self.kernel_cache.views[1]  # the middle layer: offset and strided in cross-layer
        ref_tables, kernel_tables = [], []
        for (_, ctx), n in zip(requests, blocks_per_req, strict=True):
            table, free = free[:n], free[n:]
            ref_tables.append(table + [0] * (table_width - n))
            kernel_tables.append(table + [nan_block] * (table_width - n))
            if ctx % block_size:
                rows[table[-1], ctx % block_size:] = float("nan")
        rows[nan_block] = float("nan")
        self.ref_tables = torch.tensor(ref_tables, device=DEVICE)
        self.kernel_tables = torch.tensor(kernel_tables, device=DEVICE)
        self.step = step_batch([q for q, _ in requests], [c for _, c in requests], DEVICE)
        self.q = torch.randn(self.step.num_tokens, heads, width, generator=gen).to(dtype).to(DEVICE)
        self.latent, self.scale = latent, width ** -0.5
        # expand(): per-head keys [latent @ W_k | rope] and values latent @ W_v, as the model's kv_b_proj does
        self.w_k = (torch.randn(heads, latent, NOPE, generator=gen) / latent ** 0.5).to(dtype).to(DEVICE)
        self.w_v = (torch.randn(heads, latent, V_DIM, generator=gen) / latent ** 0.5).to(dtype).to(DEVICE)

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lat, rope = rows.split([self.latent, rows.shape[-1] - self.latent], dim=-1)
        keys = torch.einsum("...l,hld->...hd", lat, self.w_k)
        rope = rope.unsqueeze(-2).expand(*keys.shape[:-1], rope.shape[-1])
        return torch.cat((keys, rope), dim=-1), torch.einsum("...l,hld->...hd", lat, self.w_v)

    def _meta(self, backend, tables: torch.Tensor, step: AttentionBatch):
        none = torch.empty(0, dtype=torch.long, device=DEVICE)
        return backend.build_metadata(step, tables, none, none, None)

    def absorbed(self, backend, poisoned: bool) -> torch.Tensor:
        tables, cache = (self.kernel_tables, self.kernel_cache) if poisoned else (self.ref_tables, self.ref_cache)
        meta = self._meta(backend, tables, self.step)
        return backend.forward_absorbed(self.q, cache.views[1][0], self.latent, self.step.with_groups((meta,)), meta,
                                        self.scale)

    def expanded(self, backend, poisoned: bool, step: AttentionBatch | None = None) -> torch.Tensor:
        tables, cache = (self.kernel_tables, self.kernel_cache) if poisoned else (self.ref_tables, self.ref_cache)
        step = step or self.step
        meta = self._meta(backend, tables, step)
        q = self.q[..., : NOPE + self.q.shape[-1] - self.latent]  # [nope | rope] per head
        return backend.forward_expanded(q, cache.views[1][0], step.with_groups((meta,)), meta, self.scale,
                                        self.expand)


def _rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert not got.isnan().any(), "the kernel read something it must not (NaN in the output)"
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


# (requests, heads, latent, rope, block size, layout kind, order, splits)
MLA_CASES = {
    "mixed-per-layer-nhd": (MIXED, 4, 32, 8, 16, LayoutKind.PER_LAYER, BlockOrder.NHD, 1),
    "mixed-cross-hnd-split3": (MIXED, 4, 32, 8, 16, LayoutKind.CROSS_LAYER, BlockOrder.HND, 3),
    "mixed-heads-outer-b64": (MIXED, 2, 64, 16, 64, LayoutKind.HEADS_OUTER, BlockOrder.HND, 1),
    "three-heads-latent-48": (MIXED, 3, 48, 16, 16, LayoutKind.CROSS_LAYER, BlockOrder.NHD, 2),
    "decode-split8": (DECODE, 16, 32, 8, 16, LayoutKind.CROSS_LAYER, BlockOrder.NHD, 8),
    "decode-auto-splits": (DECODE, 4, 32, 8, 16, LayoutKind.PER_LAYER, BlockOrder.NHD, None),
}


@pytest.mark.parametrize("name", list(MLA_CASES))
def test_absorbed_kernel_matches_torch_mla(name: str) -> None:
    requests, heads, latent, rope, block_size, kind, order, splits = MLA_CASES[name]
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    problem = MLAProblem(requests, heads, latent, rope, block_size, kind, order, dtype)
    expected = problem.absorbed(TorchMLABackend(), poisoned=False)
    got = problem.absorbed(TritonMLABackend(num_splits=splits), poisoned=True)
    assert got.shape == expected.shape == (problem.step.num_tokens, heads * latent)
    assert _rel_error(got, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("name", ["mixed-per-layer-nhd", "mixed-heads-outer-b64", "decode-split8"])
def test_expanded_form_matches_torch_mla(name: str) -> None:
    """Per-request SDPA under a lower-right causal mask, and without host lengths (a captured step) the padded
    gather: both equal torch_mla's."""
    requests, heads, latent, rope, block_size, kind, order, _ = MLA_CASES[name]
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    problem = MLAProblem(requests, heads, latent, rope, block_size, kind, order, dtype)
    expected = problem.expanded(TorchMLABackend(), poisoned=False)
    for backend in (TritonMLABackend(pad_values=False), TritonMLABackend(pad_values=True)):
        got = problem.expanded(backend, poisoned=True)
        assert got.shape == expected.shape
        assert _rel_error(got, expected) < TOLERANCE[dtype]
    captured = dataclasses.replace(problem.step, host_lens=None)
    no_host = problem.expanded(TritonMLABackend(), poisoned=False, step=captured)
    assert _rel_error(no_host, expected) < TOLERANCE[dtype]


def test_mla_backend_choice() -> None:
    assert isinstance(mla_backend("torch_sdpa", 576, torch.bfloat16, DEVICE), TorchMLABackend)
    assert isinstance(mla_backend("triton_paged", 576, torch.float32, DEVICE), TritonMLABackend)
    # auto: the kernel on CUDA, the torch path on CPU; a row wider than the kernel holds: torch_mla
    auto = mla_backend("auto", 576, torch.bfloat16, DEVICE)
    assert isinstance(auto, TritonMLABackend) == ON_CUDA
    assert isinstance(mla_backend("triton_paged", 1024, torch.float32, DEVICE), TorchMLABackend)


# ---- experts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_experts_match_the_loop(dtype: torch.dtype, tokens: int) -> None:
    """Two grouped GEMMs over every expert at once against one expert at a time (experts with no token
    included: 16 experts, 2 per token)."""
    if ON_CUDA and not grouped_mm_usable(dtype, DEVICE, 64, 32):
        pytest.skip(f"torch._grouped_mm does not run {dtype} on this GPU")
    gen = torch.Generator().manual_seed(tokens)
    experts = RoutedExperts(16, 64, 32, dtype, DEVICE, path="loop")
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(experts.gate_up.shape, generator=gen) / 8)
        experts.down.copy_(torch.randn(experts.down.shape, generator=gen) / 6)
    x = torch.randn(tokens, 64, generator=gen).to(dtype).to(DEVICE)
    chosen = torch.stack([torch.randperm(16, generator=gen)[:2] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, 2, generator=gen).to(DEVICE)
    expected = experts(x, weights, chosen)
    experts.path = "grouped"
    got = experts(x, weights, chosen)
    assert got.dtype == dtype and got.shape == expected.shape
    assert _rel_error(got, expected) < TOLERANCE[dtype]


def test_expert_path_by_device() -> None:
    loop = RoutedExperts(4, 64, 32, torch.float32, torch.device("cpu"))
    assert loop.path == "loop" and not loop.graph_safe
    with pytest.raises(ValueError, match="expert path"):
        RoutedExperts(4, 64, 32, torch.float32, torch.device("cpu"), path="dense")
    if ON_CUDA and grouped_mm_usable(torch.bfloat16, DEVICE, 64, 32):
        assert RoutedExperts(4, 64, 32, torch.bfloat16, DEVICE).graph_safe


@pytest.mark.parametrize("model", ["dummy:deepseek-v3-tiny", "dummy:granite-4.0-h-tiny"])
def test_a_model_is_captured_unless_its_experts_loop(model: str) -> None:
    """``supports_cuda_graphs`` follows every module's ``graph_safe``: on CPU the expert loop keeps an MoE model
    eager; a model without routed experts (Granite's dense form) can be captured."""
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=64))
    moe = [m for m in engine.runtime.model.modules() if isinstance(m, RoutedExperts)]
    assert engine.runtime.model.supports_cuda_graphs == (not moe)
    for experts in moe:
        experts.path = "grouped"
    assert engine.runtime.model.supports_cuda_graphs


# ---- the engine on a GPU ------------------------------------------------------------------------------


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA paths of the engine need PDSERVE_TEST_DEVICE=cuda")
@pytest.mark.parametrize("name", ["q_lora", "no_q_lora"])
def test_engine_on_cuda_matches_hf(name: str, tmp_path) -> None:
    """float32 on the GPU: triton_mla in both forms (auto), the expert loop; logits within 1e-4 of transformers'
    and 32 greedy tokens identical."""
    from tests.unit.engine.test_deepseek_v3 import GREEDY, NUM_TOKENS, PROMPT_LENS, make_deepseek_checkpoint

    directory, hf = make_deepseek_checkpoint(name, tmp_path)
    ref = reference_of(directory, hf, PROMPT_LENS, NUM_TOKENS, seed=7, shared_from=1, shared_len=16)
    engine = LLMEngine(EngineConfig(model=str(directory), device="cuda", dtype="float32", block_size=16,
                                    num_kv_blocks=256, max_num_batched_tokens=24))
    assert isinstance(engine.runtime.runner.group_backends[0], TritonMLABackend)
    _, outputs = run_to_completion(engine, ref.prompts, GREEDY)
    assert_matches(ref.tokens, ref.logits, outputs)


def test_deepseek_decode_graphs_match_eager_steps(tmp_path) -> None:
    """The grouped experts make DeepSeek capturable: every decode step the graphs take (batches growing and
    shrinking over every bucket, padded rows) runs eagerly first over the same KV, and the logits agree
    (``test_cuda_graphs``' comparison). On CUDA: captured, bf16, within the rounding of differently padded
    matmuls and the winner wherever the eager top-2 gap is wide; on CPU the static buffers run as they are,
    fp32, within 1e-5 and with the greedy tokens of a run without them."""
    from tests.unit.engine.test_cuda_graphs import _check_parity
    from tests.unit.engine.test_deepseek_v3 import make_deepseek_checkpoint

    directory, _ = make_deepseek_checkpoint("q_lora", tmp_path)
    if ON_CUDA:
        graphs = _check_parity(str(directory), "cuda", "bfloat16", rel_tol=5e-2, capture=True, min_argmax_checked=20)
        assert graphs.model.supports_cuda_graphs and all(b.graph is not None for b in graphs._buckets.values())
    else:
        _check_parity(str(directory), "cpu", "float32", rel_tol=1e-5, capture=False)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need PDSERVE_TEST_DEVICE=cuda")
def test_granite_bf16_decode_graphs_equal_eager(tmp_path) -> None:
    """Granite-4.0-H (MoE) captured: its state slots in the graphs' static input, padding rows on the scratch
    slot; 16 greedy tokens per prompt equal the same engine's run without graphs. (Running a step twice, as
    the comparison above does, would advance the states twice.)"""
    from tests.unit.engine.test_granite_hybrid import PROMPT_LENS, make_granite_checkpoint

    directory, hf = make_granite_checkpoint("moe", tmp_path)
    ref = reference_of(directory, hf, PROMPT_LENS, 16, seed=7, shared_from=1, shared_len=16)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        engine = LLMEngine(EngineConfig(model=str(directory), device="cuda", dtype="bfloat16", block_size=16,
                                        num_kv_blocks=256, enforce_eager=eager))
        assert engine.runtime.model.supports_cuda_graphs
        assert (engine.runtime.runner.decode_graphs is None) == eager
        _, outputs = run_to_completion(engine, ref.prompts, params)
        tokens[eager] = [list(o.token_ids) for o in outputs]
    assert tokens[False] == tokens[True]
