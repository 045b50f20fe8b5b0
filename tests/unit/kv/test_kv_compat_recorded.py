"""The compatibility hash of real engines, against values recorded before the KV library moved into its
sub-packages: a refactoring that changes what a hash covers (a field renamed, a group serialised otherwise, a
default moved) would make every deployed pair refuse a peer of the previous release. The engines are small
random checkpoints of each KV shape pdserve serves: full attention, a sliding window, Gemma-4's per-group heads
and KV sharing, DeepSeek's MLA rows, Granite's Mamba2 state; in both block orders, with and without the digest.
FP8 KV (``--kv-cache-dtype fp8_e4m3``) adds its groups' dtype, scale scheme and scales (``spec/kv_quant.py``) and
has hashes of its own, recorded when it was added; every other engine's stayed as they were.

A hash here may change only with a protocol change that says so in ``proto/pdserve/v1/kv.proto``'s changelog."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.kv.spec.compat import CompatInfo
from services.kv.spec.layout import LayoutKind
from services.worker.kv_ranks import kv_identity
from tests.checkpoints import make_checkpoint
from tests.unit.engine.test_granite_hybrid import make_granite_checkpoint

# (family, layout kind, digest on) -> compat hash, recorded at commit 0484199 (before the move).
RECORDED: dict[tuple[str, str, bool], str] = {
    ("llama", "cross_layer", True): "eb5c84a0fc59dd7cccfe709c66f1d21bc681baaeaa617eb18e186129d1eb1f48",
    ("llama", "cross_layer", False): "4a4d8276573a51c9bc27114bb1ae3e4566c653153120697d514728801be24c3e",
    ("llama", "per_layer", True): "eb5c84a0fc59dd7cccfe709c66f1d21bc681baaeaa617eb18e186129d1eb1f48",
    ("llama", "heads_outer", True): "ade4fb288a91e892faad7c8e5c7f4cd494d151d324032a4ce906a9fff973a1c3",
    ("llama", "heads_outer", False): "ed1b7eecf4ca41852ebed0ae602e8400f6374dcc7b1086625ea793a5cfa934ea",
    ("mistral", "cross_layer", True): "32dd157056bf171a57fd4e614210d4eff600ab5d738340b1ca64db9b438315a1",
    ("mistral", "heads_outer", True): "0d51b3af1193fa6336135ad3d1ad5b93de07faea40129e99cb9075477af2992a",
    ("gemma4", "cross_layer", True): "c67acd491ca56f85d29f84cdb5cdda18008ec5e71188c015c16093eb76b75bec",
    ("gemma4", "heads_outer", True): "473b76f2844d5c3a1e72b021f9761481fb25998e8fd5871670a7372bd4d037df",
    ("deepseek_v3", "cross_layer", True): "a712193f3910ea2f90b75acdca1c1a07bee703a4a767f1c0491a43be0762324f",
    ("deepseek_v3", "heads_outer", True): "33870f07f23c11f1ac6f99b9f5a0174489a6a207de3dbf233752d631b5e145d5",
    ("granite", "cross_layer", True): "6b80d88b8a9a2503af8fb070ed0b33685bb06b6a7409bd9e2731f325850b82b9",
    ("granite", "heads_outer", True): "db8bf1d771ddd72d70f8b17cd24799dfbc489b0a6707e9fe921d340dae1df8ae",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    made = {arch: make_checkpoint(arch, tmp_path_factory.mktemp(arch))[0]
            for arch in ("llama", "mistral", "gemma4", "deepseek_v3")}
    made["granite"] = make_granite_checkpoint("rope", tmp_path_factory.mktemp("granite"))[0]
    return made


# (family, layout kind) -> the compat hash of an FP8 KV engine (scales 1.0: the checkpoints store none), with the
# digest; recorded when FP8 KV was added (kv.proto's changelog).
RECORDED_FP8: dict[tuple[str, str], str] = {
    ("llama", "cross_layer"): "ad9438ff7a65838cb2e146a338b88b73a093310a40ef263f17f98314b61c24af",
    ("deepseek_v3", "cross_layer"): "d763acf80cbf7b7774973b29e6377d77dbcb8f006fff9aba5ad87cff67f66066",
}


def _hash(checkpoint: Path, layout: str, digest: bool, kv_cache_dtype: str = "auto") -> CompatInfo:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32",
                                    kv_layout=LayoutKind(layout), block_size=16, num_kv_blocks=16,
                                    kv_cache_dtype=kv_cache_dtype))
    return CompatInfo.of_identity(kv_identity(engine, kv_digest=digest))


@pytest.mark.parametrize(("family", "layout", "digest"), list(RECORDED))
def test_the_compat_hash_is_the_recorded_one(checkpoints: dict[str, Path], family: str, layout: str,
                                             digest: bool) -> None:
    info = _hash(checkpoints[family], layout, digest)
    assert info.hash == RECORDED[family, layout, digest], info.fields


@pytest.mark.parametrize(("family", "layout"), list(RECORDED_FP8))
def test_an_fp8_kv_engine_hashes_as_recorded(checkpoints: dict[str, Path], family: str, layout: str) -> None:
    info = _hash(checkpoints[family], layout, True, kv_cache_dtype="fp8_e4m3")
    assert info.fields["dtype"] == "float8_e4m3fn"
    assert info.hash == RECORDED_FP8[family, layout], info.fields
