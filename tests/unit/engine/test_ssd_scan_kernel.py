"""Mamba2's prefill in Triton (``ops/ssd_scan_triton.py`` over ``ops/chunked_scan_triton.py``, the conv in
``ops/causal_conv_triton.py``) against the torch chain of ``models/mamba2.py`` (``ssd_scan``, ``_chunk``).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET`` set before triton is
imported); with one (``PDSERVE_TEST_DEVICE=cuda``), on CUDA, where the engine's prefill is also compared and the
kernels compiled for sm_90 without spills. Cases: fp32 and bf16, lengths off the chunk size, one token, several
requests of different lengths in one step with non-zero states in out-of-order slots (one of them fresh, its slot
NaN), two groups of heads, unused slots and every scratch buffer between launches NaN-poisoned (a read of what
no launch wrote shows).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from services.engine import ops  # noqa: E402
from services.engine.kv_cache.state_pool import StateBatch, StatePool  # noqa: E402
from services.engine.model_config.hf import preset  # noqa: E402
from services.engine.models import mamba2  # noqa: E402
from services.engine.models.mamba2 import Mamba2Mixer  # noqa: E402
from services.engine.ops import chunked_scan_triton, ssd_scan_triton  # noqa: E402
from services.engine.ops.scan_chunks import scan_chunks  # noqa: E402
from services.engine.parallel import ParallelConfig  # noqa: E402
from tests.sm90_compile import compile_script_lines  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIG = preset("granite-4.0-h-tiny")  # 8 heads of 16, 2 groups of d_state 16, d_conv 4, chunks of 16
NUM_SLOTS = 9
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# One prefill step: lengths off the chunk (37: three chunks), under the conv window (2, 1: a decode row in a
# prefill step), one whole chunk (16).
LENGTHS = [37, 2, 16, 1]
SLOTS = [5, 2, 7, 0]  # out of order; 1, 3, 4, 6, 8 and the scratch slot unused
FRESH = [False, False, True, False]  # slot 7 starts at token 0: its NaNs must not be read


@pytest.fixture(autouse=True)
def _nan_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer between the scan's launches starts as NaN instead of whatever memory held."""
    monkeypatch.setattr(chunked_scan_triton, "scratch",
                        lambda shape, device: torch.full(shape, float("nan"), device=device))


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any()
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert error < TOLERANCE[dtype], error


def _scan_inputs(length: int, heads: int, groups: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, 16, generator=gen).to(dtype)
    dt = torch.rand(length, heads, generator=gen) * 0.5
    a = -torch.rand(heads, generator=gen) * 2.0
    b = torch.randn(length, groups, 16, generator=gen).to(dtype)
    c = torch.randn(length, groups, 16, generator=gen).to(dtype)
    state = torch.randn(heads, 16, 16, generator=gen)
    return tuple(t.to(DEVICE) for t in (x, dt, a, b, c, state))


def _torch_scan(x, dt, a, b, c, state, chunk_size):
    per_group = x.shape[1] // b.shape[1]
    return mamba2.ssd_scan(x.float(), dt, a, b.float().repeat_interleave(per_group, 1),
                           c.float().repeat_interleave(per_group, 1), state, chunk_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 16, 37])
def test_scan_matches_the_torch_scan(dtype: torch.dtype, length: int) -> None:
    """One sequence from a non-zero state, two groups of two heads: y and the final state."""
    inputs = _scan_inputs(length, 4, 2, dtype, seed=length)
    y, final = ssd_scan_triton.ssd_scan(*inputs, 16)
    want_y, want_final = _torch_scan(*inputs, 16)
    _close(y, want_y, dtype)
    _close(final, want_final, dtype)


def test_a_chunk_size_off_the_tile() -> None:
    """Chunks of 24 (tiles of 32 hanging over each chunk's end) and one group for all heads."""
    inputs = _scan_inputs(50, 2, 1, torch.float32, seed=3)
    y, final = ssd_scan_triton.ssd_scan(*inputs, 24)
    want_y, want_final = _torch_scan(*inputs, 24)
    _close(y, want_y, torch.float32)
    _close(final, want_final, torch.float32)


