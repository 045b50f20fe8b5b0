"""Mamba2's fused decode step (``ops/mamba_decode_triton.py``) against the torch step of ``models/mamba2.py``.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET`` set before triton is
imported, as in ``test_mxfp4_moe.py``); with one, on CUDA, where the step is also captured in a CUDA graph and
the kernels compiled for sm_90 without spills. The states live in a real ``StatePool`` (strided views, one byte
buffer), the rows' slots are out of order, several steps run in a row (the state carried), padding rows
(slot -1) must leave every state bit-identical, and the slots no row uses are NaN-poisoned, so a read of the
wrong slot shows. fp32 and bf16 (bf16: the torch step rounds its conv to bf16, the kernel does not).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from services.engine import ops  # noqa: E402
from services.engine.kv_cache.state_pool import StateBatch, StatePool  # noqa: E402
from services.engine.model_config.hf import preset  # noqa: E402
from services.engine.models.mamba2 import Mamba2Mixer  # noqa: E402
from services.engine.ops import mamba_decode_triton as kernels  # noqa: E402
from services.engine.parallel import ParallelConfig  # noqa: E402
from tests.sm90_compile import compile_script_lines  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIG = preset("granite-4.0-h-tiny")  # 8 heads of 16, 2 groups of d_state 16, d_conv 4
NUM_SLOTS = 9
SLOTS = [5, 2, 7, 0]  # out of order; 1, 3, 4, 6, 8 and the scratch slot unused
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _whole_head_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter a program costs ~15 ms whatever its tile: one program per head keeps the file fast
    (``test_dt_limit_and_other_tiles`` runs smaller tiles). On CUDA the engine's own tiles run."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(kernels, "ssm_tile", lambda rows, heads, head_dim, d_state: (head_dim, 4))


def _mixer(dtype: torch.dtype, seed: int = 0) -> Mamba2Mixer:
    gen = torch.Generator().manual_seed(seed)
    mixer = Mamba2Mixer(CONFIG.granite.mamba, CONFIG.hidden_size, CONFIG.rms_norm_eps, dtype, DEVICE,
                        ParallelConfig())
    for name, p in mixer.named_parameters():
        values = torch.randn(p.shape, generator=gen) * (0.3 if "weight" in name else 1.0)
        if name == "A_log":
            values = torch.rand(p.shape, generator=gen) * 2.0  # A = -exp(A_log): decays of 0.1 to 1 a step
        p.data.copy_(values.to(dtype))
    return mixer


def _pool(dtype: torch.dtype, seed: int = 1) -> StatePool:
    """Random states in the used slots, NaN in every other one."""
    pool = StatePool.for_model(CONFIG, NUM_SLOTS, dtype, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for states in (pool.conv[0], pool.ssm[0]):
        states.copy_(torch.full(states.shape, float("nan")))
        for slot in SLOTS:
            states[slot] = torch.randn(states.shape[1:], generator=gen).to(states.dtype)
    return pool


def _inputs(mixer: Mamba2Mixer, rows: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """z, xBC and dt as strided slices of one in_proj output, as the mixer sees them."""
    s = mixer.spec
    proj = torch.randn(rows, s.in_proj_width, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    return proj.split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(torch.uint8)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert error < TOLERANCE[dtype], error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_match_the_torch_step(dtype: torch.dtype) -> None:
    """Three steps in a row from the same states: outputs and both states agree, slot by slot."""
    mixer = _mixer(dtype)
    ref, fused = _pool(dtype), _pool(dtype)
    slots = torch.tensor(SLOTS, device=DEVICE)
    for step in range(3):
        z, xbc, dt = _inputs(mixer, len(SLOTS), dtype, seed=10 + step)
        want = mixer._step(xbc, dt, slots, ref.conv[0], ref.ssm[0]) * torch.nn.functional.silu(z.float())
        got = mixer._step_fused(xbc, dt, z, slots, fused.conv[0], fused.ssm[0])
        _close(got, want, dtype)
        for name in ("conv", "ssm"):
            _close(getattr(fused, name)[0][SLOTS], getattr(ref, name)[0][SLOTS], dtype)
    unused = [i for i in range(NUM_SLOTS + 1) if i not in SLOTS]
    assert fused.conv[0][unused].isnan().all() and fused.ssm[0][unused].isnan().all()


def test_padding_rows_touch_nothing() -> None:
    """Rows with slot -1 (NaN inputs) between real rows: their outputs are 0, every state byte but the real rows'
    slots is as before, and the real rows get what they get without the padding."""
    dtype = torch.float32
    mixer = _mixer(dtype)
    pool, alone = _pool(dtype), _pool(dtype)
    before = _bits(pool._rows)
    z, xbc, dt = _inputs(mixer, 6, dtype, seed=3)
    pad = [1, 4]
    for t in (z, xbc, dt):
        t[pad] = float("nan")
    padded_slots = torch.tensor([SLOTS[0], -1, SLOTS[1], SLOTS[2], -1, SLOTS[3]], device=DEVICE)
    got = mixer._step_fused(xbc, dt, z, padded_slots, pool.conv[0], pool.ssm[0])
    real = [0, 2, 3, 5]
    want = mixer._step_fused(xbc[real], dt[real], z[real], torch.tensor(SLOTS, device=DEVICE), alone.conv[0],
                             alone.ssm[0])
    assert torch.equal(got[real], want) and not got[pad].any()
    assert torch.equal(_bits(pool._rows), _bits(alone._rows))
    changed = (_bits(pool._rows) != before).any(dim=1).nonzero().flatten().tolist()
    assert sorted(changed) == sorted(SLOTS)


def test_mixer_forward_takes_the_kernels_under_the_triton_backend() -> None:
    """The whole decode forward (in_proj, both kernels, the fused gated norm, out_proj) against the torch path."""
    dtype = torch.float32
    mixer = _mixer(dtype, seed=4)
    mixer.in_proj.weight.data.normal_(0.0, 0.1)
    mixer.out_proj.weight.data.normal_(0.0, 0.1)
    x = torch.randn(len(SLOTS), CONFIG.hidden_size, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    outs = []
    for backend in ("torch", "triton"):
        pool = _pool(dtype)
        states = StateBatch([], [], torch.tensor(SLOTS, device=DEVICE))
        with ops.use_backend(backend):
            outs.append((mixer(x, None, states, pool.conv[0], pool.ssm[0]), pool.ssm[0][SLOTS]))
    _close(outs[1][0], outs[0][0], dtype)
    _close(outs[1][1], outs[0][1], dtype)


def test_kernels_refuse_what_they_cannot_address() -> None:
    mixer = _mixer(torch.float32)
    pool = _pool(torch.float32)
    z, xbc, dt = _inputs(mixer, 2, torch.float32, seed=6)
    with pytest.raises(ValueError, match="slots must be"):
        kernels.conv_update(xbc, pool.conv[0], torch.tensor([0], device=DEVICE), mixer.conv_weight, None)
    with pytest.raises(ValueError, match="float32"):
        kernels.selective_update(xbc.float(), dt, z, pool.ssm[0].half(), torch.tensor([0, 1], device=DEVICE),
                                 mixer.dt_bias, mixer.A_log, mixer.D, 2)


def test_dt_limit_and_other_tiles() -> None:
    """A time-step clamp (which the config reader refuses today, the kernel keeps) and tiles of 4 head rows."""
    mixer = _mixer(torch.float32, seed=7)
    ref, fused = _pool(torch.float32), _pool(torch.float32)
    slots = torch.tensor(SLOTS, device=DEVICE)
    z, xbc, dt = _inputs(mixer, len(SLOTS), torch.float32, seed=8)
    mixer.spec = dataclasses.replace(mixer.spec, time_step_limit=(0.05, 0.5))
    want = mixer._step(xbc, dt, slots, ref.conv[0], ref.ssm[0])
    conv = kernels.conv_update(xbc, fused.conv[0], slots, mixer.conv_weight, mixer.conv_bias)
    got = kernels.selective_update(conv, dt, None, fused.ssm[0], slots, mixer.dt_bias, mixer.A_log, mixer.D, 2,
                                   (0.05, 0.5), block_p=4)
    _close(got, want, torch.float32)
    _close(fused.ssm[0][SLOTS], ref.ssm[0][SLOTS], torch.float32)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_fused_step_replays_from_a_cuda_graph() -> None:
    """Captured once, replayed with other slots and inputs: the same as running it eagerly."""
    dtype = torch.bfloat16
    mixer = _mixer(dtype)
    graph_pool, eager_pool = _pool(dtype), _pool(dtype)
    slots = torch.tensor(SLOTS, device=DEVICE)
    z, xbc, dt = _inputs(mixer, len(SLOTS), dtype, seed=9)
    mixer._step_fused(xbc, dt, z, slots, _pool(dtype).conv[0], _pool(dtype).ssm[0])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mixer._step_fused(xbc, dt, z, slots, graph_pool.conv[0], graph_pool.ssm[0])
    graph_pool.conv[0].copy_(eager_pool.conv[0])
    graph_pool.ssm[0].copy_(eager_pool.ssm[0])
    for step in range(2):
        new = _inputs(mixer, len(SLOTS), dtype, seed=20 + step)
        for t, v in zip((z, xbc, dt), new, strict=True):
            t.copy_(v)
        slots.copy_(slots.flip(0))
        graph.replay()
        want = mixer._step_fused(xbc, dt, z, slots, eager_pool.conv[0], eager_pool.ssm[0])
        assert torch.equal(out, want)
    assert torch.equal(_bits(graph_pool._rows), _bits(eager_pool._rows))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the fused step runs in the engine only on CUDA")
def test_engine_decode_equals_the_torch_step() -> None:
    """dummy Granite-4.0-H (fp32) on CUDA, decode steps in CUDA graphs: with the kernels (``auto``) the same
    sampled tokens (seeded) and log-probabilities as the torch chain (``torch``: every fused op off). The dummy
    weights give near-flat logits, so this checks the wiring (graphs, slots, padding rows); the tests above the
    numerics."""
    from services.contract.sampling_params import SamplingParams
    from services.engine.engine_config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from tests.parity import run_to_completion

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (37, 7, 12)]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5, logprobs=True, ignore_eos=True)
    runs = {}
    for backend in ("auto", "torch"):
        with ops.use_backend(backend):
            engine = LLMEngine(EngineConfig(model="dummy:granite-4.0-h-tiny", device="cuda", dtype="float32",
                                            num_kv_blocks=64, max_num_batched_tokens=64))
            runs[backend] = run_to_completion(engine, prompts, params)[1]
            del engine
    for fused, ref in zip(runs["auto"], runs["torch"], strict=True):
        assert fused.token_ids == ref.token_ids
        assert torch.allclose(torch.tensor(fused.logprobs), torch.tensor(ref.logprobs), atol=1e-3)


_COMPILE_FOR_SM90 = r"""
from services.engine.ops import mamba_decode_triton as m
from tests.sm90_compile import compile_for_sm90 as compile_

conv = dict(X="*bf16", State="*bf16", Slots="*i64", Weight="*bf16", Bias="*bf16", Out="*fp32")
print("conv", compile_(m._conv_update_kernel, conv, dict(D_CONV=4, BLOCK_C=m.CONV_BLOCK, BLOCK_K=4, HAS_BIAS=True,
                                                         SILU=True, PDL=True), None, m.CONV_WARPS))
ssm = dict(XBC="*fp32", Dt="*bf16", Z="*bf16", State="*fp32", Slots="*i64", DtBias="*bf16", ALog="*bf16",
           Dskip="*bf16", Y="*fp32", dt_min="fp32", dt_max="fp32")
for rows in (1, 32):  # Granite-4.0-H-Tiny: 48 heads of 64, d_state 128
    block_p, warps = m.ssm_tile(rows, 48, 64, 128)
    constexprs = dict(BLOCK_P=block_p, BLOCK_D=128, HAS_Z=True, PDL=True)
    print("ssm", rows, compile_(m._selective_update_kernel, ssm, constexprs, None, warps))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills() -> None:
    lines = compile_script_lines(_COMPILE_FOR_SM90)
    assert len(lines) == 3, lines
