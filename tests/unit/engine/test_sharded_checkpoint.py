"""A checkpoint saved in several safetensors shards (with its index) loads to the same model."""

from __future__ import annotations

import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.loading.weights import safetensors_files
from tests.checkpoints import make_checkpoint


def test_sharded_equals_single_file(tmp_path) -> None:
    single, hf = make_checkpoint("llama", tmp_path / "single")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(safetensors_files(sharded)) > 2

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, return_logits=True)
    prompt = list(range(5, 30))
    outs = [
        LLMEngine(EngineConfig(model=str(d), device="cpu", dtype="float32")).generate([prompt], params)[0]
        for d in (single, sharded)
    ]
    assert outs[0].token_ids == outs[1].token_ids
    for (s0, l0), (s1, l1) in zip(outs[0].logits, outs[1].logits, strict=True):
        assert s0 == s1 and torch.equal(l0, l1)
