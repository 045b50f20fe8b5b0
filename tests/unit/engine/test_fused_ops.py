"""Fused ops (``services/engine/ops``): each Triton kernel against the torch reference, the dispatch,
and whole engines with the fused ops forced through Triton against the same engines on torch.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; the interpreter is chosen
when triton is first imported, so ``TRITON_INTERPRET`` is set here before anything imports it (as
in ``test_attention_backends.py``, whose docstring says why that works under pytest). With a GPU
(or ``PDSERVE_TEST_DEVICE=cuda``) the same tests run the compiled kernels on CUDA, plus a CUDA-graph
capture of every op.

The kernels round intermediate results where torch rounds them, so fp32 and fp16 results match the
reference to a few fp32 ulps or exactly; bf16 gets a looser bound because the interpreter's cast to
bfloat16 truncates (compiled kernels round to nearest even, as torch).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

DEVICE = torch.device(os.environ.get("PDSERVE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
ON_CPU = DEVICE.type == "cpu"
if ON_CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see the module docstring)
pytest.importorskip("triton")

from services.contract.sampling_params import SamplingParams  # noqa: E402
from services.engine import ops  # noqa: E402
from services.engine.engine_config import EngineConfig  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.engine.model_config.hf import RopeSpec  # noqa: E402
from services.engine.models.layers import RopeAngles, RotaryEmbedding  # noqa: E402
from services.engine.ops import reference, triton_ops  # noqa: E402
from services.engine.runner.cuda_graphs import capture_graph  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.parity import run_to_completion  # noqa: E402
from tests.sm90_compile import compile_script_lines  # noqa: E402

# exp(-x) overflows to inf for very negative gates in the interpreter's numpy (the result, -0, is right)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
ROOT = Path(__file__).resolve().parents[3]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # max abs error / max abs value


def _randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert not got.isnan().any()
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _exact(dtype: torch.dtype) -> bool:
    """Whether a product or sum rounded once must match torch bit for bit: fp16 always, fp32 in the
    interpreter (compiled fp32 may fuse a multiply and an add into one FMA), bf16 only compiled."""
    return dtype == torch.float16 or (dtype == torch.float32) == ON_CPU


# ---- RMSNorm -----------------------------------------------------------------------------------------
# (shape, offset, residual, weight): offset None is Llama's RMSNorm, a float Gemma's OffsetRMSNorm.
NORM_CASES = {
    "llama-576-t300": ((300, 576), None, False, True),
    "llama-4096-t1-residual": ((1, 4096), None, True, True),
    "llama-4096-t37-residual": ((37, 4096), None, True, True),
    "gemma-2304-t19-offset1-residual": ((19, 2304), 1.0, True, True),
    "gemma4-576-t300-offset0": ((300, 576), 0.0, False, True),
    "gemma4-3d-noweight": ((23, 3, 256), 0.0, False, False),  # per-layer inputs / value norm shapes
    "llama-8192-t3-residual": ((3, 8192), None, True, True),  # the widest row the kernel takes
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(NORM_CASES))
def test_rms_norm(name: str, dtype: torch.dtype) -> None:
    shape, offset, with_residual, with_weight = NORM_CASES[name]
    x = _randn(*shape, dtype=dtype, scale=3.0)
    weight = _randn(shape[-1], dtype=dtype, scale=0.5 if offset else 1.0, seed=1) if with_weight else None
    residual = _randn(*shape, dtype=dtype, seed=2) if with_residual else None
    got = triton_ops.rms_norm(x, weight, 1e-6, offset, residual)
    expected = reference.rms_norm(x, weight, 1e-6, offset, residual)
    assert got is not None, "the kernel declined the input"
    if residual is None:
        got, expected = (got,), (expected,)
    else:
        assert torch.equal(got[1], expected[1]) or not _exact(dtype)  # the new residual: one rounded add
        assert _rel_error(got[1], expected[1]) < TOLERANCE[dtype]
    assert _rel_error(got[0], expected[0]) < TOLERANCE[dtype]
    assert got[0].is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rms_norm_of_heads_in_a_fused_projection(head_dim: int, dtype: torch.dtype) -> None:
    """q/k norms (Qwen3, Gemma-3/4) read [tokens, heads, head_dim] views of the fused qkv output in place."""
    tokens, heads, kv_heads = 41, 6, 2
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    weight = _randn(head_dim, dtype=dtype, seed=1)
    for x, offset in ((q, None), (k, 1.0)):
        got = triton_ops.rms_norm(x, weight, 1e-5, offset, None)
        assert got.shape == x.shape
        assert _rel_error(got, reference.rms_norm(x, weight, 1e-5, offset)) < TOLERANCE[dtype]


# ---- RoPE --------------------------------------------------------------------------------------------
LLAMA3_ROPE = RopeSpec(500000.0, "llama3", 8.0, 1.0, 4.0, 64)
PROPORTIONAL_ROPE = RopeSpec(1000000.0, "proportional", partial_rotary_factor=0.25)
# (head_dim, tokens, query heads, KV heads (0: no keys), rope, table): ``table`` reads a position-indexed
# cos/sin table (Llama's RotaryEmbedding), else per-token angles (Gemma's RopeAngles).
ROPE_CASES = {
    "d64-t300-table": (64, 300, 6, 2, RopeSpec(10000.0), True),
    "d128-t37-llama3-table": (128, 37, 8, 1, LLAMA3_ROPE, True),
    "d256-t5-angles": (256, 5, 4, 4, RopeSpec(10000.0), False),
    "d512-t9-proportional-angles": (512, 9, 2, 1, PROPORTIONAL_ROPE, False),  # Gemma-4 full layers
    "d256-t3-no-keys": (256, 3, 4, 0, RopeSpec(10000.0), False),  # a KV-shared layer
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_apply_rope(name: str, dtype: torch.dtype) -> None:
    head_dim, tokens, heads, kv_heads, rope, table = ROPE_CASES[name]
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim) if kv_heads else None
    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 4000, (tokens,), generator=gen).to(DEVICE)
    if table:
        emb = RotaryEmbedding(head_dim, rope, 4096, DEVICE)
        cos, sin, rows = emb.cos, emb.sin, positions
    else:
        (cos, sin), rows = RopeAngles(head_dim, rope, DEVICE)(positions), None
    got = triton_ops.apply_rope(q, k, cos, sin, rows)
    expected = reference.apply_rope(q, k, cos, sin, rows)
    assert got is not None, "the kernel declined the input"
    for g, e in zip(got, expected, strict=True):
        if e is None:
            assert g is None
            continue
        assert _rel_error(g, e) < TOLERANCE[dtype]
        # Compiled, the rotation's multiply-add contracts into an FMA, which torch's separately rounded
        # mul/mul/add does not: a 16-bit result may then differ by an ulp (measured on an H100), so bit
        # equality is only asked of the interpreter.
        if _exact(dtype) and ON_CPU:
            assert torch.equal(g, e)
    if rope.rope_type == "proportional":  # pairs past the rotated quarter pass through unchanged
        half, rotated = head_dim // 2, int(0.25 * head_dim // 2)
        assert torch.equal(got[0][..., rotated:half], q[..., rotated:half])


# ---- gated activations -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
@pytest.mark.parametrize("tokens,inter", [(1, 14336), (300, 1536), (37, 1000)])
def test_act_and_mul(tokens: int, inter: int, activation: str, dtype: torch.dtype) -> None:
    gate_up = _randn(tokens, 2 * inter, dtype=dtype, scale=3.0)
    got = triton_ops.act_and_mul(activation, *gate_up.chunk(2, dim=-1))
    assert got is not None, "the kernel declined the input"
    assert got.shape == (tokens, inter)
    assert _rel_error(got, reference.act_and_mul(activation, *gate_up.chunk(2, dim=-1))) < TOLERANCE[dtype]


def test_act_and_mul_of_separate_strided_inputs() -> None:
    """Gemma-4's per-layer input gate: ``act(gate) * ple[:, layer]``, a strided slice of [tokens, layers, P]."""
    gate = _randn(13, 256, scale=3.0)
    ple = _randn(13, 5, 256, seed=1)
    got = triton_ops.act_and_mul("gelu_pytorch_tanh", gate, ple[:, 3])
    assert _rel_error(got, reference.act_and_mul("gelu_pytorch_tanh", gate, ple[:, 3])) < TOLERANCE[torch.float32]


