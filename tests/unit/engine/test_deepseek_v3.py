"""Engine vs Hugging Face transformers 5.23 on small random DeepSeek-V3 checkpoints.

Two checkpoints, saved by ``save_pretrained`` in several safetensors shards:

* ``q_lora``: the query bottleneck (``q_lora_rank``), 2 dense layers then 2 MoE layers with 4 expert
  groups of which 2 are kept, renormalised top-2 weights scaled by 2.5, interleaved rope under YaRN
  with a cos/sin scale and a softmax-scale correction (``mscale`` != ``mscale_all_dim``);
* ``no_q_lora``: DeepSeek-V2-Lite's form (one ``q_proj``), 1 dense layer, one expert group, plain
  top-2 weights, rotate-half rope (``rope_interleave`` false) and biases on the attention projections.

Norm weights, the routers' ``e_score_correction_bias`` and the biases are perturbed (transformers
initialises them to constants), so reading any of them wrong shows. Prompts of 5-40 tokens (the last
two share 16 tokens with the second) run together under a 24-token budget (chunked prefill) with
4-token blocks: the logits of every computed position match transformers' (float32, max relative
error < 1e-4) and 32 greedy tokens are identical, in every KV layout, with prefix-cache hits, across
preemption, and with each attention form (absorbed, expanded) forced on every step. The host KV tier
stores and loads the latent rows like any other block.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.attention.mla import TorchMLABackend
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.loading.weights import safetensors_files
from services.engine.parallel import ParallelConfig
from services.engine.start import start_engine
from services.kv.spec.groups import AttentionKind
from services.kv.spec.layout import BlockOrder, LayoutKind
from tests.parity import Reference, assert_matches, reference_of, run_to_completion

NUM_TOKENS = 32
PROMPT_LENS = (5, 17, 33, 40)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
LAYOUTS = [(LayoutKind.PER_LAYER, BlockOrder.NHD), (LayoutKind.CROSS_LAYER, BlockOrder.HND),
           (LayoutKind.HEADS_OUTER, BlockOrder.HND)]
_SHAPE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=512, initializer_range=0.15,
    rms_norm_eps=1e-6,
)
CHECKPOINTS = {
    "q_lora": dict(
        _SHAPE, q_lora_rank=48, n_group=4, topk_group=2, first_k_dense_replace=2, norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.8, "original_max_position_embeddings": 64},
    ),
    "no_q_lora": dict(
        _SHAPE, q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, rope_interleave=False, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def make_deepseek_checkpoint(name: str, directory: Path, seed: int = 0):
    """A random DeepSeek-V3 checkpoint ``name`` saved in shards to ``directory``; (directory, HF model)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**CHECKPOINTS[name])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        for tensor_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor_name.endswith("norm.weight"):
                tensor.add_(0.2 * torch.randn_like(tensor))
            elif tensor_name.endswith("e_score_correction_bias"):
                tensor.copy_(0.3 * torch.randn_like(tensor))
            elif tensor_name.endswith("bias"):
                tensor.copy_(0.1 * torch.randn_like(tensor))
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="300KB")
    return directory, model


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def reference(request, tmp_path_factory) -> Reference:
    directory, hf = make_deepseek_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    assert len(safetensors_files(directory)) > 2  # sharded, read through the index
    return reference_of(directory, hf, PROMPT_LENS, NUM_TOKENS, seed=7, shared_from=1, shared_len=16)


def _engine(ref: Reference, kind: LayoutKind = LayoutKind.CROSS_LAYER, order: BlockOrder = BlockOrder.NHD,
            num_kv_blocks: int = 256) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ref.checkpoint, device="cpu", dtype="float32", block_size=4, kv_layout=kind, kv_block_order=order,
        num_kv_blocks=num_kv_blocks, max_num_batched_tokens=24,
    ))


@pytest.mark.parametrize(("kind", "order"), LAYOUTS, ids=lambda x: x.value)
def test_chunked_batch_matches_hf(reference: Reference, kind: LayoutKind, order: BlockOrder) -> None:
    engine = _engine(reference, kind, order)
    (group,) = engine.kv_layout.groups
    assert group.kind is AttentionKind.MLA and group.head_dim == 32 + 8 and engine.kv_layout.kv_heads(0) == 1
    _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
    assert_matches(reference.tokens, reference.logits, outputs)


@pytest.mark.parametrize(("kind", "order"), LAYOUTS[:2], ids=lambda x: x.value)
def test_prefix_cache_hits_match_hf(reference: Reference, kind: LayoutKind, order: BlockOrder) -> None:
    """A request sharing a prefix with an earlier one reads that prefix's latent rows from the cache,
    then every prompt again with the whole prompt cached."""
    engine = _engine(reference, kind, order)
    _, first = run_to_completion(engine, reference.prompts[1:2], GREEDY)
    assert_matches(reference.tokens[1:2], reference.logits[1:2], first)
    _, sharing = run_to_completion(engine, reference.prompts[2:], GREEDY)
    assert [o.num_cached_tokens for o in sharing] == [16, 16]  # the prefix shared with prompt 1
    assert_matches(reference.tokens[2:], reference.logits[2:], sharing)
    _, again = run_to_completion(engine, reference.prompts, GREEDY)
    assert all(o.num_cached_tokens >= 16 for o in again[1:]), [o.num_cached_tokens for o in again]
    assert_matches(reference.tokens, reference.logits, again)


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_each_attention_form_matches_hf(reference: Reference, form: str) -> None:
    """Both forms on every step, prefill chunks and decodes alike (``auto`` mixes them by step)."""
    engine = _engine(reference)
    engine.model.mla_form = form
    _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
    assert_matches(reference.tokens, reference.logits, outputs)


