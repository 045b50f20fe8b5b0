"""FP8 checkpoints (fp8 blocks, compressed-tensors float-quantized, fbgemm_fp8), dequantized at load.

The reference is transformers on the weights dequantized by ``tests/fp8_checkpoints.py``'s own code; pdserve
loads the FP8 checkpoint itself (3 shards, weights and scales split between them) on CPU in float32. Its
greedy tokens must be HF's and its logits within 1e-4: the dequantized weights are bitwise those of the
reference, so any scale read wrong, misplaced or dropped shows (``test_scales_change_the_model`` checks
that they would).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.loading.source import resolve_model
from services.engine.parallel import ParallelConfig
from services.engine.start import start_engine
from tests.checkpoints import make_checkpoint
from tests.fp8_checkpoints import FORMATS, Fp8Options, expand_scale, fp8_checkpoint, read_tensors, reference_model
from tests.parity import Reference, assert_matches, hf_greedy, reference_of, run_to_completion
from tests.unit.engine.test_granite_hybrid import make_granite_checkpoint

NUM_TOKENS = 12
PROMPT_LENS = (5, 19, 30)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
REPO_ROOT = Path(__file__).resolve().parents[3]
# Modules some checkpoints leave in float32, listed in the config's skip list (DeepSeek's: one routed expert
# of a layer whose other experts are FP8, stacked together on load).
KEPT = {"llama": ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"),
        "deepseek_v3": ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.experts.2.up_proj")}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict[str, Path]:
    """One plain random checkpoint per architecture, quantized by each test its own way."""
    root = tmp_path_factory.mktemp("plain")
    out = {arch: make_checkpoint(arch, root / arch)[0] for arch in ("llama", "deepseek_v3")}
    out["granite"] = make_granite_checkpoint("moe", root / "granite")[0]
    return out


def _reference(plain: dict[str, Path], tmp_path: Path, arch: str, options: Fp8Options) -> Reference:
    directory, hf = fp8_checkpoint(plain[arch], tmp_path / "fp8", options)
    return reference_of(directory, hf, PROMPT_LENS, NUM_TOKENS, seed=5, shared_from=0, shared_len=4)


def _engine_matches(ref: Reference, **config) -> None:
    engine = LLMEngine(EngineConfig(model=ref.checkpoint, device="cpu", dtype="float32", block_size=4,
                                    num_kv_blocks=128, **config))
    _, outputs = run_to_completion(engine, ref.prompts, GREEDY)
    assert_matches(ref.tokens, ref.logits, outputs)


CASES = {
    # [16, 16] blocks: DeepSeek's kv_a_proj_with_mqa has 40 rows (ragged last block row).
    **{f"{arch}-{fmt}": (arch, Fp8Options(fmt)) for arch in ("llama", "deepseek_v3") for fmt in FORMATS},
    # Skip lists honoured (fbgemm's names, compressed-tensors' re: entries), KV scales taken out of the weights.
    "llama-fbgemm_fp8": ("llama", Fp8Options("fbgemm_fp8", keep=KEPT["llama"])),
    "llama-compressed-tensors": ("llama", Fp8Options("compressed-tensors", keep=KEPT["llama"], kv_scales=True)),
    "deepseek_v3-fp8": ("deepseek_v3", Fp8Options("fp8", keep=KEPT["deepseek_v3"])),
    # Every quantized dimension of the model (32 .. 128) within one 128 x 128 block: a 1 x 1 grid mostly.
    "deepseek_v3-fp8-block128": ("deepseek_v3", Fp8Options("fp8", block_size=(128, 128))),
    "llama-fp8-per-tensor": ("llama", Fp8Options("fp8", block_size=None)),
    "llama-ct-tensor": ("llama", Fp8Options("compressed-tensors", strategy="tensor")),
    # compressed-tensors' block strategy with blocks dividing no dimension (64, 128, 32).
    "llama-ct-block": ("llama", Fp8Options("compressed-tensors", strategy="block", block_size=(24, 40))),
    # Granite-4.0-H: Mamba in/out projections, stacked 3-D experts ([8, 64, 64] with a block grid per expert).
    "granite-fp8": ("granite", Fp8Options("fp8")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_hf_on_dequantized_weights(plain, tmp_path, case: str) -> None:
    arch, options = CASES[case]
    _engine_matches(_reference(plain, tmp_path, arch, options))


def test_checkpoints_are_what_they_claim(plain, tmp_path) -> None:
    """The test checkpoints really are FP8, sharded with weight and scale apart, kept modules float32,
    ragged blocks where claimed."""
    directory, _ = fp8_checkpoint(plain["deepseek_v3"], tmp_path / "ds", Fp8Options("fp8", keep=KEPT["deepseek_v3"]))
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = read_tensors(directory)
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    assert tensors[f"{kv_a}.weight"].dtype == torch.float8_e4m3fn and tensors[f"{kv_a}.weight"].shape[0] % 16
    assert tuple(tensors[f"{kv_a}.weight_scale_inv"].shape) == (3, 4)
    assert index[f"{kv_a}.weight"] != index[f"{kv_a}.weight_scale_inv"]
    assert tensors["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    for module in KEPT["deepseek_v3"]:
        assert tensors[f"{module}.weight"].dtype == torch.float32 and f"{module}.weight_scale_inv" not in tensors
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert tensors[name].dtype == torch.float32


def test_scales_change_the_model(plain, tmp_path) -> None:
    """Dropping the scales, or shifting the block grid by one block, moves the logits far past the 1e-4 the
    parity checks allow: a loader that got the scales wrong could not pass them."""
    options = Fp8Options("fp8")
    directory, hf = fp8_checkpoint(plain["deepseek_v3"], tmp_path / "ds", options)
    config = json.loads((plain["deepseek_v3"] / "config.json").read_text())
    stored = read_tensors(directory)
    scales = {n.removesuffix("_scale_inv"): s for n, s in stored.items() if n.endswith("_scale_inv")}
    assert all(s.numel() == 1 or s.std() / s.mean() > 0.1 for s in scales.values())  # non-uniform grids
    prompt = torch.tensor([list(range(7, 40))])
    with torch.no_grad():
        expected = hf(prompt).logits
        for wrong in ("unscaled", "shifted"):
            weights = {n: t for n, t in stored.items() if not n.endswith("_scale_inv")}
            for name, scale in scales.items():
                grid = torch.ones_like(scale) if wrong == "unscaled" else scale.roll(1, dims=-1)
                weights[name] = stored[name].float() * expand_scale(grid, stored[name].shape, options)
            got = reference_model(config, weights, tmp_path / wrong)(prompt).logits
            assert (got - expected).abs().max() / expected.abs().max() > 1e-2, wrong


def test_kv_scales_are_read_and_kept_from_the_model(plain, tmp_path) -> None:
    directory, _ = fp8_checkpoint(plain["llama"], tmp_path / "kv", Fp8Options("compressed-tensors", kv_scales=True))
    tensors = read_tensors(directory)
    source = resolve_model(str(directory))
    assert source.quantization is not None and source.quantization.kv_cache_scheme
    assert source.kv_scales == {
        0: (tensors["model.layers.0.self_attn.k_scale"].item(), tensors["model.layers.0.self_attn.v_scale"].item()),
        1: (tensors["model.layers.1.self_attn.k_proj.output_scale"].item(),
            tensors["model.layers.1.self_attn.v_proj.output_scale"].item()),
    }
    assert not any("scale" in name for name, _ in source.weights())


def test_tensor_parallel_matches_hf(plain, tmp_path) -> None:
    """TP 2 on DeepSeek-V3 in fp8 blocks: each rank dequantizes the full weights, then takes its shard."""
    ref = _reference(plain, tmp_path, "deepseek_v3", Fp8Options("fp8"))
    config = EngineConfig(model=ref.checkpoint, device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
                          parallel=ParallelConfig(2, 0))
    engine = start_engine(config, ["cpu", "cpu"])
    try:
        _, outputs = run_to_completion(engine, ref.prompts, GREEDY)
        assert_matches(ref.tokens, ref.logits, outputs)
    finally:
        engine.close()


def _word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A tokenizer.json whose token i is the text ``<i>``: the CLI's printed text spells the token ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\d+>"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(directory / "tokenizer.json"))


def test_cli_generate_prints_hf_tokens(plain, tmp_path) -> None:
    """``pdserve generate`` on each format, dense and DeepSeek-V3 ([16, 16] blocks: DeepSeek's 40-row kv_a
    projection ends in a partial block), prints HF's greedy tokens on the dequantized weights. The six runs are
    processes of their own, started together."""
    prompt = [11, 200, 31, 7, 150, 99]
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "PYTHONPATH": str(REPO_ROOT)}
    runs = {}
    for arch in ("llama", "deepseek_v3"):
        for fmt in FORMATS:
            directory, hf = fp8_checkpoint(plain[arch], tmp_path / f"cli-{arch}-{fmt}", Fp8Options(fmt))
            _word_tokenizer(directory, hf.config.vocab_size)
            config = json.loads((directory / "config.json").read_text())
            (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))  # no early stop
            (tokens,), _ = hf_greedy(hf, [prompt], NUM_TOKENS)
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "generate", "--model", str(directory), "--device", "cpu",
                 "--dtype", "float32", "--prompt", "".join(f"<{t}>" for t in prompt), "--max-tokens",
                 str(NUM_TOKENS), "--temperature", "0"],
                cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            runs[arch, fmt] = (proc, tokens)
    for (arch, fmt), (proc, tokens) in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{arch} {fmt}: {err[-2000:]}"
        assert [int(t) for t in re.findall(r"<(\d+)>", out)] == tokens, f"{arch} {fmt}"
