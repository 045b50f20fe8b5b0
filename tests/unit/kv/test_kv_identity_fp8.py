"""A worker's KV identity with FP8 KV and a checkpoint's own KV scales: the scales it hashes are the ones its
engine quantizes with (``RankRuntime.kv_scales``), two checkpoints of other scales are refused by name, and the
same checkpoint with an unquantized KV cache hashes as the plain checkpoint always did (scales ignored)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.kv.spec.compat import CompatInfo, KVCompatibilityError, check_compatible
from services.kv.spec.kv_quant import group_scales
from services.kv.spec.layout import LayoutKind
from services.worker.kv_ranks import kv_identity
from tests.checkpoints import make_checkpoint
from tests.fp8_checkpoints import Fp8Options, fp8_checkpoint
from tests.unit.kv.test_kv_compat_recorded import RECORDED


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Llama FP8 checkpoints storing per-layer KV scales, drawn from two seeds."""
    plain = make_checkpoint("llama", tmp_path_factory.mktemp("llama"))[0]
    return {seed: fp8_checkpoint(plain, tmp_path_factory.mktemp(f"fp8-{seed}"),
                                 Fp8Options("fp8", kv_scales=True, seed=seed))[0] for seed in (0, 1)}


def _engine(checkpoint: Path, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", block_size=16,
                                  num_kv_blocks=16, kv_layout=LayoutKind.CROSS_LAYER, kv_cache_dtype=kv_cache_dtype))


def test_the_hashed_scales_are_the_engine_s(scaled: dict[int, Path]) -> None:
    engine = _engine(scaled[0], "fp8_e4m3")
    info = CompatInfo.of_identity(kv_identity(engine))
    scales = dict(enumerate(engine.runtime.kv_scales.layers))
    assert any(pair != (1.0, 1.0) for pair in scales.values())  # the checkpoint's, not the default
    assert group_scales(info.fields) == [scales]
    other = CompatInfo.of_identity(kv_identity(_engine(scaled[1], "fp8_e4m3")))
    with pytest.raises(KVCompatibilityError, match=r"KV group 0 \(full\): kv_scales local sha:\w+ vs remote sha:"):
        check_compatible(info, other.fields, other.hash)


def test_an_unquantized_kv_cache_ignores_the_checkpoint_scales(scaled: dict[int, Path]) -> None:
    info = CompatInfo.of_identity(kv_identity(_engine(scaled[0], "auto")))
    assert info.fields["dtype"] == "float32" and group_scales(info.fields) == [None]
    assert info.hash == RECORDED["llama", "cross_layer", True]  # as the plain checkpoint's engines always hashed
