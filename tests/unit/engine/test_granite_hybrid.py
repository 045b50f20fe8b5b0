"""Engine vs Hugging Face transformers 5.23 on small random Granite-4.0-H (GraniteMoeHybrid) checkpoints.

Three checkpoints of 4 layers, Mamba2 and attention mixed (attention at layer 1, Mamba2 elsewhere), every
Granite multiplier away from 1, a Mamba2 scan chunk of 8 tokens (shorter than the prompts, so the chunked
scan carries its state across scan chunks), d_conv 4:

* ``rope``: dense, RoPE, 2 Mamba2 groups, untied head, biased attention projections;
* ``nope``: dense, no position embedding (``position_embedding_type`` null), one group, tied head;
* ``moe``: ``rope`` plus 8 routed experts, 3 per token, beside the shared MLP (Granite-4.0-H-Tiny's form).

Norm weights, ``dt_bias``, ``A_log``, ``D`` and the biases are perturbed (transformers initialises
several to constants), so reading any of them wrong shows. Prompts of 5-40 tokens run together under a
24-token budget (chunked prefill carries the state between steps) with 4-token blocks: the logits of
every position match transformers' (float32, max relative error < 1e-4) and 32 greedy tokens are
identical, batched, one at a time, and across preemption.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.model_config.hf import ModelConfig, preset
from services.engine.parallel import ParallelConfig
from services.engine.runner.cuda_graphs import DecodeGraphRunner
from services.engine.start import start_engine
from services.kv.spec.groups import AttentionKind
from services.kv.spec.layout import BlockOrder, LayoutKind
from tests.parity import Reference, assert_matches, reference_of, run_to_completion

NUM_TOKENS = 32
PROMPT_LENS = (5, 17, 33, 40)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
_SHAPE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, shared_intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=0,
    layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
    mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, embedding_multiplier=3.0, attention_multiplier=0.3,
    residual_multiplier=0.7, logits_scaling=2.0, max_position_embeddings=512, initializer_range=0.15,
    rms_norm_eps=1e-6,
)
CHECKPOINTS = {
    "rope": dict(_SHAPE, position_embedding_type="rope", mamba_n_groups=2, tie_word_embeddings=False,
                 attention_bias=True),
    "nope": dict(_SHAPE, position_embedding_type=None, mamba_n_groups=1, tie_word_embeddings=True),
}
CHECKPOINTS["moe"] = dict(CHECKPOINTS["rope"], num_local_experts=8, num_experts_per_tok=3, intermediate_size=32)


def make_granite_checkpoint(name: str, directory: Path, seed: int = 0):
    """A random Granite-4.0-H checkpoint ``name`` saved to ``directory``; (directory, HF model)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GraniteMoeHybridConfig(**CHECKPOINTS[name])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        for tensor_name, tensor in model.named_parameters():
            if tensor_name.endswith("norm.weight"):
                tensor.add_(0.2 * torch.randn_like(tensor))
            elif tensor_name.endswith(("dt_bias", "mamba.D", "bias")):
                tensor.add_(0.3 * torch.randn_like(tensor))
            elif tensor_name.endswith("A_log"):
                tensor.copy_(torch.log(torch.rand_like(tensor) * 4 + 0.5))
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def reference(request, tmp_path_factory) -> Reference:
    directory, hf = make_granite_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return reference_of(directory, hf, PROMPT_LENS, NUM_TOKENS, seed=7, shared_from=1, shared_len=16)


def _engine(ref: Reference, kind: LayoutKind = LayoutKind.CROSS_LAYER, order: BlockOrder = BlockOrder.NHD,
            num_kv_blocks: int = 256, max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ref.checkpoint, device="cpu", dtype="float32", block_size=4, kv_layout=kind, kv_block_order=order,
        num_kv_blocks=num_kv_blocks, max_num_batched_tokens=24, max_num_seqs=max_num_seqs,
    ))


@pytest.mark.parametrize(("kind", "order"), [(LayoutKind.PER_LAYER, BlockOrder.NHD),
                                             (LayoutKind.CROSS_LAYER, BlockOrder.HND)], ids=lambda x: x.value)
