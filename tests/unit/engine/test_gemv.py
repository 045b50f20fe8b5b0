"""The batch-1 GEMV (``services/engine/ops/gemv_triton.py``) against torch, and which projections take it.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (``TRITON_INTERPRET`` is set
before triton is imported, as in ``test_fused_ops.py``), and a compile for sm_90 checks what the
interpreter cannot: that the programmatic-dependent-launch wait and the gated prologue compile,
without spills. With ``PDSERVE_TEST_DEVICE=cuda`` the same cases run compiled, with and without
programmatic dependent launch, in a CUDA graph too, and the dispatch sends one-row projections to it.
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

from services.engine import ops, triton_support  # noqa: E402
from services.engine.ops import gemv_triton, reference  # noqa: E402
from services.engine.runner.cuda_graphs import capture_graph  # noqa: E402
from tests.sm90_compile import compile_script_lines  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
# The interpreter's bf16 cast truncates (see test_fused_ops.py), so on CPU bf16 is not among the cases.
DTYPES = (torch.float32, torch.float16) if ON_CPU else (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # max abs error / max abs value
PDL = (False,) if ON_CPU else (False, True)
# (n, k, tile): K a multiple of block_k and not, N a multiple of block_n and not, one tile and several.
SHAPES = [(48, 256, gemv_triton.Tile(8, 128, 4, 2)), (37, 300, gemv_triton.Tile(16, 128, 4, 2)),
          (5, 64, gemv_triton.Tile(8, 128, 4, 2))]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.parametrize("pdl", PDL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,tile", SHAPES)
def test_gemv_matches_linear(n: int, k: int, tile: gemv_triton.Tile, dtype: torch.dtype, pdl: bool) -> None:
    x, weight = _randn(1, k, dtype=dtype, seed=1), _randn(n, k, dtype=dtype, seed=2)
    bias = _randn(n, dtype=dtype, seed=3)
    for b in (None, bias):
        got = gemv_triton.gemv(x, weight, b, tile=tile, pdl=pdl)
        assert _rel_error(got, reference.linear(x, weight, b)) < TOLERANCE[dtype]


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_prologue_is_act_and_mul_then_linear(activation: str, dtype: torch.dtype) -> None:
    """The down projection's prologue computes ``act(gate) * up`` as the fused kernel does (rounded where
    torch rounds): the result is the unfused MLP tail's."""
    n, k = 40, 300
    gate_up, weight = _randn(1, 2 * k, dtype=dtype, seed=4) * 3, _randn(n, k, dtype=dtype, seed=5)
    expected = reference.linear(reference.act_and_mul(activation, *gate_up.chunk(2, dim=-1)), weight, None)
    for pdl in PDL:
        got = gemv_triton.gemv(gate_up, weight, gated=activation, tile=gemv_triton.Tile(8, 128, 4, 2), pdl=pdl)
        assert _rel_error(got, expected) < TOLERANCE[dtype]


# (rows, n, k, tile): rows below, at and between the MMA's 16; K and N multiples of the tile and not.
ROW_SHAPES = [(2, 48, 256, gemv_triton.Tile(16, 128, 4, 2)), (5, 37, 300, gemv_triton.Tile(32, 128, 4, 2)),
              (16, 40, 64, gemv_triton.Tile(16, 128, 4, 2)), (11, 70, 512, gemv_triton.Tile(64, 256, 4, 3))]