def test_sequences_of_one_step_match_each_alone() -> None:
    """Four sequences packed in one table: each gets what it gets alone, its final state lands in its own slot,
    a fresh one ignores its slot's NaNs and no other slot changes."""
    parts = [_scan_inputs(n, 4, 2, torch.float32, seed=10 + i) for i, n in enumerate(LENGTHS)]
    slots = torch.full((NUM_SLOTS, 4, 16, 16), float("nan"), device=DEVICE)
    for (*_, state), slot, fresh in zip(parts, SLOTS, FRESH, strict=True):
        if not fresh:
            slots[slot] = state
    packed = [torch.cat([p[i] for p in parts]) for i in (0, 1, 3, 4)]
    table = scan_chunks(LENGTHS, SLOTS, FRESH, 16, DEVICE)
    y = ssd_scan_triton.ssd_chunks(packed[0], packed[1], parts[0][2], packed[2], packed[3], slots, table,
                                   a_is_log=False)
    start = 0
    for (x, dt, _, b, c, state), n, slot, fresh in zip(parts, LENGTHS, SLOTS, FRESH, strict=True):
        want_y, want_final = _torch_scan(x, dt, parts[0][2], b, c, torch.zeros_like(state) if fresh else state, 16)
        _close(y[start:start + n].view(n, 4, 16), want_y, torch.float32)
        _close(slots[slot], want_final, torch.float32)
        start += n
    unused = [i for i in range(NUM_SLOTS) if i not in SLOTS]
    assert slots[unused].isnan().all()


def test_chunk_table() -> None:
    table = scan_chunks([37, 2], [5, 2], [False, True], 16, torch.device("cpu"))
    assert table.chunks[:, :3].tolist() == [[0, 16, 0], [16, 16, 0], [32, 5, 0], [37, 2, 1]]
    assert table.seqs[:, :6].tolist() == [[0, 37, 5, 0, 0, 3], [37, 2, 2, 1, 3, 1]]
    assert (table.num_chunks, table.num_seqs, table.num_tokens) == (4, 2, 39)
    with pytest.raises(ValueError, match="every sequence needs a token"):
        scan_chunks([3, 0], [0, 1], [False, False], 16, torch.device("cpu"))


def _mixer(dtype: torch.dtype, seed: int = 0) -> Mamba2Mixer:
    gen = torch.Generator().manual_seed(seed)
    mixer = Mamba2Mixer(CONFIG.granite.mamba, CONFIG.hidden_size, CONFIG.rms_norm_eps, dtype, DEVICE,
                        ParallelConfig())
    for name, p in mixer.named_parameters():
        values = torch.randn(p.shape, generator=gen) * (0.1 if "proj" in name else 0.3 if "weight" in name else 1.0)
        if name == "A_log":
            values = torch.rand(p.shape, generator=gen) * 2.0  # A = -exp(A_log): decays of 0.1 to 1 a step
        p.data.copy_(values.to(dtype))
    return mixer


