"""The FP8 block-scaled grouped expert GEMM (``ops.fp8_moe``) and the routed experts kept in FP8.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (``TRITON_INTERPRET`` set before triton is
imported) on activations quantized by the torch reference (the interpreter's e4m3 cast truncates, as
``test_fp8_gemm.py`` says), against the dequantized torch reference. Cases: rows gathered from the tokens or
already sorted, experts with no rows, one row and more rows than a tile, N and K off the 128 blocks (a ragged last
block row and slab), K split; output buffers poisoned with NaN (``torch.empty`` under deterministic mode) and a
NaN token whose rows must stay its own. The loader: ``auto`` on CPU dequantizes the experts; the kept path holds
e4m3 experts and computes what the dequantized ones do but for the activations' e4m3 rounding. With a GPU
(``PDSERVE_TEST_DEVICE=cuda``) the compiled kernel against the reference, and the kernel compiled for sm_90.
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

from services.engine.ops import fp8_format  # noqa: E402
from services.engine.ops.fp8_gemm import quantize_groups  # noqa: E402
from services.engine.ops.fp8_moe import fp8_grouped_mm, fp8_grouped_mm_reference  # noqa: E402
from services.engine.ops.fp8_moe_triton import Fp8MoeConfig  # noqa: E402
from services.engine.ops.fp8_moe_triton import fp8_grouped_mm as triton_grouped_mm  # noqa: E402
from tests.sm90_compile import compile_script_lines  # noqa: E402

cuda_only = pytest.mark.skipif(ON_CPU or torch.cuda.get_device_capability() < fp8_format.MIN_FP8_CAPABILITY,
                               reason="the compiled FP8 kernel needs PDSERVE_TEST_DEVICE=cuda and sm_89+")


def _experts(e: int, n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 experts with non-uniform block scales (a misplaced scale or expert shows)."""
    gen = torch.Generator().manual_seed(seed)
    grid = (e, -(-n // block[0]), -(-k // block[1]))
    scales = torch.rand(grid, generator=gen) * 0.02 + 0.002
    w = torch.randn(e, n, k, generator=gen)
    wq = torch.stack([fp8_format.quantize(w[i], fp8_format.expand_block_scales(scales[i], n, k, block))
                      for i in range(e)])
    return wq, scales


def _routing(counts: list[int], tokens: int, gather: bool, seed: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    row_of = torch.randint(0, tokens, (sum(counts),), generator=gen) if gather else None
    return row_of, torch.tensor(counts).cumsum(0).to(torch.int32)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@contextlib.contextmanager
def _poisoned() -> Iterator[None]:
    """``torch.empty`` returns NaN-filled memory inside (deterministic mode's fill): a row or split partial the
    kernel leaves unwritten shows as NaN."""
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _on(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


# counts per expert, N, K, block, gather
CASES = {
    "gather-uneven-ragged": ([3, 0, 17, 1, 0, 5], 136, 300, (128, 128), True),  # N, K off the blocks, K split
    "sorted-even": ([2, 9, 0, 4], 128, 256, (128, 128), False),
    "one-expert-many-rows": ([40], 96, 160, (32, 32), True),  # blocks narrower than a tile
    "empty": ([0, 0, 0], 64, 128, (128, 128), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_dequantized_reference(name: str) -> None:
    counts, n, k, block, gather = CASES[name]
    wq, ws = _experts(len(counts), n, k, block, seed=1)
    tokens = max(sum(counts) // 2, 1) if gather else sum(counts)
    row_of, ends = _routing(counts, tokens, gather, seed=2)
    xq, xs = quantize_groups(torch.randn(tokens, k, generator=torch.Generator().manual_seed(3)), block[1])
    want = fp8_grouped_mm_reference(xq, xs, row_of, wq, ws, block, ends, torch.float32)
    with _poisoned():
        got = triton_grouped_mm(*_on(xq, xs, row_of, wq, ws), block, ends.to(DEVICE), torch.float32).cpu()
    assert got.shape == (sum(counts), n) and got.dtype == torch.float32
    if sum(counts):
        assert not got.isnan().any()
        assert _rel(got, want) < (1e-5 if ON_CPU else 1e-3)


@pytest.mark.parametrize("config", [Fp8MoeConfig(16, 32, 4, 2, splits=3), Fp8MoeConfig(32, 128, 4, 3),
                                    Fp8MoeConfig(16, 64, 4, 2, splits=8)])
def test_other_tiles_match_the_reference(config: Fp8MoeConfig) -> None:
    """Tiles the sweep runs: 3 splits of 5 slabs (2, 2, 1), a tile wider than N, more splits asked than slabs."""
    counts, n, k, block = [5, 0, 21, 2], 80, 160, (64, 32)
    wq, ws = _experts(len(counts), n, k, block, seed=4)
    row_of, ends = _routing(counts, 11, True, seed=5)
    xq, xs = quantize_groups(torch.randn(11, k, generator=torch.Generator().manual_seed(6)), block[1])
    want = fp8_grouped_mm_reference(xq, xs, row_of, wq, ws, block, ends, torch.float32)
    with _poisoned():
        got = triton_grouped_mm(*_on(xq, xs, row_of, wq, ws), block, ends.to(DEVICE), torch.float32, config).cpu()
    assert _rel(got, want) < (1e-5 if ON_CPU else 1e-3)


def test_a_nan_token_stays_in_its_own_rows() -> None:
    """A token whose activations are NaN (a CUDA graph's padding row holds whatever was there) poisons only the
    rows that read it, not the rows sharing its tiles or the next expert's."""
    counts, n, k, block = [3, 4, 0, 5], 64, 128, (128, 128)
    wq, ws = _experts(len(counts), n, k, block, seed=7)
    row_of, ends = _routing(counts, 6, True, seed=8)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(9))
    x[int(row_of[1])] = float("nan")
    xq, xs = quantize_groups(x, block[1])
    got = triton_grouped_mm(*_on(xq, xs, row_of, wq, ws), block, ends.to(DEVICE), torch.float32).cpu()
    poisoned = row_of == row_of[1]
    assert got[poisoned].isnan().all() and not got[~poisoned].isnan().any()
    x[int(row_of[1])] = 0.0
    xq, xs = quantize_groups(x, block[1])
    want = fp8_grouped_mm_reference(xq, xs, row_of, wq, ws, block, ends, torch.float32)
    assert _rel(got[~poisoned], want[~poisoned]) < (1e-5 if ON_CPU else 1e-3)


def test_shapes_that_do_not_fit_are_refused() -> None:
    wq, ws = _experts(2, 64, 128, (128, 128), seed=0)
    xq, xs = quantize_groups(torch.randn(3, 96), 128)
    with pytest.raises(ValueError, match="do not fit"):
        triton_grouped_mm(*_on(xq, xs, None, wq, ws), (128, 128), torch.tensor([1, 3], dtype=torch.int32),
                          torch.float32)


# ---- the experts kept in FP8 by the loader -------------------------------------------------------------------------
def _scheme(block: tuple[int, int]):
    from services.engine.loading.quant.registry import parse_quantization

    return parse_quantization({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                       "fmt": "e4m3", "weight_block_size": list(block)}})


def _loaded(preset_name: str, block: tuple[int, int], experts: bool | None, tp: tuple[int, int] = (0, 1)):
    """A tiny MoE preset as an FP8 checkpoint of ``block`` blocks, loaded on CPU with the projections kept in FP8
    and the experts kept where ``experts`` says (``keep_fp8_projections``); its experts modules by layer."""
    from services.engine.loading.fp8_model import keep_fp8_projections
    from services.engine.loading.quant.stream import checkpoint_tensors
    from services.engine.loading.weights import dummy_quantized_checkpoint
    from services.engine.model_config.hf import preset
    from services.engine.models import build_model
    from services.engine.parallel import ParallelConfig

    scheme = _scheme(block)
    model = build_model(preset(preset_name), ParallelConfig(tp[1], tp[0]), torch.float32, torch.device("cpu"))
    keep = keep_fp8_projections(model, scheme, experts) if scheme is not None else frozenset()
    with torch.no_grad():
        model.load_weights(checkpoint_tensors(dummy_quantized_checkpoint(model, scheme, seed=3), scheme, keep))
    return {path: model.get_submodule(path) for path, _ in model.fp8_experts()}


def _route(experts, tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = experts.gate_up.shape[2]
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:2] for _ in range(tokens)])
    ids[0] = torch.tensor([0, 1])  # expert 0 always has a token; the rest as they fall (some none)
    return x, torch.rand(tokens, 2, generator=gen), ids


def _e4m3_rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    xq, xs = quantize_groups(x, group)
    return fp8_format.dequantize_blocks(xq, xs, (1, group))


def _expected(plain, x, weights, ids, group: int) -> torch.Tensor:
    """The dequantized experts' output with both projections' inputs rounded through e4m3 per 1 x ``group``."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = (_e4m3_rounded(x[t:t + 1], group) @ plain.gate_up[e].T).chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
            out[t] += weights[t, slot] * (_e4m3_rounded(h, group) @ plain.down[e].T)[0]
    return out


@pytest.mark.parametrize("preset_name", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_kept_experts_hold_e4m3_and_compute_the_dequantized_product(preset_name: str) -> None:
    """Kept (the CUDA choice, forced here on CPU: the torch reference): every MoE layer's experts e4m3 with the
    checkpoint's block grids, computing the dequantized experts' output on e4m3-rounded activations."""
    block = (32, 32)
    kept, plain = _loaded(preset_name, block, True), _loaded(preset_name, block, False)
    assert kept and all(m.gate_up.dtype == m.down.dtype == torch.float8_e4m3fn for m in kept.values())
    assert all(m.gate_up.dtype == torch.float32 and m.fp8_block is None for m in plain.values())
    for path, experts in kept.items():
        dense = plain[path]
        assert experts.fp8_block == block and experts.path == "grouped"
        scales = fp8_format.expand_block_scales  # the dequantized experts are the e4m3 ones times their grids
        for e in (0, experts.num_experts - 1):
            gu = experts.gate_up[e].float() * scales(experts.gate_up_scale[e], *experts.gate_up.shape[1:], block)
            dn = experts.down[e].float() * scales(experts.down_scale[e], *experts.down.shape[1:], block)
            assert torch.equal(gu, dense.gate_up[e]) and torch.equal(dn, dense.down[e])
        x, weights, ids = _route(experts, 5, seed=1)
        got = experts(x, weights, ids)
        assert _rel(got, _expected(dense, x, weights, ids, block[1])) < 1e-5


def test_auto_on_cpu_dequantizes_the_experts() -> None:
    """``experts`` unset on CPU (what ``auto`` and ``fp8`` reach): the experts are dequantized at load."""
    experts = _loaded("qwen3-moe-tiny", (32, 32), None)
    assert all(m.fp8_block is None and m.gate_up.dtype == torch.float32 for m in experts.values())


def test_tensor_parallel_shards_whole_blocks() -> None:
    """TP 2 over 32-wide experts in 16 x 16 blocks: each rank keeps its 16 gate/up rows and down columns with
    their block rows and columns, and the ranks' partial outputs add up to the unsplit experts'. In 32 x 32
    blocks a rank's 16 would cut a block: those experts are dequantized instead (logged)."""
    whole = _loaded("qwen3-moe-tiny", (16, 16), True)
    ranks = [_loaded("qwen3-moe-tiny", (16, 16), True, (r, 2)) for r in range(2)]
    for path, experts in whole.items():
        x, weights, ids = _route(experts, 4, seed=2)
        parts = [rank[path] for rank in ranks]
        assert all(p.gate_up.dtype == torch.float8_e4m3fn and p.intermediate == 16 for p in parts)
        total = sum(p(x, weights, ids) for p in parts)
        assert _rel(total, experts(x, weights, ids)) < 1e-5
    cut = _loaded("qwen3-moe-tiny", (32, 32), True, (0, 2))
    assert all(m.fp8_block is None and m.gate_up.dtype == torch.float32 for m in cut.values())


# ---- CUDA ---------------------------------------------------------------------------------------------------------
@cuda_only
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_cuda_kernel_matches_the_reference_on_deepseek_v2_lite_shapes(tokens: int) -> None:
    """DeepSeek-V2-Lite's gate_up (64 experts, 6 a token, N = 2 x 1408, K = 2048) and down, compiled, the
    activations quantized by the Triton kernel, in bf16, against the torch path on the same device."""
    gen = torch.Generator().manual_seed(tokens)
    chosen = torch.stack([torch.randperm(64, generator=gen)[:6] for _ in range(tokens)]).flatten()
    order = chosen.argsort(stable=True)
    ends = torch.bincount(chosen, minlength=64).cumsum(0).to(torch.int32).to(DEVICE)
    for n, k, gather in ((2816, 2048, True), (2048, 1408, False)):
        wq, ws = _experts(64, n, k, (128, 128), seed=n)
        x = torch.randn(tokens if gather else chosen.numel(), k, generator=gen).to(torch.bfloat16)
        row_of = (order // 6).to(DEVICE) if gather else None
        args = (x.to(DEVICE), row_of, wq.to(DEVICE), ws.to(DEVICE), (128, 128), ends)
        got, want = fp8_grouped_mm(*args, use_triton=True), fp8_grouped_mm(*args, use_triton=False)
        assert got.dtype == torch.bfloat16 and _rel(got, want) < 2e-2, (n, k)


@cuda_only
def test_kept_experts_replay_in_a_cuda_graph() -> None:
    """The kept experts' forward asks the host nothing: captured in a CUDA graph, a replay gives eager's output."""
    from services.engine.models.moe import RoutedExperts

    experts = RoutedExperts(16, 256, 256, torch.bfloat16, DEVICE)
    experts.keep_fp8((128, 128))
    for i in range(16):
        wq, ws = _experts(2, 512, 256, (128, 128), seed=i)
        experts.gate_up.data[i], experts.gate_up_scale.data[i] = wq[0].to(DEVICE), ws[0].to(DEVICE)
        experts.down.data[i], experts.down_scale.data[i] = wq[1, :256].to(DEVICE), ws[1, :2].to(DEVICE)
    assert experts.graph_safe
    x = torch.randn(8, 256, device=DEVICE, dtype=torch.bfloat16)
    weights = torch.rand(8, 2, device=DEVICE)
    ids = torch.randint(0, 16, (8, 2), device=DEVICE)
    eager = experts(x, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = experts(x, weights, ids)
    graph.replay()
    assert torch.equal(captured, eager)


_COMPILE_FOR_SM90 = r"""
from services.engine.ops import fp8_moe_triton as m
from tests.sm90_compile import compile_for_sm90 as compile_

types = dict(A="*fp8e4nv", A_s="*fp32", RowOf="*i64", B="*fp8e4nv", B_s="*fp32", C="*bf16", Ends="*i32")
aligned = [*types, "N", "K", "stride_am", "stride_be", "stride_bn", "stride_cm"]
for rows, experts in ((8, 128), (16384, 128)):  # decode's tile (split: fp32 partials) and prefill's
    c = m.config_for(rows, experts)
    constexprs = dict(GATHER=True, SCALE_N=128, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=128, BLOCK_E=128,
                      EVEN_K=True)
    t = dict(types, C="*fp32") if c.splits > 1 else types
    print("fp8_moe", rows, compile_(m._fp8_grouped_mm_kernel, t, constexprs, aligned, c.warps, c.stages))
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_spills() -> None:
    lines = compile_script_lines(_COMPILE_FOR_SM90)
    assert len(lines) == 2, lines
