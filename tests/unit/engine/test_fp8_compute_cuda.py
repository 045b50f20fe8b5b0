"""FP8 compute on CUDA (``PDSERVE_TEST_DEVICE=cuda``; skipped elsewhere, as ``test_fp8_gemm.py``'s CUDA cases).

On a dummy FP8 preset (``dummy:qwen3-0.6b-fp8``: Qwen3-0.6B's shapes, 128 x 128 blocks, every projection whole
blocks) and on a small FP8 checkpoint (``tests/fp8_checkpoints.py``, [32, 32] blocks), ``auto`` keeps the FP8
weights (the projections' bytes half of bf16's) and captures decode graphs; on the checkpoint, in float32,
decode through the graphs gives the eager path's tokens (in bf16 a graph's padded rows change cuBLAS's rounding
of the bf16 parts, as ``test_cuda_graphs.py`` measures, and a dummy model's flat logits tip on any change of
summation order, such as attention's split over a graph's context bucket). The FP8 engine follows the
dequantized bf16 engine's greedy tokens (how far is printed; on the checkpoint at least one token a prompt on
average: e4m3 activations tip near-ties, on CPU too), and the CUDA kernels in the engine follow the exact CPU
reference (float32, ``quantization="fp8"`` on CPU) for most of each prompt's tokens: Hopper's FP8 MMAs sum a
K slab with fewer bits than fp32, so a random model's near-ties tip later on.
"""

from __future__ import annotations

import os

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.models.fp8_linear import Fp8Linear
from tests.checkpoints import make_checkpoint
from tests.fp8_checkpoints import Fp8Options, fp8_checkpoint
from tests.parity import run_to_completion

pytestmark = pytest.mark.skipif(
    os.environ.get("PDSERVE_TEST_DEVICE") != "cuda" or not torch.cuda.is_available()
    or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 compute needs PDSERVE_TEST_DEVICE=cuda and a GPU of compute capability 8.9+")

NUM_TOKENS = 24
PROMPTS = [[(17 * i + 31 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((7, 23, 40, 64))]
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def _engine(model: str, quantization: str = "auto", device: str = "cuda", dtype: str = "bfloat16") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, quantization=quantization,
                                  num_kv_blocks=256, max_num_seqs=8, enable_prefix_caching=False))


def _tokens(engine: LLMEngine) -> list[list[int]]:
    _, outputs = run_to_completion(engine, PROMPTS, GREEDY)
    return [out.token_ids for out in outputs]


def _layer_bytes(engine: LLMEngine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.model.layers.parameters())


def _agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt, the tokens until the first difference."""
    return [next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), len(s)) for s, t in zip(a, b,
                                                                                                          strict=True)]


def _graphs_equal_eager(engine: LLMEngine) -> list[list[int]]:
    graphed = _tokens(engine)
    graphs, engine.runner.decode_graphs = engine.runner.decode_graphs, None
    try:
        assert _tokens(engine) == graphed, "decode through the CUDA graphs differs from eager"
    finally:
        engine.runner.decode_graphs = graphs
    return graphed


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("fp8")
    plain, _ = make_checkpoint("llama", root / "plain")
    directory, _ = fp8_checkpoint(plain, root / "fp8", Fp8Options("fp8", block_size=(32, 32)))
    return str(directory)


@pytest.mark.parametrize("model", ["dummy:qwen3-0.6b-fp8", "small"])
def test_fp8_engine_on_cuda(model: str, small_checkpoint: str) -> None:
    model = small_checkpoint if model == "small" else model
    dense = _engine(model, "none")
    dense_bytes, dense_tokens = _layer_bytes(dense), _tokens(dense)
    dense.close()
    fp8 = _engine(model)
    kept = [m for m in fp8.model.modules() if isinstance(m, Fp8Linear)]
    assert kept and all(m.weight.dtype == torch.float8_e4m3fn for m in kept)
    ratio = _layer_bytes(fp8) / dense_bytes
    assert 0.5 <= ratio < 0.53, f"FP8 layers are {ratio:.3f} of the bf16 layers' bytes"
    assert fp8.runner.decode_graphs is not None, "an FP8 model must be capturable"
    tokens = _tokens(fp8)
    fp8.close()
    if model == small_checkpoint:  # peaked logits: a dummy model's flat ones tip on any change of summation order
        fp32 = _engine(model, dtype="float32")
        _graphs_equal_eager(fp32)
        fp32.close()
    agree = _agreement(tokens, dense_tokens)
    print(f"{model}: FP8 layers {ratio:.3f} of bf16's bytes; greedy tokens equal to the dequantized bf16 engine's "
          f"for {agree} of {NUM_TOKENS}")
    if model == small_checkpoint:  # peaked logits (dummy weights' are flat: there the count is only printed)
        assert sum(agree) >= len(PROMPTS), "FP8 greedy tokens leave the dequantized engine's at once"


def test_cuda_kernels_match_the_cpu_reference(small_checkpoint: str) -> None:
    """float32 on both: the CUDA FP8 path (Triton group quantization and GEMM) against the torch reference."""
    cpu = _tokens(_engine(small_checkpoint, "fp8", device="cpu", dtype="float32"))
    cuda_engine = _engine(small_checkpoint, "fp8", dtype="float32")
    cuda = _tokens(cuda_engine)
    cuda_engine.close()
    agree = _agreement(cuda, cpu)
    print(f"CUDA FP8 float32 vs the CPU reference: equal for {agree} of {NUM_TOKENS} tokens")
    assert min(agree) >= 4 and sum(agree) >= len(PROMPTS) * NUM_TOKENS // 2, agree