@pytest.mark.parametrize("pdl", PDL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,tile", ROW_SHAPES)
def test_several_rows_match_linear(rows: int, n: int, k: int, tile: gemv_triton.Tile, dtype: torch.dtype,
                                   pdl: bool) -> None:
    """A decode batch's rows through the tensor-core kernel: every row is its own ``linear``, the padding rows
    write nothing (the output's rows past ``rows`` keep their sentinel)."""
    x, weight = _randn(rows, k, dtype=dtype, seed=14), _randn(n, k, dtype=dtype, seed=15)
    bias = _randn(n, dtype=dtype, seed=16)
    for b in (None, bias):
        out = torch.full((rows + 1, n), 7.0, dtype=dtype, device=DEVICE)
        got = gemv_triton.gemv(x, weight, b, out=out[:rows], tile=tile, pdl=pdl)
        assert _rel_error(got, reference.linear(x, weight, b)) < TOLERANCE[dtype]
        assert (out[rows] == 7.0).all()


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_several_rows_gated_epilogue_and_strided(activation: str, dtype: torch.dtype) -> None:
    """The gate/up projection's epilogue: ``act(gate) * up`` of its output per row, rounded where torch rounds,
    reading rows of a wider buffer (a row stride that is not K); with a bias on both halves."""
    rows, inter, k = 6, 40, 300
    wide, weight = _randn(rows, k + 24, dtype=dtype, seed=17), _randn(2 * inter, k, dtype=dtype, seed=18) * 3
    x, bias = wide[:, :k], _randn(2 * inter, dtype=dtype, seed=19)
    for b in (None, bias):
        expected = reference.act_and_mul(activation, *reference.linear(x, weight, b).chunk(2, dim=-1))
        for tile in (gemv_triton.Tile(16, 128, 4, 2), gemv_triton.default_tile(inter, k, rows, gated_out=True)):
            got = gemv_triton.gemv(x, weight, b, gated_out=activation, tile=tile)
            assert _rel_error(got, expected) < TOLERANCE[dtype]


def test_bad_input_is_refused() -> None:
    weight = _randn(8, 64, dtype=torch.float32, seed=6)
    with pytest.raises(ValueError, match=f"1 to {gemv_triton.MAX_ROWS} contiguous rows of 64"):
        gemv_triton.gemv(_randn(gemv_triton.MAX_ROWS + 1, 64, dtype=torch.float32, seed=7), weight)
    with pytest.raises(ValueError, match="contiguous rows of 128"):
        gemv_triton.gemv(_randn(1, 64, dtype=torch.float32, seed=7), weight, gated="silu")
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv_triton.gemv(_randn(64, 2, dtype=torch.float32, seed=7).T, weight)
    with pytest.raises(ValueError, match="a gated input takes one row"):
        gemv_triton.gemv(_randn(2, 128, dtype=torch.float32, seed=7), weight, gated="silu")
    with pytest.raises(ValueError, match="a gated output several rows"):
        gemv_triton.gemv(_randn(1, 64, dtype=torch.float32, seed=7), weight, gated_out="silu")


def test_default_tiles_cover_the_sweep_space() -> None:
    """Every shape's default tile is one the bench sweeps, so the sweep can say whether it is the best."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (64, 64)):
        assert gemv_triton.default_tile(n, k) in gemv_triton.search_space()


def test_dispatch_sends_a_few_rows_on_cuda_to_the_gemvs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ops.linear`` / ``ops.act_and_linear`` / ``ops.gated_mlp``: 1 to ``MAX_ROWS`` 16-bit rows on CUDA take
    the GEMVs (the MLP's activation in the down projection at one row, in the gate/up one at several); more
    rows, CPU tensors, fp32, or ``PDSERVE_DECODE_GEMV=0`` take torch's ``linear``; the results agree."""
    calls = []
    real = gemv_triton.gemv
    monkeypatch.setattr(gemv_triton, "gemv", lambda *a, **kw: calls.append(
        (len(a[0]), kw.get("gated"), kw.get("gated_out"))) or real(*a, **kw))
    dtype = torch.float32 if ON_CPU else torch.bfloat16
    weight, gate_up_w = _randn(64, 128, dtype=dtype, seed=8), _randn(256, 64, dtype=dtype, seed=20) * 0.2
    for rows in (1, 3, gemv_triton.MAX_ROWS + 1):
        x = _randn(rows, 128, dtype=dtype, seed=10)
        assert _rel_error(ops.linear(x, weight), reference.linear(x, weight, None)) < TOLERANCE[dtype]
        gate_up = _randn(rows, 256, dtype=dtype, seed=9)
        assert _rel_error(ops.act_and_linear("silu", gate_up, weight), reference.linear(
            reference.act_and_mul("silu", *gate_up.chunk(2, dim=-1)), weight, None)) < TOLERANCE[dtype]
        h = _randn(rows, 64, dtype=dtype, seed=21)
        mlp = reference.linear(reference.act_and_mul("silu", *reference.linear(h, gate_up_w, None).chunk(2, dim=-1)),
                               weight, None)
        assert _rel_error(ops.gated_mlp("silu", h, gate_up_w, None, weight, None), mlp) < TOLERANCE[dtype]
    expected = [(1, None, None), (1, "silu", None), (1, None, None), (1, "silu", None),
                (3, None, None), (3, None, None), (3, None, "silu"), (3, None, None)]
    assert calls == ([] if ON_CPU else expected)
    monkeypatch.setattr(ops, "_decode_gemv", False)
    ops.linear(_randn(1, 128, dtype=dtype, seed=10), weight)
    ops.act_and_linear("silu", _randn(1, 256, dtype=dtype, seed=9), weight)
    ops.gated_mlp("silu", _randn(3, 64, dtype=dtype, seed=21), gate_up_w, None, weight, None)
    assert calls == ([] if ON_CPU else expected)
    monkeypatch.setenv(ops.GEMV_ENV_VAR, "2")
    with pytest.raises(ValueError, match="PDSERVE_DECODE_GEMV"):
        triton_support.switch_from_env(ops.GEMV_ENV_VAR, "")


@pytest.mark.skipif(ON_CPU, reason="CUDA graphs need a GPU")
def test_gemv_with_pdl_in_a_cuda_graph() -> None:
    """Captured launches with programmatic dependent launch read the x their predecessor wrote."""
    weight = _randn(4096, 4096, dtype=torch.bfloat16, seed=11)
    x = torch.zeros(1, 4096, dtype=torch.bfloat16, device=DEVICE)
    source = _randn(1, 4096, dtype=torch.bfloat16, seed=12)

    def step() -> torch.Tensor:
        x.copy_(source * 2)  # the predecessor the GEMV must wait for
        return gemv_triton.gemv(x, weight, pdl=True)

    graph, _, out = capture_graph(DEVICE, None, step)
    source.copy_(_randn(1, 4096, dtype=torch.bfloat16, seed=13))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel_error(out, reference.linear(source * 2, weight, None)) < TOLERANCE[torch.bfloat16]


_COMPILE_FOR_SM90 = r"""
from services.engine.ops import gemv_triton as g
from tests.sm90_compile import compile_for_sm90

PTRS = dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16")
for n, k in ((6144, 4096), (4096, 14336), (128256, 4096)):
    for act in (0, 1, 2):
        for pdl in (False, True):
            tile = g.default_tile(n, k)
            print(n, k, act, pdl, compile_for_sm90(
                g._gemv_kernel, PTRS,
                dict(BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=True, HAS_BIAS=act == 0, ACT=act, PDL=pdl),
                num_warps=tile.num_warps, num_stages=tile.num_stages))
            if pdl == (act == 2):
                continue  # the rows kernel: each activation once, PDL on and off once each
            tile = g.default_tile(n // 2 if act else n, k, rows=g.MAX_ROWS, gated_out=act != 0)
            print(n, k, act, pdl, compile_for_sm90(
                g._gemv_rows_kernel, PTRS,
                dict(BLOCK_M=16, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=True, HAS_BIAS=act == 0,
                     ACT_OUT=act, PDL=pdl, PRECISION="tf32"),
                num_warps=tile.num_warps, num_stages=tile.num_stages))
"""


@pytest.mark.slow
def test_gemv_compiles_for_sm90_without_spills() -> None:
    assert len(compile_script_lines(_COMPILE_FOR_SM90)) == 27


def test_pdl_is_asked_per_device_and_switched_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch: never on CPU; on CUDA from compute capability 9.0 unless
    ``PDSERVE_PDL=0``, any other value than 1 or 0 refused; every Triton launcher asks ``pdl_enabled``."""
    monkeypatch.setenv(triton_support.PDL_ENV_VAR, "off")
    with pytest.raises(ValueError, match="PDSERVE_PDL='off': expected 1 or 0"):
        triton_support.switch_from_env(triton_support.PDL_ENV_VAR, "")
    assert triton_support.pdl_enabled(torch.device("cpu")) is False
    if not ON_CPU:
        hopper = torch.cuda.get_device_capability(DEVICE)[0] >= 9
        assert triton_support.pdl_enabled(DEVICE) is hopper
        monkeypatch.setattr(triton_support, "_pdl", False)
        assert triton_support.pdl_enabled(DEVICE) is False
