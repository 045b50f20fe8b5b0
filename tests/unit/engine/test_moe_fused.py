"""The fused MoE layer (``ops.moe_fused``): its routing, sort and grouped GEMM kernels against the torch routers and
the expert loop (``RoutedExperts(path="loop")``, the CPU reference).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET`` set before triton is
imported), in float32 and bfloat16 (the interpreter dots bf16 tiles in fp32; the loads, stores and roundings are
bf16's); with one (``PDSERVE_TEST_DEVICE=cuda``) compiled, against the torch paths on the same device. Cases: several
expert and token counts (one token, experts with none, more rows than a tile, sorts of one chunk and of several),
K split, a gate/up width off the tile, biases and another activation (gpt-oss's), output buffers poisoned with NaN
(``torch.empty`` under deterministic mode) and a NaN token whose outputs must stay its own; DeepSeek's grouped
sigmoid routing, Granite's, Qwen3-MoE's and gpt-oss's on inputs without ties; the blocks end to end under the
``triton`` backend, and ``PDSERVE_FUSED_OPS=torch`` keeping the old paths. CUDA only: a CUDA-graph replay and the
DeepSeek-V2-Lite shapes against ``torch._grouped_mm``; the sm_90 compile runs anywhere.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

DEVICE = torch.device(os.environ.get("PDSERVE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
ON_CPU = DEVICE.type == "cpu"
if ON_CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from services.engine import ops  # noqa: E402
from services.engine.model_config.deepseek import MoESpec  # noqa: E402
from services.engine.models.moe import ExpertRouter, RoutedExperts, SoftmaxTopKRouter  # noqa: E402
from services.engine.ops import moe_fused  # noqa: E402
from services.engine.ops.moe_gemm_triton import MoeTile, moe_gemm  # noqa: E402
from tests.sm90_compile import compile_script_lines  # noqa: E402

cuda_only = pytest.mark.skipif(ON_CPU, reason="needs PDSERVE_TEST_DEVICE=cuda")
TOL = {torch.float32: 1e-5 if ON_CPU else 2e-3, torch.bfloat16: 3e-2}


@contextlib.contextmanager
def _poisoned() -> Iterator[None]:
    """``torch.empty`` returns NaN-filled memory inside: a row or partial a kernel leaves unwritten shows as NaN."""
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _choices(tokens: int, k: int, experts: int, seed: int, skip: tuple[int, ...] = ()) -> torch.Tensor:
    """Distinct experts per token, never one of ``skip`` (experts left with no token)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(experts) if e not in skip])
    return torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(tokens)])


def _experts(num: int, hidden: int, inter: int, dtype: torch.dtype, seed: int, bias: bool = False,
             path: str = "loop", cls: type = RoutedExperts) -> RoutedExperts:
    gen = torch.Generator().manual_seed(seed)
    m = cls(num, hidden, inter, dtype, DEVICE, path=path, bias=bias)
    for p in m.parameters():
        p.data.copy_((torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5).to(dtype))
    return m


def _fused_copy(loop: RoutedExperts) -> RoutedExperts:
    fused = type(loop)(loop.num_experts, loop.gate_up.shape[2], loop.intermediate, loop.gate_up.dtype, DEVICE,
                       path="fused", bias=loop.gate_up_bias is not None)
    fused.load_state_dict(loop.state_dict())
    return fused


# ---- the sort by expert ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,k,experts", [(1, 2, 8), (9, 3, 16), (70, 4, 8), (40, 6, 64)])
def test_align_sorts_pairs_as_a_stable_argsort(tokens: int, k: int, experts: int) -> None:
    """One chunk (<= 128 pairs) and several (280, 240): the sorted pairs, their inverse and the ends are those of
    ``argsort(stable=True)`` and ``bincount``; expert 1 gets no token."""
    ids = _choices(tokens, k, experts, seed=tokens, skip=(1,))
    with _poisoned():
        order = moe_fused.align(ids.to(DEVICE), experts)
    flat = ids.flatten()
    want = flat.argsort(stable=True)
    assert torch.equal(order.sorted_pairs.cpu().long(), want)
    assert torch.equal(order.pos_of_pair.cpu().long()[want], torch.arange(flat.numel()))
    assert torch.equal(order.ends.cpu(), torch.bincount(flat, minlength=experts).cumsum(0).int())


