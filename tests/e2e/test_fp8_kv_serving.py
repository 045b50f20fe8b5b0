"""End to end with FP8 KV: router + prefill + decode processes, both workers ``--kv-cache-dtype fp8_e4m3``.

The checkpoint is an FP8 one (compressed-tensors) whose per-layer KV scales are not 1.0, so the scales are read
from it and must agree across the handshake. Greedy completions through the disaggregated stack equal one
colocated engine with the same FP8 KV cache; every request's KV is pulled (none recomputed on the decode
worker); and the bytes pulled for the same prompts are a quarter of a float32-KV stack's and half of a bfloat16
one's (the scales travel once, in the handshake, not per pull), each control run beside it here, on the same
checkpoint, layouts and block sizes. The float32 control's tokens equal the colocated float32 engine's and differ
from the FP8 run's: the transfer is exact without FP8, and FP8 KV changes what is computed (drift of FP8 kernels
is told apart from a transfer error).
"""

from __future__ import annotations

import random

import pytest

from tests.checkpoints import ColocatedReference, make_checkpoint
from tests.e2e.stack import DECODE_ARGS, PREFILL_ARGS, completion_tokens, info, pull_totals, stack
from tests.fp8_checkpoints import Fp8Options, fp8_checkpoint

MAX_TOKENS = 8
FP8 = ("--kv-cache-dtype", "fp8_e4m3")
BF16 = ("--dtype", "bfloat16")  # the CPU path runs bfloat16 (its KV follows the model dtype)


def _after(args: tuple[str, ...], extra: tuple[str, ...]) -> tuple[str, ...]:
    """The stack's worker arguments with ``extra`` (a later ``--dtype`` wins over the stack's float32)."""
    return (*args, *extra)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("llama")
    plain, _ = make_checkpoint("llama", root / "plain")
    directory, _ = fp8_checkpoint(plain, root / "fp8", Fp8Options("compressed-tensors", kv_scales=True))
    return str(directory)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Distinct prompts of several blocks each (no shared prefix: the decode worker's cache holds none of them)."""
    rng = random.Random(48)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(17, 41))] for _ in range(6)]


def _serve(model: str, prompts: list[list[int]], extra: tuple[str, ...]) -> tuple[list[list[int]], dict[str, float]]:
    """Each prompt's greedy tokens through a fresh stack whose workers add ``extra``, and what its decode worker
    pulled for them."""
    with stack(model, prefill_args=_after(PREFILL_ARGS, extra), decode_args=_after(DECODE_ARGS, extra)) as s:
        before = pull_totals(s.decode[0])
        tokens = [completion_tokens(s.url, p, MAX_TOKENS, stream=bool(i % 2)) for i, p in enumerate(prompts)]
        after = pull_totals(s.decode[0])
        assert info(s.prefill[0]).kv_blocks_pinned == 0  # every ticket was read and released
        return tokens, {k: after[k] - before[k] for k in after}


def test_fp8_kv_disaggregated_equals_colocated_and_pulls_a_quarter_of_float32(model: str,
                                                                             prompts: list[list[int]]) -> None:
    reference = ColocatedReference(model, kv_cache_dtype="fp8_e4m3")
    assert reference.engine.kv_layout.dtype == "float8_e4m3fn"
    assert any(pair != (1.0, 1.0) for pair in reference.engine.runtime.kv_scales.layers), "the checkpoint's scales"
    colocated = reference.many(prompts, MAX_TOKENS)
    del reference
    colocated_f32 = ColocatedReference(model).many(prompts, MAX_TOKENS)

    fp8_tokens, fp8 = _serve(model, prompts, FP8)
    assert fp8_tokens == colocated
    assert fp8["pulls"] == len(prompts) and fp8["recomputed"] == 0  # every request's KV came over the wire

    f32_tokens, f32 = _serve(model, prompts, ())
    assert f32_tokens == colocated_f32 and f32_tokens != fp8_tokens  # the control: exact, and not FP8's
    _, bf16 = _serve(model, prompts, BF16)
    for control in (f32, bf16):
        assert control["pulls"] == len(prompts) and control["recomputed"] == 0
    assert fp8["bytes"] > 0 and fp8["bytes"] * 4 == f32["bytes"] and fp8["bytes"] * 2 == bf16["bytes"], (
        fp8, f32, bf16)