def test_activations_at_extremes() -> None:
    """Large |x|: no overflow to NaN (exp(-x) is inf for very negative x), exact limits."""
    gate = torch.tensor([[-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4]], device=DEVICE)
    up = torch.ones_like(gate)
    for activation in ops.ACTIVATIONS:
        got = triton_ops.act_and_mul(activation, gate, up)
        torch.testing.assert_close(got, reference.act_and_mul(activation, gate, up), rtol=1e-5, atol=1e-6)


# ---- dispatch ----------------------------------------------------------------------------------------
def test_backend_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, backend in (("", "auto"), ("1", "auto"), ("auto", "auto"), ("0", "torch"), ("torch", "torch"),
                           ("Triton", "triton")):
        monkeypatch.setenv(ops.ENV_VAR, value)
        assert ops._backend_from_env() == backend
    monkeypatch.setenv(ops.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="PDSERVE_FUSED_OPS"):
        ops._backend_from_env()
    with pytest.raises(ValueError, match="unknown fused-ops backend"):
        ops.set_backend("cuda")


def test_engine_setting_applies_unless_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--fused-ops`` (EngineConfig.fused_ops) sets the backend; PDSERVE_FUSED_OPS overrides it."""
    from services.engine.engine_config import FUSED_OPS_BACKENDS

    assert FUSED_OPS_BACKENDS == ops.BACKENDS
    with pytest.raises(ValueError, match="unknown fused_ops"):
        EngineConfig(fused_ops="fast")
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    for name in ("_fused_kv_write", "_decode_gemv"):  # configure sets them too: restored after the test
        monkeypatch.setattr(ops, name, getattr(ops, name))
    switches = {"fused_kv_write": True, "decode_gemv": True}
    with ops.use_backend("auto"):
        ops.configure(None, **switches)
        assert ops.get_backend() == "auto"
        ops.configure("torch", **switches)
        assert ops.get_backend() == "torch"
        monkeypatch.setenv(ops.ENV_VAR, "triton")
        ops.configure("auto", **switches)
        assert ops.get_backend() == "torch"


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: Triton only for CUDA tensors; torch: never; triton: always, and inputs a kernel declines
    (float64 here) take the reference."""
    calls = []
    real = triton_ops.rms_norm
    monkeypatch.setattr(triton_ops, "rms_norm", lambda *args: calls.append(1) or real(*args))
    x, weight = _randn(3, 64), _randn(64, seed=1)
    with ops.use_backend("torch"):
        ops.rms_norm(x, weight, 1e-6)
    with ops.use_backend("auto"):
        ops.rms_norm(x, weight, 1e-6)
    assert len(calls) == (0 if ON_CPU else 1)
    with ops.use_backend("triton"):
        ops.rms_norm(x, weight, 1e-6)
        x64 = x.double()
        assert torch.equal(ops.rms_norm(x64, weight.double(), 1e-6), reference.rms_norm(x64, weight.double(), 1e-6))
        gate_up = _randn(4, 32)
        assert torch.equal(ops.silu_and_mul(gate_up), ops.act_and_mul("silu", *gate_up.chunk(2, dim=-1)))
    assert len(calls) == (2 if ON_CPU else 3)
    with pytest.raises(ValueError, match="unsupported activation"):
        ops.act_and_mul("relu", gate_up, gate_up)