def test_chunked_batch_matches_hf(reference: Reference, kind: LayoutKind, order: BlockOrder) -> None:
    """Four prompts batched, prefilled in 24-token steps: only the attention layer has KV, the Mamba2
    layers carry their state between chunks and decode steps; no prefix hit despite the shared prefix."""
    engine = _engine(reference, kind, order)
    (group,) = engine.kv_layout.groups
    assert group.kind is AttentionKind.FULL and group.layer_ids == (1,)
    assert engine.model_config.state_layer_ids == (0, 2, 3)
    _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
    assert [o.num_cached_tokens for o in outputs] == [0] * len(PROMPT_LENS)
    assert_matches(reference.tokens, reference.logits, outputs)
    assert engine.kv_manager.state_slots.num_free == 8


def test_one_at_a_time_then_again_matches_hf(reference: Reference) -> None:
    """One sequence seat: each request reuses the state slot the one before gave back; a second run of the
    same prompts (whose blocks the prefix cache would hold) recomputes them from a zeroed state."""
    engine = _engine(reference, max_num_seqs=1)
    for _ in range(2):
        _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
        assert all(o.num_cached_tokens == 0 for o in outputs)
        assert_matches(reference.tokens, reference.logits, outputs)


def test_preemption_matches_hf(reference: Reference) -> None:
    # 40 blocks of 4 tokens cannot hold all four sequences at full length (~225 tokens).
    engine = _engine(reference, num_kv_blocks=40)
    requests, outputs = run_to_completion(engine, reference.prompts, GREEDY)
    assert sum(r.num_preemptions for r in requests) > 0, "the pool is too small not to preempt"
    assert_matches(reference.tokens, reference.logits, outputs)
    assert engine.kv_manager.pool(0).num_free_blocks == 40
    assert engine.kv_manager.state_slots.num_free == 8


def test_decode_steps_through_graph_buffers_match_hf(reference: Reference) -> None:
    """The decode graph runner's static-buffer forward (captured on CUDA, run as is here): three requests in a
    bucket of four, so a padding row reads and writes the state pool's scratch slot; every decode step after a
    request's first goes through it, and the greedy tokens are still transformers'. The scratch slot is not a
    slot a request can own, nor part of what peers read."""
    engine = _engine(reference, max_num_seqs=4)
    pool = engine.runtime.state_pool
    assert pool.scratch_slot == 4 == pool.num_slots and pool.buffer.shape[0] == 4
    assert pool.conv[0].shape[0] == pool.ssm[0].shape[0] == 5
    graphs = DecodeGraphRunner(engine.model, engine.kv_cache, 4, engine.max_model_len, capture=False,
                               min_context_bucket=8, state_pool=pool)
    engine.runner.decode_graphs = graphs
    engine.async_scheduling = False
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    _, outputs = run_to_completion(engine, reference.prompts[:3], params)
    assert [list(o.token_ids) for o in outputs] == [list(t) for t in reference.tokens[:3]]
    assert graphs.num_runs > NUM_TOKENS // 2 and any(b == 4 for b, _ in graphs.captured)
    assert pool.ssm[0][pool.scratch_slot].abs().sum() > 0  # the padding row ran


def test_abort_gives_the_state_slot_back(reference: Reference) -> None:
    engine = _engine(reference, max_num_seqs=2)
    slots = engine.kv_manager.state_slots
    engine.add_request("a", reference.prompts[0], GREEDY)
    engine.add_request("b", reference.prompts[1], GREEDY)
    engine.step()
    assert slots.num_free == 0
    assert engine.abort_request("a")
    assert slots.num_free == 1
    engine.add_request("c", reference.prompts[3], GREEDY)  # takes a's slot and starts from a zero state
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert_matches(reference.tokens[1:2] + reference.tokens[3:], reference.logits[1:2] + reference.logits[3:],
                   [finals["b"], finals["c"]])
    assert slots.num_free == 2


def test_tensor_parallel_matches_hf(reference: Reference) -> None:
    """TP 2 (a follower rank in its own process, gloo on CPU): each rank holds half the Mamba2 heads (with their
    groups' B and C, or the one group whole: its gated norm then all-reduced), half the attention heads and half
    of every MLP's and expert's width, and a state slot of its own heads only; logits and greedy tokens still
    match HF's, chunked prefill carrying the split state across steps."""
    config = EngineConfig(model=reference.checkpoint, device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
                          max_num_batched_tokens=24, max_num_seqs=8, parallel=ParallelConfig(2, 0))
    engine = start_engine(config, ["cpu", "cpu"])
    try:
        full = engine.model_config.granite.mamba
        pool = engine.runtime.state_pool
        assert pool.spec.tp_size == 2 and pool.ssm[0].shape[1] == full.num_heads // 2
        _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
        assert_matches(reference.tokens, reference.logits, outputs)
    finally:
        engine.close()


