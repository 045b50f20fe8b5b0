"""FP8 projections (``services/engine/ops/fp8_gemm.py`` and its Triton kernels) against the dequantized product.

On CPU the torch reference is checked against plain float32 math, the block-scaled GEMM kernel runs in Triton's
interpreter on reference-quantized inputs (the interpreter's e4m3 cast does not round to nearest, so the
quantization kernel's values are checked on CUDA only), and both kernels are compiled for sm_90 without spills.
With a GPU (``PDSERVE_TEST_DEVICE=cuda`` or one present) every case runs compiled, against the reference.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("PDSERVE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
ON_CPU = DEVICE.type == "cpu"
if ON_CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from services.engine.ops import fp8_format, fp8_gemm  # noqa: E402
from services.engine.ops import fp8_gemm_triton as kernels  # noqa: E402
from tests.sm90_compile import compile_script_lines  # noqa: E402

# (m, n, k, block): N and K multiples of the block and not (DeepSeek-V3's 576-row kv_a projection, scaled down),
# one row and many, blocks narrower than a tile.
SHAPES = [(1, 256, 256, (128, 128)), (7, 72, 300, (128, 128)), (33, 96, 160, (32, 32)), (130, 40, 64, (16, 16)),
          (42, 208, 512, (128, 128)),  # more rows than TRITON_MAX_ROWS: cuBLASLt's block recipe, rows padded to 44
          (40, 200, 384, (128, 128)),  # N off 16s and K off 4 scale blocks, which cuBLASLt refuses: the Triton GEMM
          (5, 96, 256, (32, 64)), (6, 128, 160, (64, 32))]  # blocks taller than wide and wider than tall


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _block_quantized(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight quantized per block with non-uniform scales (so a misplaced scale shows)."""
    grid = (-(-n // block[0]), -(-k // block[1]))
    scales = torch.rand(grid, generator=torch.Generator().manual_seed(seed + 1)) * 0.02 + 0.002
    w = _randn(n, k, seed=seed)
    return fp8_format.quantize(w, fp8_format.expand_block_scales(scales, n, k, block)), scales


def _dequantized_by_loops(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The test's own dequantization: every element times the scale of the block it sits in, by index."""
    out = q.float().clone()
    for i in range(q.shape[0]):
        for j in range(0, q.shape[1], block[1]):
            out[i, j:j + block[1]] *= scales[i // block[0], j // block[1]]
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def test_group_quantization_round_trips_within_e4m3_precision() -> None:
    x = _randn(9, 300, seed=0) * torch.linspace(0.01, 10.0, 300)  # columns of very different magnitudes
    q, scales = fp8_gemm.quantize_groups(x, 128)
    assert q.dtype == fp8_format.FP8_DTYPE and scales.shape == (9, 3)
    back = fp8_format.dequantize_blocks(q, scales, (1, 128))
    assert _rel(back, x) < 0.07  # e4m3 has 3 mantissa bits: <= 1/16 relative per element at the group's max
    # Each group's maximum lands on e4m3's largest value.
    assert torch.allclose(q.float().abs().view(9, -1)[:, :256].view(9, 2, 128).amax(-1),
                          torch.full((9, 2), fp8_format.FP8_MAX))
    assert torch.equal(fp8_gemm.quantize_groups(torch.zeros(2, 16), 8)[0].float(), torch.zeros(2, 16))


@pytest.mark.parametrize("m,n,k,block", SHAPES)
def test_reference_is_the_dequantized_product(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    wq, ws = _block_quantized(n, k, block, seed=m)
    xq, xs = fp8_gemm.quantize_groups(_randn(m, k, seed=2), block[1])
    got = fp8_gemm.block_scaled_mm_reference(xq, xs, wq, ws, block, torch.float32)
    x = _dequantized_by_loops(xq, xs, (1, block[1]))
    assert _rel(got, x @ _dequantized_by_loops(wq, ws, block).T) < 1e-5
    # The scales matter: dropped, or a grid of the wrong shape (transposed, or for swapped block sides), refused.
    assert _rel(fp8_gemm.block_scaled_mm_reference(xq, xs, wq, torch.ones_like(ws), block, torch.float32), got) > 0.1
    if ws.shape[0] != ws.shape[1]:
        with pytest.raises(ValueError, match="block scales of a"):
            fp8_gemm.block_scaled_mm_reference(xq, xs, wq, ws.T.contiguous(), block, torch.float32)


@pytest.mark.parametrize("m,n,k,block", SHAPES)
def test_block_scaled_kernel_matches_the_reference(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    wq, ws = _block_quantized(n, k, block, seed=m)
    bias = _randn(n, seed=5)
    xq, xs = fp8_gemm.quantize_groups(_randn(m, k, seed=3), block[1])
    want = fp8_gemm.block_scaled_mm_reference(xq, xs, wq, ws, block, torch.float32, bias)
    dev = [t.to(DEVICE) for t in (xq, xs, wq, ws, bias)]
    if not kernels.supported_block(block):  # FP8 MMAs take K in steps of 32: block_scaled_linear takes torch
        with pytest.raises(ValueError, match="not a power of two >= 32"):
            kernels.block_scaled_mm(*dev[:4], block, torch.float32, dev[4])
        return
    got = kernels.block_scaled_mm(*dev[:4], block, torch.float32, dev[4])
    # Hopper's FP8 MMAs sum a slab with fewer mantissa bits than fp32 (why the kernel rescales per slab in fp32).
    assert _rel(got.cpu(), want) < (1e-5 if ON_CPU else 1e-3)
    if not ON_CPU:  # bf16 out, and the whole linear (kernel-quantized activation) against the torch path
        got16 = kernels.block_scaled_mm(*dev[:4], block, torch.bfloat16, dev[4])
        assert _rel(got16.cpu(), want) < 1e-2
        x = _randn(m, k, seed=3).to(torch.bfloat16)
        lin = fp8_gemm.block_scaled_linear(x.to(DEVICE), dev[2], dev[3], block, dev[4].to(torch.bfloat16))
        assert _rel(lin.cpu(), fp8_gemm.block_scaled_linear(x, wq, ws, block, bias.to(torch.bfloat16))) < 2e-2


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("m,n", [(3, 40), (16, 200)])
def test_split_k_sums_the_same_product(splits: int, m: int, n: int) -> None:
    """K split over programs (a small decode product): the partial sums and the bias add up to the unsplit result,
    whatever the split count (3 does not divide the 5 slabs; 8 is more than there are, so fewer run), in one sum
    kernel over several of its programs (16 x 200 outputs) and in bf16 too."""
    k, block = 320, (32, 64)
    wq, ws = _block_quantized(n, k, block, seed=9)
    xq, xs = fp8_gemm.quantize_groups(_randn(m, k, seed=10), block[1])
    bias = _randn(n, seed=11)
    want = fp8_gemm.block_scaled_mm_reference(xq, xs, wq, ws, block, torch.float32, bias)
    dev = [t.to(DEVICE) for t in (xq, xs, wq, ws, bias)]
    tile = kernels.Fp8Tile(16, 32, 4, 2, split_k=splits)
    got = kernels.block_scaled_mm(*dev[:4], block, torch.float32, dev[4], tile=tile)
    assert _rel(got.cpu(), want) < (1e-5 if ON_CPU else 1e-3)
    got16 = kernels.block_scaled_mm(*dev[:4], block, torch.bfloat16, dev[4].to(torch.bfloat16), tile=tile)
    assert got16.dtype == torch.bfloat16 and _rel(got16.cpu().float(), want) < 1e-2
    unbiased = kernels.block_scaled_mm(*dev[:4], block, torch.float32, tile=tile)
    assert _rel(unbiased.cpu() + bias, want) < (1e-5 if ON_CPU else 1e-3)
    assert kernels.split_k_for(4, 56, 1, torch.device("cpu")) == 1  # only CUDA decode products split


@pytest.mark.skipif(ON_CPU, reason="the interpreter's e4m3 cast truncates; compiled on CUDA")
@pytest.mark.parametrize("group", [128, 300, 16])
def test_quantization_kernel_matches_the_reference(group: int) -> None:
    x = _randn(17, 300, seed=4).to(torch.bfloat16)
    q, s = kernels.quantize_groups(x.to(DEVICE), group)
    rq, rs = fp8_gemm.quantize_groups(x, group)
    assert torch.allclose(s.cpu(), rs, rtol=1e-6)
    assert (q.cpu().float() != rq.float()).float().mean() < 0.01  # a tie may round either way after x / scale


@pytest.mark.parametrize("scale_shape", ["tensor", "channel"])
def test_row_scaled_linear_is_the_dequantized_product(scale_shape: str) -> None:
    n, k = 64, 128
    w = _randn(n, k, seed=6, scale=0.05)
    ws = w.abs().amax() / 448.0 if scale_shape == "tensor" else w.abs().amax(1, keepdim=True) / 448.0
    wq = (w / ws).to(torch.float8_e4m3fn)
    x = _randn(5, k, seed=7)
    want = fp8_gemm.quantize_rows(x)
    expected = (want[0].float() * want[1]) @ (wq.float() * ws).T
    assert _rel(fp8_gemm.row_scaled_linear(x, wq, ws.reshape(-1)), expected) < 1e-5
    if not ON_CPU:
        xb = x.to(torch.bfloat16).to(DEVICE)
        got = fp8_gemm.row_scaled_linear(xb, wq.to(DEVICE), ws.reshape(-1).to(DEVICE))
        assert _rel(got.cpu(), expected) < 2e-2


def test_an_activation_bound_saturates_the_rows_above_it() -> None:
    """fbgemm's ``activation_scale_ub``: a row whose absolute maximum is past the bound is scaled as if the maximum
    were the bound, so its outlier saturates at it; rows under it are unchanged."""
    n, k, ub = 32, 128, 12.0
    w = _randn(n, k, seed=12, scale=0.05)
    ws = w.abs().amax(1, keepdim=True) / 448.0
    wq = (w / ws).to(torch.float8_e4m3fn)
    x = _randn(3, k, seed=13)
    x[1, 5] = 80.0  # past the bound
    q, s = fp8_gemm.quantize_rows(x, ub)
    assert float(s[1]) == pytest.approx(ub / 448.0) and float(q[1, 5].float() * s[1]) == pytest.approx(ub)
    assert torch.equal(s[[0, 2]], fp8_gemm.quantize_rows(x[[0, 2]])[1])
    expected = (q.float() * s) @ (wq.float() * ws).T
    assert _rel(fp8_gemm.row_scaled_linear(x, wq, ws.reshape(-1), amax_ub=ub), expected) < 1e-5
    assert _rel(fp8_gemm.row_scaled_linear(x, wq, ws.reshape(-1)), expected) > 1e-2  # the bound matters here
    if not ON_CPU:
        xb = x.to(torch.bfloat16).to(DEVICE)
        got = fp8_gemm.row_scaled_linear(xb, wq.to(DEVICE), ws.reshape(-1).to(DEVICE), amax_ub=ub)
        assert _rel(got.cpu(), expected) < 2e-2


_COMPILE_FOR_SM90 = """
from services.engine.ops import split_k_triton as split_k
from services.engine.ops import fp8_gemm_triton as k
from tests.sm90_compile import compile_for_sm90
t = {"A": "*fp8e4nv", "A_s": "*fp32", "B": "*fp8e4nv", "B_s": "*fp32", "C": "*bf16", "Bias": "*bf16"}
# Triton specializes an integer argument divisible by 16 (Llama's K, N and strides are): compiled as launched.
aligned = [*t, "N", "K", "stride_am", "stride_bn", "stride_cm"]
for limit, tile in k.TILES:
    print(tile, compile_for_sm90(k._block_scaled_mm_kernel, t, dict(SCALE_N=128, HAS_BIAS=False, BLOCK_M=tile.block_m,
          BLOCK_N=tile.block_n, BLOCK_K=128, GROUP_M=tile.group_m), aligned, num_warps=tile.num_warps,
          num_stages=tile.num_stages))
print("sum", compile_for_sm90(split_k._sum_splits_kernel, {"P": "*fp32", "Bias": "*bf16", "Y": "*bf16"},
      dict(SPLITS=4, HAS_BIAS=True, BLOCK=split_k.SUM_BLOCK)))
q = {"X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32", "amax_ub": "fp32"}
for group in (128, 4096):
    print(group, compile_for_sm90(k._quantize_groups_kernel, q, dict(GROUP=group, BLOCK=group, FMAX=448.0,
          GROUPS_PER_PROGRAM=max(1, 1024 // group), SMIN=1e-12), num_warps=4 if group <= 1024 else 8))
"""


def test_kernels_compile_for_sm90_without_spills() -> None:
    assert len(compile_script_lines(_COMPILE_FOR_SM90)) == len(kernels.TILES) + 3