@pytest.mark.skipif(ON_CPU, reason="CUDA graphs need a GPU")
def test_ops_capture_in_a_cuda_graph() -> None:
    """Every kernel launch is capturable (no host syncs) and replays on new inputs."""
    dtype = torch.bfloat16
    x, residual, weight = _randn(8, 4096, dtype=dtype), _randn(8, 4096, dtype=dtype, seed=1), _randn(4096, dtype=dtype)
    qkv = _randn(8, 48 * 128, dtype=dtype, seed=2)
    q, k = qkv[:, : 32 * 128].view(8, 32, 128), qkv[:, 32 * 128: 40 * 128].view(8, 8, 128)
    emb = RotaryEmbedding(128, LLAMA3_ROPE, 1024, DEVICE)
    positions = torch.arange(8, device=DEVICE)
    gate_up = _randn(8, 2 * 1024, dtype=dtype, seed=3)

    def step():
        with ops.use_backend("triton"):
            normed, summed = ops.rms_norm(x, weight, 1e-5, None, residual)
            return (normed, summed, *ops.apply_rope(q, k, emb.cos, emb.sin, positions), ops.silu_and_mul(gate_up),
                    ops.rms_norm(x, weight, 1e-6, 1.0))

    graph, _, outs = capture_graph(torch.device("cuda"), None, step)  # compiles outside the capture
    for i, t in enumerate((x, residual, qkv, gate_up)):
        t.copy_(_randn(*t.shape, dtype=dtype, seed=10 + i))
    positions.copy_(torch.arange(100, 108, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    expected = (*reference.rms_norm(x, weight, 1e-5, None, residual),
                *reference.apply_rope(q, k, emb.cos, emb.sin, positions),
                reference.act_and_mul("silu", *gate_up.chunk(2, dim=-1)), reference.rms_norm(x, weight, 1e-6, 1.0))
    for got, exp in zip(outs, expected, strict=True):
        assert _rel_error(got, exp) < TOLERANCE[dtype]


# ---- whole engines -----------------------------------------------------------------------------------
def _engine(checkpoint: Path, **kwargs) -> LLMEngine:
    config = dict(model=str(checkpoint), device=DEVICE.type, dtype="float32", block_size=4, num_kv_blocks=96,
                  max_num_batched_tokens=16)
    return LLMEngine(EngineConfig(**{**config, **kwargs}))


def _prompts(vocab: int, lengths=(5, 21)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _runs(checkpoint: Path, prompts_lengths, max_tokens: int, twice: bool) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_logits=True)
    runs = {}
    for backend in ("torch", "triton"):
        with ops.use_backend(backend):
            engine = _engine(checkpoint)
            prompts = _prompts(engine.model_config.vocab_size, prompts_lengths)
            _, outs = run_to_completion(engine, prompts, params)
            if twice:  # prefix-cache hits: chunks that start mid-prompt
                _, second = run_to_completion(engine, prompts, params)
                assert all(o.num_cached_tokens > 0 for o in second)
                outs += second
        runs[backend] = outs
    return runs


def _assert_same(runs: dict) -> None:
    for ref, got in zip(runs["torch"], runs["triton"], strict=True):
        assert got.token_ids == ref.token_ids
        for (start, expected), (got_start, chunk) in zip(ref.logits, got.logits, strict=True):
            assert start == got_start
            assert _rel_error(chunk, expected) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_engine_greedy_parity(arch: str, tmp_path: Path) -> None:
    """Greedy tokens and logits with every fused op through Triton equal the torch path's: chunked
    prefill (16-token budget), decode steps, and a second pass over prefix-cache hits."""
    directory, _ = make_checkpoint(arch, tmp_path)
    _assert_same(_runs(directory, (5, 21), max_tokens=4, twice=True))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "gemma4"])