def test_auto_decodes_absorbed_and_prefills_expanded(reference: Reference, monkeypatch) -> None:
    calls = {"absorbed": [], "expanded": []}
    absorbed, expanded = TorchMLABackend.forward_absorbed, TorchMLABackend.forward_expanded

    def count_absorbed(self, q, rows, latent_dim, batch, *args):
        calls["absorbed"].append(batch.max_query_len)
        return absorbed(self, q, rows, latent_dim, batch, *args)

    def count_expanded(self, q, rows, batch, *args):
        calls["expanded"].append(batch.max_query_len)
        return expanded(self, q, rows, batch, *args)

    monkeypatch.setattr(TorchMLABackend, "forward_absorbed", count_absorbed)
    monkeypatch.setattr(TorchMLABackend, "forward_expanded", count_expanded)
    _, outputs = run_to_completion(_engine(reference), reference.prompts, GREEDY)
    assert_matches(reference.tokens, reference.logits, outputs)
    assert calls["absorbed"] and set(calls["absorbed"]) == {1}
    assert calls["expanded"] and min(calls["expanded"]) > 1


def test_preemption_matches_hf(reference: Reference) -> None:
    # 40 blocks of 4 tokens cannot hold all four sequences at full length (~225 tokens).
    engine = _engine(reference, num_kv_blocks=40)
    requests, outputs = run_to_completion(engine, reference.prompts, GREEDY)
    assert sum(r.num_preemptions for r in requests) > 0, "the pool is too small not to preempt"
    assert_matches(reference.tokens, reference.logits, outputs)
    assert engine.kv_manager.pool(0).num_free_blocks == 40


@pytest.mark.parametrize("kind", [LayoutKind.PER_LAYER, LayoutKind.CROSS_LAYER])
def test_host_tier_hit_after_device_eviction_matches_hf(reference: Reference, kind: LayoutKind) -> None:
    """Prompt 3's latent rows go to the host tier, are pushed out of the device pool by prompt 2, then
    come back from the host: the same logits and tokens as transformers."""
    engine = LLMEngine(EngineConfig(
        model=reference.checkpoint, device="cpu", dtype="float32", block_size=4, kv_layout=kind, num_kv_blocks=20,
        kv_offload_bytes=1 << 22, kv_offload_block_factor=2,
    ))
    tier = engine.host_tier

    def settle() -> None:
        deadline = time.monotonic() + 10
        while tier.stats().store_queue_depth or tier.stats().loads_in_flight or tier.has_completions:
            engine.scheduler.take_finished_loads()
            assert time.monotonic() < deadline, "host tier copies did not finish"
            time.sleep(0.005)

    prompt = reference.prompts[3]
    evictor = [t if t != prompt[0] else t + 1 for t in range(10, 54)]  # 44 + 32 tokens: 19 of the 20 blocks
    _, outputs = run_to_completion(engine, [prompt], GREEDY)
    assert_matches(reference.tokens[3:], reference.logits[3:], outputs)
    settle()
    run_to_completion(engine, [evictor], GREEDY)
    settle()
    _, outputs = run_to_completion(engine, [prompt], GREEDY)
    assert_matches(reference.tokens[3:], reference.logits[3:], outputs)
    stats = engine.scheduler.prefix_stats
    assert stats.host_hits == 1 and outputs[0].num_cached_tokens - stats.device_hit_tokens > 0
    assert tier.stats().bytes_loaded > 0
    engine.close()


def test_tensor_parallel_matches_hf(reference: Reference) -> None:
    """TP 2 (a follower rank in its own process, gloo on CPU): each rank holds half the query heads and half of
    every MLP's and expert's width, the latent rows whole; the logits and greedy tokens still match HF's."""
    config = EngineConfig(model=reference.checkpoint, device="cpu", dtype="float32", block_size=4,
                          num_kv_blocks=256, max_num_batched_tokens=24, parallel=ParallelConfig(2, 0))
    engine = start_engine(config, ["cpu", "cpu"])
    try:
        (group,) = engine.kv_layout.groups
        assert group.kind is AttentionKind.MLA and engine.kv_layout.kv_heads(0) == 1  # the whole row on each rank
        assert engine.runtime.model.layers[0].self_attn.num_heads == engine.model_config.num_heads // 2
        _, outputs = run_to_completion(engine, reference.prompts, GREEDY)
        assert_matches(reference.tokens, reference.logits, outputs)
    finally:
        engine.close()