def _pool(dtype: torch.dtype, seed: int = 1) -> StatePool:
    """Random states in the slots of requests that carry one, NaN in every other slot (the fresh one's too)."""
    pool = StatePool.for_model(CONFIG, NUM_SLOTS, dtype, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for states in (pool.conv[0], pool.ssm[0]):
        states.copy_(torch.full(states.shape, float("nan")))
        for slot in SLOTS:
            states[slot] = torch.randn(states.shape[1:], generator=gen).to(states.dtype)
    pool.conv[0][SLOTS[FRESH.index(True)]] = float("nan")
    pool.ssm[0][SLOTS[FRESH.index(True)]] = float("nan")
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixer_prefill_takes_the_kernels_under_the_triton_backend(dtype: torch.dtype) -> None:
    """The whole prefill forward of one step of four requests (in_proj, conv, scan, gated norm, out_proj) against
    the torch path's per-request ``_chunk`` loop: outputs and both states of every request's slot."""
    mixer = _mixer(dtype)
    x = torch.randn(sum(LENGTHS), CONFIG.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    runs = {}
    for backend in ("torch", "triton"):
        pool = _pool(dtype)
        states = StateBatch.of(SLOTS, [0 if f else 3 for f in FRESH], DEVICE)
        with ops.use_backend(backend):
            runs[backend] = (mixer(x.to(DEVICE), LENGTHS, states, pool.conv[0], pool.ssm[0]), pool)
    (want, ref), (got, fused) = runs["torch"], runs["triton"]
    _close(got, want, dtype)
    _close(fused.ssm[0][SLOTS], ref.ssm[0][SLOTS], dtype)
    assert torch.equal(fused.conv[0][SLOTS], ref.conv[0][SLOTS])  # the window's last inputs, copied as they are
    unused = [i for i in range(NUM_SLOTS + 1) if i not in SLOTS]
    assert fused.conv[0][unused].isnan().all() and fused.ssm[0][unused].isnan().all()


def test_kernels_refuse_what_they_cannot_address() -> None:
    table = scan_chunks([4], [0], [False], 16, DEVICE)
    x, dt, a, b, c, state = _scan_inputs(4, 4, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="float32"):
        chunked_scan_triton.pass_states(torch.zeros(1, 4, 16, 16, device=DEVICE), dt.t().contiguous(), table,
                                        state.unsqueeze(0).half())
    with pytest.raises(ValueError, match="must be \\[4,"):
        chunked_scan_triton.chunk_qk(c[:3], b[:3], table)
    with pytest.raises(ValueError, match="do not fit"):
        chunked_scan_triton.chunk_cumsum(dt, a[:3], table)


def _engine_run(checkpoint, device: str, backend: str, prompts: list[list[int]], max_tokens: int):
    from services.contract.sampling_params import SamplingParams
    from services.engine.engine_config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from tests.parity import run_to_completion

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_logits=True)
    with ops.use_backend(backend):
        engine = LLMEngine(EngineConfig(model=str(checkpoint), device=device, dtype="float32", block_size=4,
                                        num_kv_blocks=128, max_num_batched_tokens=16, max_num_seqs=4))
        return run_to_completion(engine, prompts, params)[1]


def _assert_same_run(got, want, rel_tol: float = 1e-4) -> None:
    for fused, ref in zip(got, want, strict=True):
        assert fused.token_ids == ref.token_ids
        for (start, a), (start_b, b) in zip(fused.logits, ref.logits, strict=True):
            assert start == start_b and ((a - b).abs().max() / b.abs().max()).item() < rel_tol


@pytest.mark.skipif(DEVICE.type == "cuda", reason="kernels on CPU tensors need Triton's interpreter, which a CUDA "
                    "run does not set; test_engine_on_cuda_equals_the_torch_chain is its CUDA form")
def test_engine_prefill_with_the_kernels_equals_the_torch_chain(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A random Granite-4.0-H checkpoint (two groups, chunks of 8), three prompts prefilled in 16-token steps (a
    request's prompt split over steps, several requests in a step, each carried in its slot), a few greedy tokens:
    with the Mamba2 kernels (interpreted on CPU; every other op the torch one, which keeps the file fast) the
    torch chain's tokens and logits."""
    from tests.unit.engine.test_granite_hybrid import make_granite_checkpoint

    directory, _ = make_granite_checkpoint("rope", tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (18, 5, 7)]
    want = _engine_run(directory, "cpu", "torch", prompts, 2)
    monkeypatch.setattr(mamba2, "use_state_kernels", lambda x: True)
    fused, calls = Mamba2Mixer._chunks_fused, []
    monkeypatch.setattr(Mamba2Mixer, "_chunks_fused", lambda self, *a: calls.append(a[3]) or fused(self, *a))
    _assert_same_run(_engine_run(directory, "cpu", "torch", prompts, 2), want)
    assert [16] in calls and any(len(lens) > 1 for lens in calls), calls  # a split prompt, a step of several


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the prefill kernels run in the engine only on CUDA")
def test_engine_on_cuda_equals_the_torch_chain(tmp_path) -> None:
    """The same on CUDA with the default backend (``auto``: every kernel compiled, every other fused op too, hence
    the looser logits) against ``torch``."""
    from tests.unit.engine.test_granite_hybrid import make_granite_checkpoint

    directory, _ = make_granite_checkpoint("moe", tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (70, 9, 33, 1)]
    runs = {backend: _engine_run(directory, "cuda", backend, prompts, 8) for backend in ("torch", "auto")}
    _assert_same_run(runs["auto"], runs["torch"], rel_tol=1e-3)


_COMPILE_FOR_SM90 = r"""
from services.engine.ops import causal_conv_triton as conv, chunked_scan_triton as s
from tests.sm90_compile import compile_for_sm90


# Pointers and the integers that are multiples of 16 at these shapes marked so, as Triton's launcher specializes
# them (without the marks the loads are not vectorized, and the compile is not the one that runs).
def compile_(fn, types, constexprs, multiples_of_16, warps=4):
    aligned = [n for n in fn.arg_names if types.get(n, "").startswith("*")] + multiples_of_16
    return compile_for_sm90(fn, types, constexprs, aligned, warps)


# Granite-4.0-H-Tiny: 48 heads of 64, one group of d_state 128, chunks of 256, d_conv 4; bf16 inputs (fp32 too).
i32 = dict(Chunks="*i32", Seqs="*i32")
print("cumsum", compile_(s._chunk_cumsum_kernel, dict(Dt="*bf16", A="*bf16", DtBias="*bf16", W="*fp32", Cum="*fp32",
                                                      dt_min="fp32", dt_max="fp32", **i32),
                         dict(BLOCK_Q=256, BLOCK_H=16, A_IS_LOG=True, HAS_BIAS=True, SOFTPLUS=True),
                         ["heads", "stride_dt"]))
print("qk", compile_(s._chunk_qk_kernel, dict(Q="*bf16", K="*bf16", QK="*fp32", **i32),
                     dict(TILES=4, BLOCK_T=64, BLOCK_N=64, DOT="tf32"),
                     ["chunk_size", "d_key", "stride_q_t", "stride_q_g", "stride_k_t", "stride_k_g"], s.QK_WARPS))
print("states", compile_(s._chunk_states_kernel, dict(V="*bf16", K="*bf16", W="*fp32", Cum="*fp32", States="*fp32",
                                                      **i32),
                         dict(BLOCK_S=64, BLOCK_P=64, BLOCK_N=64, HAS_W=True, DOT="tf32"),
                         ["heads_per_group", "d_value", "d_key", "stride_v_t", "stride_v_h", "stride_k_t",
                          "stride_k_g"], s.STATES_WARPS))
print("pass", compile_(s._pass_states_kernel, dict(States="*fp32", Cum="*fp32", Slots="*fp32", **i32),
                       dict(BLOCK_E=1024), ["heads", "state_numel", "stride_slot", "stride_head"]))
out = dict(V="*bf16", Qry="*bf16", QK="*fp32", W="*fp32", Cum="*fp32", States="*fp32", Dskip="*bf16", Z="*bf16",
           Y="*fp32", **i32)
out_ints = ["heads_per_group", "d_value", "d_key", "chunk_size", "stride_v_t", "stride_v_h", "stride_q_t",
            "stride_q_g", "stride_z", "stride_y"]
for name, dtype, dot in (("output", "*bf16", "tf32"), ("output fp32", "*fp32", "ieee")):
    print(name, compile_(s._chunk_output_kernel, dict(out, V=dtype, Qry=dtype),
                         dict(BLOCK_T=64, BLOCK_P=64, BLOCK_N=128, HAS_W=True, HAS_D=True, HAS_Z=True, DOT=dot),
                         out_ints, s.OUTPUT_WARPS))
print("conv", compile_(conv._causal_conv_kernel, dict(X="*bf16", State="*bf16", Weight="*bf16", Bias="*bf16",
                                                      Out="*bf16", **i32),
                       dict(D_CONV=4, BLOCK_T=conv.CONV_BLOCK_T, BLOCK_C=conv.CONV_BLOCK_C, HAS_BIAS=True, SILU=True),
                       ["channels", "stride_x", "stride_slot", "stride_out"]))
print("conv state", compile_(conv._conv_state_kernel, dict(X="*bf16", State="*bf16", **i32),
                             dict(D_CONV=4, BLOCK_K=4, BLOCK_C=conv.CONV_BLOCK_C),
                             ["channels", "stride_x", "stride_slot"]))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills() -> None:
    lines = compile_script_lines(_COMPILE_FOR_SM90)
    assert len(lines) == 8, lines