def test_engine_parity_other_architectures(arch: str, tmp_path: Path) -> None:
    """q/k norms on strided heads (Qwen3, Gemma-3), and Gemma-4: value norm without weight, partial
    rotary, KV-shared layers (rope without keys), per-layer inputs."""
    directory, _ = make_checkpoint(arch, tmp_path)
    _assert_same(_runs(directory, (11,), max_tokens=2, twice=False))


# ---- the compiler ------------------------------------------------------------------------------------
# Compiles the kernels for sm_90 with the ptxas Triton ships (no GPU needed): the interpreter runs any
# Python, so only this catches what the compiler rejects. Prints each case's registers and spills.
_COMPILE_FOR_SM90 = r"""
import torch
from services.engine.ops import triton_ops as to
from tests.sm90_compile import compile_for_sm90

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def compile_(name, fn, types, constexprs, num_warps):
    print(name, compile_for_sm90(fn, types, constexprs, num_warps=num_warps))


for dtype, cols, residual, fp32_scale in ((torch.bfloat16, 128, False, False), (torch.bfloat16, 4096, True, False),
                                          (torch.bfloat16, 8192, True, True), (torch.float32, 8192, True, False)):
    t = TYPES[dtype]
    block_n, rows, warps = to._norm_config(cols)
    compile_(f"rms_norm {dtype} {cols} residual={residual} fp32_scale={fp32_scale}", to._rms_norm_kernel,
             dict(X=t, Residual=t, Weight=t, Out=t, ResidualOut=t, eps="fp32", offset="fp32"),
             dict(BLOCK_ROWS=rows, BLOCK_N=block_n, HAS_RESIDUAL=residual, HAS_WEIGHT=True, FP32_SCALE=fp32_scale,
                  PDL=residual),
             warps)
for dtype, head_dim, positions in ((torch.bfloat16, 128, True), (torch.bfloat16, 512, False),
                                   (torch.float32, 64, True)):
    t = TYPES[dtype]
    half = head_dim // 2
    block_half = to._next_pow2(half)
    block_r = max(1, to._tile_elements() // block_half)
    compile_(f"rope {dtype} {head_dim} positions={positions}", to._rope_kernel,
             dict(Q=t, K=t, QOut=t, KOut=t, Cos="*fp32", Sin="*fp32", Positions="*i64"),
             dict(HALF=half, BLOCK_HALF=block_half, BLOCK_R=block_r, HAS_POSITIONS=positions),
             to._num_warps(block_r * block_half))
for gelu in (False, True):
    block_m, block_n, warps = to._act_config(14336)
    compile_(f"act gelu={gelu}", to._act_and_mul_kernel, dict(Gate="*bf16", Up="*bf16", Out="*bf16"),
             dict(GELU=gelu, BLOCK_M=block_m, BLOCK_N=block_n, PDL=gelu), warps)
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills() -> None:
    assert len(compile_script_lines(_COMPILE_FOR_SM90)) == 9
