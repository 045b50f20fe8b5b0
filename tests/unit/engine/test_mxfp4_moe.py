"""The MXFP4 grouped expert GEMM (``ops.mxfp4_moe``): its Triton kernel against the torch reference, which
dequantizes each expert with the loader's code (``mxfp4_format``), and the kernel compiled for sm_90.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (``TRITON_INTERPRET`` set before triton is
imported, as in ``test_attention_backends.py``), in float32 and float16 (the interpreter cannot dot bfloat16);
with one, on CUDA in bfloat16 too. Cases: rows gathered from the tokens or already sorted, with and without
biases, experts with no rows, one row, and more rows than a tile; random codes over the whole E8M0 range a real
checkpoint uses, so a nibble, scale or row read wrong changes the output.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from services.engine.ops.mxfp4_moe import mxfp4_grouped_mm, mxfp4_grouped_mm_reference  # noqa: E402
from services.engine.ops.mxfp4_moe_triton import MxConfig  # noqa: E402
from services.engine.ops.mxfp4_moe_triton import mxfp4_grouped_mm as triton_grouped_mm  # noqa: E402
from tests.sm90_compile import compile_script_lines  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([] if DEVICE.type == "cpu" else [torch.bfloat16])


def _problem(counts: list[int], n: int, k: int, dtype: torch.dtype, gather: bool, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    e, rows = len(counts), sum(counts)
    blocks = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 130, (e, n, k // 32), generator=gen, dtype=torch.uint8)  # 2**-7 .. 2**2
    tokens = max(rows // 2, 1) if gather else rows
    a = torch.randn(tokens, k, generator=gen).to(dtype)
    row_of = torch.randint(0, tokens, (rows,), generator=gen) if gather else None
    b = torch.randn(e, n, generator=gen).to(dtype) if bias else None
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    to = (lambda t: None if t is None else t.to(DEVICE))
    return a.to(DEVICE), to(row_of), blocks.to(DEVICE), scales.to(DEVICE), to(b), ends.to(DEVICE)


CASES = {
    "gather-bias-uneven": ([3, 0, 17, 1, 0, 5], 64, 64, True, True),
    "sorted-no-bias": ([2, 9, 0, 4], 48, 96, False, False),  # N off the tile, K in 32-steps (96 = 3 x 32)
    "one-expert-many-rows": ([70], 32, 128, True, False),
    "empty": ([0, 0, 0], 64, 64, True, True),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernel_matches_the_dequantized_reference(name: str, dtype: torch.dtype) -> None:
    counts, n, k, gather, bias = CASES[name]
    a, row_of, blocks, scales, b, ends = _problem(counts, n, k, dtype, gather, bias)
    expected = mxfp4_grouped_mm_reference(a.float(), row_of, blocks, scales, None if b is None else b.float(), ends)
    got = mxfp4_grouped_mm(a, row_of, blocks, scales, b, ends, use_triton=True)
    assert got.shape == (sum(counts), n) and got.dtype == dtype
    if sum(counts):
        error = ((got.float() - expected).abs().max() / expected.abs().max()).item()
        assert error < (1e-5 if dtype == torch.float32 else 2e-2), error


@pytest.mark.parametrize("config", [MxConfig(16, 32, 128, 4, 2), MxConfig(32, 128, 32, 4, 3),
                                    MxConfig(16, 32, 32, 4, 2, splits=2), MxConfig(16, 64, 64, 4, 3, splits=4)])
def test_other_tiles_match_the_reference(config: MxConfig) -> None:
    """The benchmark's sweep runs other tiles: a K step past K (96 by 128, masked), one of a single group and K
    splits (96 in shares of 64 and 32; four asked of 64-wide steps: two shares, the second masked)."""
    a, row_of, blocks, scales, b, ends = _problem([5, 0, 40, 2], 80, 96, torch.float32, True, True, seed=3)
    expected = mxfp4_grouped_mm_reference(a, row_of, blocks, scales, b, ends)
    got = triton_grouped_mm(a, row_of, blocks, scales, b, ends, config)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


@pytest.mark.parametrize("counts", [[0, 0, 21, 0], [3, 0, 17, 1], [16, 16, 0, 33], [1, 1, 1, 1, 1]])
def test_programs_find_their_rows(counts: list[int]) -> None:
    """Each program finds its expert and rows from ``ends``: empty experts, tiles filled exactly, one row each."""
    a, row_of, blocks, scales, b, ends = _problem(counts, 16, 64, torch.float32, True, True, seed=5)
    expected = mxfp4_grouped_mm_reference(a, row_of, blocks, scales, b, ends)
    got = triton_grouped_mm(a, row_of, blocks, scales, b, ends, MxConfig(16, 16, 64, 4, 2))
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


_COMPILE_FOR_SM90 = r"""
from services.engine.ops import mxfp4_moe_triton as m
from tests.sm90_compile import compile_for_sm90 as compile_

types = dict(A="*bf16", RowOf="*i64", Blocks="*u8", Scales="*u8", Bias="*bf16", C="*bf16", Ends="*i32")
for rows in (4, 4096):  # decode's tile and prefill's
    c = m.config_for(rows, 32)
    constexprs = dict(GATHER=True, HAS_BIAS=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                      BLOCK_E=32, EVEN_K=False, DOT_PRECISION="tf32")
    print("mxfp4", rows, compile_(m._mxfp4_grouped_mm_kernel, types, constexprs, None, c.warps, c.stages))
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_spills() -> None:
    lines = compile_script_lines(_COMPILE_FOR_SM90)
    assert len(lines) == 2, lines