def test_a_tp_size_that_cannot_split_the_mamba_heads_is_refused() -> None:
    mamba = preset("granite-4.0-h-tiny").granite.mamba
    with pytest.raises(ValueError, match="cannot shard the Mamba2 layers"):
        mamba.for_rank(mamba.num_heads + 1, 0)
    heads, groups = mamba.for_rank(2, 1).num_heads, mamba.rank_channels(2, 1)[1]
    assert heads == mamba.num_heads // 2 and len(groups) == max(1, mamba.n_groups // 2)


def test_host_tier_is_refused(reference: Reference) -> None:
    with pytest.raises(ValueError, match="state layers"):
        LLMEngine(EngineConfig(model=reference.checkpoint, device="cpu", dtype="float32", num_kv_blocks=64,
                               kv_offload_bytes=1 << 20))


def test_config_reading() -> None:
    d = dict(CHECKPOINTS["nope"], model_type="granitemoehybrid", layer_types=["mamba", "attention"] * 2,
             mamba_d_head="auto", eos_token_id=0)
    config = ModelConfig.from_hf_dict(d)
    m = config.granite.mamba
    assert config.architecture == "granitemoehybrid" and config.state_layer_ids == (0, 2)
    assert config.kv_layer_ids == (1, 3) and not config.granite.use_rope
    assert (m.head_dim, m.intermediate_size, m.conv_dim) == (16, 128, 128 + 2 * 16)
    assert config.attention_scale == 0.3 and config.embed_scale == 3.0 and config.intermediate_size == 96
    assert config.granite.experts is None
    moe = ModelConfig.from_hf_dict(dict(d, num_local_experts=4, num_experts_per_tok=2))
    assert moe.intermediate_size == 96 and moe.granite.experts.intermediate_size == 128
    assert moe.num_parameters - config.num_parameters == 4 * 4 * (3 * 64 * 128 + 64)
    for wrong, field in ((dict(num_local_experts=None), "num_local_experts"),
                         (dict(num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
                         (dict(num_local_experts=4, num_experts_per_tok=None), "num_experts_per_tok")):
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_hf_dict(dict(d, **wrong))
    with pytest.raises(ValueError, match="time_step_limit"):
        ModelConfig.from_hf_dict(dict(d, time_step_limit=[0.0, 2.0]))
    with pytest.raises(ValueError, match="layer types"):
        ModelConfig.from_hf_dict(dict(d, layer_types=["mamba", "moe", "mamba", "mamba"]))


def test_dummy_preset_generates() -> None:
    assert preset("granite-4.0-h-tiny-shape").state_layer_ids == tuple(i for i in range(40) if i % 10 != 5)
    engine = LLMEngine(EngineConfig(model="dummy:granite-4.0-h-tiny", device="cpu", dtype="float32",
                                    num_kv_blocks=64, max_num_batched_tokens=16))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    _, outputs = run_to_completion(engine, [list(range(3, 40)), list(range(5, 12))], params)
    assert [len(o.token_ids) for o in outputs] == [8, 8]


def test_moe_presets() -> None:
    """granite-4.0-h-tiny-shape has Granite-4.0-H-Tiny's experts (7B in all); the moe-tiny preset generates."""
    shape = preset("granite-4.0-h-tiny-shape")
    assert (shape.granite.experts.num_local_experts, shape.granite.experts.num_experts_per_tok) == (64, 6)
    assert 6.8e9 < shape.num_parameters < 7.0e9
    engine = LLMEngine(EngineConfig(model="dummy:granite-4.0-h-moe-tiny", device="cpu", dtype="float32",
                                    num_kv_blocks=64, max_num_batched_tokens=16))
    assert engine.model_config.granite.experts.num_local_experts == 8
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    _, outputs = run_to_completion(engine, [list(range(3, 40)), list(range(5, 12))], params)
    assert [len(o.token_ids) for o in outputs] == [8, 8]
