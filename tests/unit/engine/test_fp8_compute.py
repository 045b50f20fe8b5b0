"""FP8 checkpoints computed in FP8 (``quantization="fp8"``): e4m3 weights kept, activations quantized on the fly.

The reference is transformers on the weights dequantized by ``tests/fp8_checkpoints.py``, with a forward pre-hook
on each projection pdserve runs in FP8 that rounds the projection's input through e4m3 the way the checkpoint's
format says (per 1 x ``block[1]`` group of a row for block scales, per token row otherwise), written here
independently of pdserve. pdserve (CPU, float32, the torch reference of ``ops.fp8_gemm``) must give HF's greedy
tokens and logits within ``REL_TOL``; without the hooks HF's logits differ by more than that
(``test_activation_quantization_matters``), so the comparison sees the FP8 activations.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.models.fp8_linear import Fp8Linear
from services.engine.models.layers import Linear
from services.engine.parallel import ParallelConfig
from services.engine.start import start_engine
from tests.checkpoints import make_checkpoint
from tests.fp8_checkpoints import Fp8Options, fp8_checkpoint
from tests.parity import Reference, assert_matches, reference_of, run_to_completion

NUM_TOKENS = 10
PROMPT_LENS = (5, 19, 30)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
# float32 throughout; an e4m3 rounding of an activation tipped by a float32 ulp upstream moves a logit by ~1e-5.
REL_TOL = 5e-4
E4M3_MAX = 448.0

# The projections pdserve computes in FP8, as HF names them (the rest: embeddings, head, norms, router, DeepSeek's
# kv_b_proj and routed experts, are dequantized).
LLAMA_FP8 = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
DEEPSEEK_FP8 = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.shared_experts.gate_proj",
                "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")


def e4m3_round_trip(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """``x`` rounded through e4m3 with one scale (absolute max / 448) per ``group`` columns of each row, or per
    row when ``group`` is None; a last, shorter group has its own scale."""
    flat = x.reshape(-1, x.shape[-1]).float()
    cols = flat.shape[1]
    width = cols if group is None else group
    out = torch.empty_like(flat)
    for start in range(0, cols, width):
        chunk = flat[:, start: start + width]
        scale = (chunk.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
        out[:, start: start + width] = (chunk / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() \
            * scale
    return out.view(x.shape).to(x.dtype)


def hook_fp8_inputs(hf, modules: list[str], group: int | None) -> list:
    """Forward pre-hooks on HF's ``modules`` rounding their input through e4m3; the handles."""
    def hook(_module, args):
        return (e4m3_round_trip(args[0], group), *args[1:])

    return [hf.get_submodule(name).register_forward_pre_hook(hook) for name in modules]


def fp8_modules(hf, suffixes: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[str]:
    """HF's nn.Linear modules ending in one of ``suffixes`` (minus ``skip``)."""
    return [name for name, module in hf.named_modules() if isinstance(module, torch.nn.Linear)
            and name.endswith(suffixes) and not any(name.endswith(s) for s in skip)]


def activation_group(options: Fp8Options) -> int | None:
    if options.fmt == "fbgemm_fp8" or options.block_size is None:
        return None
    return options.block_size[1] if options.fmt == "fp8" or options.strategy == "block" else None


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plain")
    return {arch: make_checkpoint(arch, root / arch)[0] for arch in ("llama", "deepseek_v3")}


def _checkpoint(plain, tmp_path, arch, options):
    return fp8_checkpoint(plain[arch], tmp_path / "fp8", options)


def _reference(directory: Path, hf) -> Reference:
    return reference_of(directory, hf, PROMPT_LENS, NUM_TOKENS, seed=5, shared_from=0, shared_len=4)


def _engine(directory: Path, quantization: str = "fp8", **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", dtype="float32", block_size=4,
                                  num_kv_blocks=128, quantization=quantization, **config))


def _fp8_reference(plain, tmp_path, arch, options, skip=()) -> tuple[Reference, list[str]]:
    directory, hf = _checkpoint(plain, tmp_path, arch, options)
    modules = fp8_modules(hf, LLAMA_FP8 if arch == "llama" else DEEPSEEK_FP8, skip)
    hook_fp8_inputs(hf, modules, activation_group(options))
    return _reference(directory, hf), modules


