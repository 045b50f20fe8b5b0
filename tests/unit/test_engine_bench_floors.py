"""bench/floors.py: the engine bench's floors count active experts, attention layers only, MLA rows and state."""

from __future__ import annotations

import pytest

from bench.floors import active_parameters, decode_floor_bytes, kv_bytes_per_token, prefill_flops, routed_experts
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.model_config.hf import preset


def test_dense_model_floors_are_unchanged() -> None:
    mc = preset("llama-3.1-8b")
    assert routed_experts(mc) is None and active_parameters(mc) == mc.num_parameters
    n = 2048
    assert prefill_flops(mc, n) == 2 * mc.num_parameters * n + 2 * mc.head_dim * n * n * mc.num_heads * mc.num_layers


def test_moe_counts_only_the_experts_a_token_picks() -> None:
    mc = preset("deepseek-v2-lite")  # 64 routed experts, 6 per token, 26 MoE layers
    routed = routed_experts(mc)
    assert (routed.num_layers, routed.num_experts, routed.top_k) == (26, 64, 6)
    active = active_parameters(mc)
    assert active == mc.num_parameters - 26 * 58 * routed.params_per_expert
    assert 2.0e9 < active < 2.8e9 < 15e9 < mc.num_parameters  # DeepSeek-V2-Lite: 2.4B active of 15.7B
    assert routed.expected_read(1) == pytest.approx(6)
    assert 6 < routed.expected_read(8) < routed.expected_read(64) < 64
    qwen = preset("qwen3-30b-a3b")  # 128 experts, 8 per token, every layer sparse: 3.3B active of 30.5B
    routed = routed_experts(qwen)
    assert (routed.num_layers, routed.num_experts, routed.top_k) == (48, 128, 8)
    assert 3.2e9 < active_parameters(qwen) < 3.5e9


@pytest.mark.parametrize("model", ["dummy:granite-4.0-h-moe-tiny", "dummy:deepseek-v3-tiny", "dummy:qwen3-moe-tiny"])
def test_decode_floor_reads_kv_groups_state_and_picked_experts(model: str) -> None:
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=16))
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    routed = routed_experts(engine.model_config)
    unread = routed.num_layers * (routed.num_experts - routed.top_k) * routed.params_per_expert * 4
    pool = engine.runtime.state_pool
    state = pool.spec.slot_bytes if pool is not None else 0
    per_token = kv_bytes_per_token(engine)
    layout = engine.kv_layout
    assert per_token == sum(layout.block_bytes(g.group_id) // g.block_size for g in layout.groups)
    assert decode_floor_bytes(engine, weights, 1, 100, 4) == pytest.approx(weights - unread + 100 * per_token + state)
    assert (pool is not None) == model.startswith("dummy:granite")