def test_align_keeps_a_repeated_expert_in_pair_order() -> None:
    ids = torch.tensor([[2, 2], [0, 2], [2, 0]])
    order = moe_fused.align(ids.to(DEVICE), 4)
    assert order.sorted_pairs.cpu().tolist() == [2, 5, 0, 1, 3, 4]
    assert order.ends.cpu().tolist() == [2, 2, 6, 6]


# ---- the grouped GEMMs ----------------------------------------------------------------------------------------------
def _gemm_problem(counts: list[int], n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    tokens = max(rows // 2, 1)
    a = torch.randn(tokens, k, generator=gen).to(dtype)
    pairs = torch.randint(0, tokens * 2, (rows,), generator=gen).to(torch.int32)  # top_k 2: token = pair // 2
    w = (torch.randn(len(counts), n, k, generator=gen) / k ** 0.5).to(dtype)
    bias = torch.randn(len(counts), n, generator=gen).to(dtype)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    want = torch.empty(rows, n)
    start = 0
    for e, end in enumerate(ends.tolist()):
        want[start:end] = a[pairs[start:end].long() // 2].float() @ w[e].float().T + bias[e].float()
        start = end
    return [t.to(DEVICE) for t in (a, pairs, w, bias, ends)], want


@pytest.mark.parametrize("tile", [None, MoeTile(16, 32, 32, 4, 2, splits=3), MoeTile(32, 64, 64, 4, 3),
                                  MoeTile(16, 64, 128, 4, 2, splits=8)])
@pytest.mark.parametrize("act", [False, True])
def test_gemm_matches_the_reference(tile: MoeTile | None, act: bool) -> None:
    """Rows gathered through the pairs, biases, K 96 (off every K step), 3 splits of 96 in 32s, more splits asked than
    K steps, N off the tile; ``act``: ``silu(gate) * up`` of the [gate; up] outputs, split or fused."""
    (a, pairs, w, bias, ends), want = _gemm_problem([5, 0, 21, 2, 1], 80, 96, torch.float32, seed=3)
    if act:
        gate, up = want.chunk(2, dim=1)
        want = torch.nn.functional.silu(gate) * up
    with _poisoned():
        got = moe_gemm(a, pairs, 2, w, bias, ends, act=act, config=tile).cpu()
    assert got.shape == want.shape and not got.isnan().any()
    assert _rel(got, want) < TOL[torch.float32]


def test_gemm_keeps_split_partials_and_an_empty_step() -> None:
    (a, pairs, w, bias, ends), want = _gemm_problem([3, 4], 64, 256, torch.float32, seed=4)
    got = moe_gemm(a, pairs, 2, w, bias, ends, keep_splits=True, config=MoeTile(16, 64, 64, 4, 2, splits=2))
    assert got.shape == (2, 7, 64) and _rel(got.sum(0).cpu(), want) < TOL[torch.float32]
    empty = moe_gemm(a, pairs[:0], 2, w, None, torch.zeros(2, dtype=torch.int32, device=DEVICE))
    assert empty.shape == (0, 64)


def test_a_nan_token_stays_in_its_own_rows() -> None:
    """A token of NaN (a CUDA graph's padding row holds whatever was there) poisons only its own outputs."""
    loop = _experts(8, 64, 32, torch.float32, seed=5)
    x = torch.randn(6, 64, device=DEVICE)
    x[2] = float("nan")
    ids, weights = _choices(6, 2, 8, seed=6).to(DEVICE), torch.rand(6, 2, device=DEVICE)
    got = _fused_copy(loop)(x, weights, ids).cpu()
    assert got[2].isnan().all() and not got[[0, 1, 3, 4, 5]].isnan().any()
    x[2] = 0.0
    want = loop(x, weights, ids).cpu()
    assert _rel(got[[0, 1, 3, 4, 5]], want[[0, 1, 3, 4, 5]]) < TOL[torch.float32]


# ---- the experts against the loop -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k,experts", [(1, 2, 8), (7, 2, 8), (40, 4, 16)])
def test_fused_experts_match_the_loop(dtype: torch.dtype, tokens: int, k: int, experts: int) -> None:
    """One token (two experts of eight), a few with experts left empty, and 160 pairs (a sort of two chunks, 10
    rows an expert: more than one tile)."""
    loop = _experts(experts, 64, 48, dtype, seed=tokens)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    ids = _choices(tokens, k, experts, seed=2, skip=(3,)).to(DEVICE)
    weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with _poisoned():
        got = _fused_copy(loop)(x, weights, ids)
    want = loop(x, weights, ids)
    assert got.dtype == dtype and not got.isnan().any()
    assert _rel(got, want) < TOL[dtype]


def test_biases_and_another_activation() -> None:
    """gpt-oss's experts (biases, the clamped SwiGLU between the GEMMs instead of the fused silu-gating)."""
    from services.engine.model_config.gpt_oss import GptOssSpec
    from services.engine.models.gpt_oss import GptOssExperts

    spec = GptOssSpec(num_experts=8, num_experts_per_tok=2, swiglu_alpha=1.702, swiglu_limit=7.0)
    gen = torch.Generator().manual_seed(7)
    loop = GptOssExperts(spec, 64, 32, torch.float32, DEVICE)
    loop.path = "loop"
    fused = GptOssExperts(spec, 64, 32, torch.float32, DEVICE)
    fused.path = "fused"
    for p, q in zip(loop.parameters(), fused.parameters(), strict=True):
        p.data.copy_(torch.randn(p.shape, generator=gen) / 4)
        q.data.copy_(p.data)
    x, ids = torch.randn(5, 64, device=DEVICE) * 2, _choices(5, 2, 8, seed=8).to(DEVICE)
    weights = torch.rand(5, 2, device=DEVICE)
    assert _rel(fused(x, weights, ids), loop(x, weights, ids)) < TOL[torch.float32]


# ---- the routers ----------------------------------------------------------------------------------------------------
def _untied(router: torch.nn.Module, hidden: int, tokens: int, dtype: torch.dtype, logits_of) -> torch.Tensor:
    """Inputs whose router logits have no two equal in a row (the torch and kernel tie orders may differ)."""
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        router.weight.data.copy_((torch.randn(router.weight.shape, generator=gen) / hidden ** 0.5).to(dtype))
        x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
        logits = logits_of(x).float().cpu()
        if all(row.unique().numel() == row.numel() for row in logits):
            return x
    raise AssertionError("no untied inputs in 50 seeds")


def _check_route(router: torch.nn.Module, x: torch.Tensor, num_experts: int, atol: float) -> None:
    want_w, want_ids = router(x)
    with _poisoned():
        w, ids, order = router.route(x, fused=True)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    assert w.dtype == want_w.dtype and torch.allclose(w.float().cpu(), want_w.float().cpu(), rtol=atol, atol=atol)
    flat = want_ids.cpu().flatten()
    assert torch.equal(order.sorted_pairs.cpu().long(), flat.argsort(stable=True))
    assert torch.equal(order.ends.cpu(), torch.bincount(flat, minlength=num_experts).cumsum(0).int())


@pytest.mark.parametrize("tokens", [1, 5, 45])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_deepseek_routing(tokens: int, groups: tuple[int, int]) -> None:
    """Sigmoid scores, the correction bias (choice only), 2 of 4 groups (or none), renormalised and scaled; 45
    tokens route in three chunks (16 a program) and place in a second launch."""
    spec = MoESpec(n_routed_experts=32, n_shared_experts=1, moe_intermediate_size=16, num_experts_per_tok=6,
                   n_group=groups[0], topk_group=groups[1], norm_topk_prob=True, routed_scaling_factor=2.5,
                   first_k_dense_replace=0)
    router = ExpertRouter(64, spec, torch.float32, DEVICE)
    router.e_score_correction_bias.data.copy_(torch.randn(32, generator=torch.Generator().manual_seed(9)) * 0.1)
    x = _untied(router, 64, tokens, torch.float32,
                lambda x: torch.nn.functional.linear(x, router.weight).sigmoid() + router.e_score_correction_bias)
    _check_route(router, x, 32, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_granite_routing(dtype: torch.dtype) -> None:
    router = SoftmaxTopKRouter(64, 16, 3, dtype, DEVICE)
    x = _untied(router, 64, 11, dtype, lambda x: torch.nn.functional.linear(x, router.weight))
    _check_route(router, x, 16, 1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_routing(norm: bool) -> None:
    from services.engine.model_config.qwen3_moe import Qwen3MoESpec
    from services.engine.models.qwen3_moe import Qwen3MoeRouter

    spec = Qwen3MoESpec(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, norm_topk_prob=norm,
                        decoder_sparse_step=1, mlp_only_layers=())
    router = Qwen3MoeRouter(64, spec, torch.bfloat16, DEVICE)
    x = _untied(router, 64, 7, torch.bfloat16, lambda x: torch.nn.functional.linear(x, router.weight))
    _check_route(router, x, 16, 1e-2)


def test_a_nan_row_routes_to_valid_experts() -> None:
    router = SoftmaxTopKRouter(64, 16, 3, torch.float32, DEVICE)
    x = torch.randn(4, 64, device=DEVICE)
    x[1] = float("nan")
    _, ids, order = router.route(x, fused=True)
    assert ids.min() >= 0 and ids.max() < 16 and order.ends[-1].item() == 12


# ---- the blocks and the dispatch ------------------------------------------------------------------------------------
def _block(preset_name: str, seed: int):
    from services.engine.model_config.hf import preset
    from services.engine.models import build_model
    from services.engine.parallel import ParallelConfig

    model = build_model(preset(preset_name), ParallelConfig(1, 0), torch.float32, DEVICE)
    block = next(m for m in model.modules() if type(m).__name__ in ("DeepseekMoE", "GraniteMoE", "Qwen3MoeBlock"))
    gen = torch.Generator().manual_seed(seed)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return block


@pytest.mark.parametrize("preset_name", ["deepseek-v3-tiny", "granite-4.0-h-moe-tiny", "qwen3-moe-tiny"])
def test_blocks_take_the_fused_path_under_the_triton_backend(preset_name: str) -> None:
    """Built under ``--fused-ops triton`` a block routes and runs its experts fused; under ``torch`` the old paths
    (``PDSERVE_FUSED_OPS=torch``), whose output it matches."""
    with ops.use_backend("torch"):
        reference = _block(preset_name, seed=11)
    with ops.use_backend("triton"):
        fused = _block(preset_name, seed=11)
    assert fused.experts.path == "fused" and fused.experts.graph_safe
    assert reference.experts.path == ("loop" if ON_CPU else "grouped" if reference.experts.graph_safe else "loop")
    x = torch.randn(9, fused.experts.gate_up.shape[2], device=DEVICE)
    with torch.no_grad():
        assert _rel(fused(x), reference(x)) < 1e-4


def test_cpu_default_stays_the_loop() -> None:
    experts = RoutedExperts(4, 64, 32, torch.float32, torch.device("cpu"))
    assert experts.path == "loop" and not moe_fused.fused_moe_usable(torch.float32, torch.device("cpu"))
    with ops.use_backend("triton"):
        assert moe_fused.fused_moe_usable(torch.bfloat16, torch.device("cpu"))
        assert not moe_fused.fused_moe_usable(torch.int8, torch.device("cpu"))


# ---- CUDA -----------------------------------------------------------------------------------------------------------
@cuda_only
@pytest.mark.parametrize("tokens", [1, 8, 32, 300])
def test_deepseek_v2_lite_shapes_against_grouped_mm(tokens: int) -> None:
    """DeepSeek-V2-Lite's experts (64 of 2048 x 1408, 6 a token), bf16, the default tiles (split at decode)."""
    loop = _experts(64, 2048, 1408, torch.bfloat16, seed=tokens, path="grouped")
    x = torch.randn(tokens, 2048, device=DEVICE, dtype=torch.bfloat16)
    ids, weights = _choices(tokens, 6, 64, seed=tokens).to(DEVICE), torch.rand(tokens, 6, device=DEVICE)
    assert _rel(_fused_copy(loop)(x, weights, ids), loop(x, weights, ids)) < 2e-2


@cuda_only
def test_fused_block_replays_in_a_cuda_graph() -> None:
    """The block's route and experts ask the host nothing: a captured step replays to eager's output."""
    spec = MoESpec(n_routed_experts=64, n_shared_experts=1, moe_intermediate_size=256, num_experts_per_tok=6,
                   n_group=8, topk_group=3, norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=0)
    from services.engine.models.moe import DeepseekMoE
    from services.engine.parallel import ParallelConfig

    block = DeepseekMoE(512, spec, torch.bfloat16, DEVICE, ParallelConfig(1, 0))
    for p in block.parameters():
        p.data.normal_(0, 0.05)
    assert block.experts.path == "fused"
    for tokens in (1, 32, 100):
        x = torch.randn(tokens, 512, device=DEVICE, dtype=torch.bfloat16)
        with torch.no_grad():
            eager = block(x)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                block(x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = block(x)
        graph.replay()
        assert torch.equal(captured, eager), tokens


_COMPILE_FOR_SM90 = r"""
from services.engine.ops import moe_gemm_triton as g, moe_route_triton as r
from tests.sm90_compile import compile_for_sm90 as compile_

types = dict(A="*bf16", Pairs="*i32", W="*bf16", Bias="*bf16", C="*bf16", Ends="*i32")
aligned = ["A", "Pairs", "W", "C", "Ends", "N", "K", "k_per_split", "stride_am", "stride_we", "stride_wn",
           "stride_cm"]
for rows, n, k, act in ((6, 1408, 2048, True), (6, 2048, 1408, False), (12288, 1408, 2048, True),
                        (12288, 2048, 1408, False)):
    c = g.config_for(rows, 64, n, k, act)
    split = c.splits > 1
    constexprs = dict(GATHER=act, ACT=act and not split, HAS_BIAS=False, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                      BLOCK_K=c.block_k, BLOCK_E=64, EVEN_K=True, UPCAST=False, PRECISION="tf32")
    t = dict(types, C="*fp32") if split else types
    print("moe_gemm", rows, n, compile_(g._moe_gemm_kernel, t, constexprs, aligned, c.warps, c.stages))
rtypes = dict(Logits="*fp32", Bias="*fp32", Weights="*fp32", Ids="*i64", Hist="*i32", Rank="*i32",
              SortedPairs="*i32", PosOfPair="*i32", Ends="*i32", renorm_eps="fp32", scale="fp32")
for block_t, block_e, k, groups, single in ((1, 64, 6, (1, 1), True), (32, 128, 8, (1, 1), True),
                                            (16, 256, 8, (8, 4), False)):
    constexprs = dict(TOP_K=k, SCORE=2, RENORM=True, HAS_BIAS=True, N_GROUP=groups[0], TOPK_GROUP=groups[1],
                      GROUP_SIZE=block_e // groups[0], SINGLE=single, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=8,
                      BLOCK_G=groups[0])
    warps = 8 if block_t * block_e >= 4096 else 4
    print("route", block_t, block_e, compile_(r._route_kernel, rtypes, constexprs, None, warps, 1))
atypes = dict(Ids="*i64", Hist="*i32", Rank="*i32", SortedPairs="*i32", PosOfPair="*i32", Ends="*i32")
for single in (True, False):
    print("align", single, compile_(r._count_kernel, atypes, dict(SINGLE=single, BLOCK_P=128, BLOCK_E=128), None, 8, 1))
print("place", compile_(r._place_kernel, atypes, dict(BLOCK_P=128, BLOCK_E=128, BLOCK_C=64), None, 4, 1))
ctypes = dict(Y="*fp32", PosOfPair="*i32", Weights="*fp32", Out="*bf16")
print("combine", compile_(g._combine_kernel, ctypes, dict(TOP_K=6, SPLITS=2, BLOCK_H=1024), None, 4, 1))
stypes = dict(P="*fp32", Y="*bf16")
print("sum_and_act", compile_(g._sum_and_act_kernel, stypes, dict(SPLITS=4, BLOCK=1024), None, 4, 1))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills() -> None:
    lines = compile_script_lines(_COMPILE_FOR_SM90)
    assert len(lines) == 12, lines