CASES = {
    # [16, 16] and [32, 32] blocks divide every fused part (q 64, kv 32, gate/up 128 rows).
    "llama-blocks16": ("llama", Fp8Options("fp8", block_size=(16, 16))),
    "llama-blocks32": ("llama", Fp8Options("fp8", block_size=(32, 32))),
    "llama-channel": ("llama", Fp8Options("fbgemm_fp8")),
    "llama-ct-channel": ("llama", Fp8Options("compressed-tensors", strategy="channel")),
    "llama-tensor": ("llama", Fp8Options("fp8", block_size=None)),
    "llama-ct-tensor": ("llama", Fp8Options("compressed-tensors", strategy="tensor")),
    # MLA projections (the rope rows reordered inside their blocks) and the shared experts in FP8; kv_b and the
    # routed experts dequantized. kv_a_proj_with_mqa's 40 rows end in a ragged block.
    "deepseek_v3-blocks16": ("deepseek_v3", Fp8Options("fp8", block_size=(16, 16))),
    "deepseek_v3-ct-channel": ("deepseek_v3", Fp8Options("compressed-tensors", strategy="channel")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_compute_matches_hf_with_fp8_activations(plain, tmp_path, case: str) -> None:
    arch, options = CASES[case]
    ref, _ = _fp8_reference(plain, tmp_path, arch, options)
    engine = _engine(Path(ref.checkpoint))
    model = engine.runtime.model
    kept = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert kept and all(m.weight.dtype == torch.float8_e4m3fn for m in kept)
    if arch == "llama":
        assert len(kept) == 4 * model.config.num_layers  # qkv, o, gate_up, down of every layer
    _, outputs = run_to_completion(engine, ref.prompts, GREEDY)
    assert_matches(ref.tokens, ref.logits, outputs, rel_tol=REL_TOL)


def test_blocks_not_dividing_fused_parts_fall_back(plain, tmp_path) -> None:
    """[48, 16] blocks: q (64 rows) and gate/up (128 each) are not whole blocks, so qkv_proj and gate_up_proj are
    dequantized ``Linear``s and their inputs are not rounded; o_proj and down_proj (one part each, a ragged last
    block row) stay FP8. The reference hooks o/down only and must match; hooking q/k/v/gate/up as well must not."""
    options = Fp8Options("fp8", block_size=(48, 16))
    ref, _ = _fp8_reference(plain, tmp_path, "llama", options,
                            skip=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    engine = _engine(Path(ref.checkpoint))
    layer = engine.runtime.model.layers[0]
    assert type(layer.self_attn.qkv_proj) is Linear and type(layer.mlp.gate_up_proj) is Linear
    assert isinstance(layer.self_attn.o_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    _, outputs = run_to_completion(engine, ref.prompts, GREEDY)
    assert_matches(ref.tokens, ref.logits, outputs, rel_tol=REL_TOL)
    all_hooked, _ = _fp8_reference(plain, tmp_path / "all", "llama", options)
    assert _max_rel(all_hooked.logits, ref.logits) > REL_TOL


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


def test_activation_quantization_matters(plain, tmp_path) -> None:
    """Without the hooks (the dequantized model, what ``none`` computes) HF's logits are further from the FP8
    reference than the tolerance: the parity above sees FP8 activations, not just FP8 weights."""
    for arch, options in (("llama", Fp8Options("fp8", block_size=(16, 16))), ("llama", Fp8Options("fbgemm_fp8")),
                          ("deepseek_v3", Fp8Options("fp8", block_size=(16, 16)))):
        directory, hf = _checkpoint(plain, tmp_path / f"{arch}-{options.fmt}", arch, options)
        plain_ref = _reference(directory, hf)
        hook_fp8_inputs(hf, fp8_modules(hf, LLAMA_FP8 if arch == "llama" else DEEPSEEK_FP8),
                        activation_group(options))
        hooked = _reference(directory, hf)
        assert _max_rel(hooked.logits, plain_ref.logits) > 10 * REL_TOL, (arch, options.fmt)


def test_auto_on_cpu_dequantizes(plain, tmp_path) -> None:
    """``auto`` on CPU is ``none``: every projection a dequantized ``Linear``, HF's unhooked tokens and logits."""
    directory, hf = _checkpoint(plain, tmp_path, "llama", Fp8Options("fp8", block_size=(16, 16)))
    ref = _reference(directory, hf)
    for quantization in ("auto", "none"):
        engine = _engine(directory, quantization)
        assert not any(isinstance(m, Fp8Linear) for m in engine.runtime.model.modules())
        _, outputs = run_to_completion(engine, ref.prompts, GREEDY)
        assert_matches(ref.tokens, ref.logits, outputs)


def test_tensor_parallel_fp8(plain, tmp_path) -> None:
    """TP 2, [16, 16] blocks: each rank keeps whole blocks of its q/k/v and gate/up rows and of o/down's
    columns, and its shard of the scale grids."""
    ref, _ = _fp8_reference(plain, tmp_path, "llama", Fp8Options("fp8", block_size=(16, 16)))
    config = EngineConfig(model=ref.checkpoint, device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
                          parallel=ParallelConfig(2, 0), quantization="fp8")
    engine = start_engine(config, ["cpu", "cpu"])
    try:
        assert isinstance(engine.runtime.model.layers[0].mlp.down_proj, Fp8Linear)
        _, outputs = run_to_completion(engine, ref.prompts, GREEDY)
        assert_matches(ref.tokens, ref.logits, outputs, rel_tol=REL_TOL)
    finally:
        engine.close()


def test_dummy_fp8_preset_holds_the_quantized_dummy_weights() -> None:
    """``dummy:tiny-fp8`` in FP8: e4m3 weights whose dequantized values are what ``none`` loads (the same dummy
    tensors, quantized per 16 x 16 block at load), so the two differ by FP8 rounding alone."""
    fp8 = LLMEngine(EngineConfig(model="dummy:tiny-fp8", device="cpu", dtype="float32", num_kv_blocks=16,
                                 quantization="fp8")).runtime.model
    plain = LLMEngine(EngineConfig(model="dummy:tiny-fp8", device="cpu", dtype="float32", num_kv_blocks=16,
                                   quantization="none")).runtime.model
    for path in ("layers.0.self_attn.qkv_proj", "layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"):
        kept, dense = fp8.get_submodule(path), plain.get_submodule(path)
        assert isinstance(kept, Fp8Linear) and kept.block == (16, 16)
        rows, cols = kept.weight.shape
        scales = kept.weight_scale.repeat_interleave(16, 0)[:rows].repeat_interleave(16, 1)[:, :cols]
        torch.testing.assert_close(kept.weight.float() * scales, dense.weight, rtol=0, atol=0)
    assert math.isclose(sum(p.numel() * p.element_size() for p in fp8.layers.parameters())
                        / sum(p.numel() * p.element_size() for p in plain.layers.parameters()), 0.25, rel_tol=0.05)


def test_fp8_on_a_checkpoint_without_fp8_is_refused() -> None:
    with pytest.raises(ValueError, match="no FP8 quantization_config"):
        LLMEngine(EngineConfig(model="dummy:tiny", device="cpu", dtype="float32", num_kv_blocks=16,
                               quantization="fp8"))
