"""``--kv-cache-dtype fp8_e4m3`` on CPU: engine vs Hugging Face transformers with the same fake quantization.

The reference is transformers (float32) whose attention sees every key and value rounded through e4m3 with
its layer's scale, ``(x / s).clamp(-448, 448).to(float8_e4m3fn).float() * s``, which is exactly what the
engine's FP8 cache stores and reads back: an attention function registered with ``AttentionInterface``
for Llama-family and Granite models, and DeepSeek-V3's ``expand_kv`` (the latent row c_kv and the rotated
k_pe, both with the layer's k_scale) patched per layer. Scales are not powers of two (a power-of-two scale
rounds exactly like 1.0 in e4m3) and differ per layer and between K and V, so a scale dropped or swapped on
either side changes the tokens: ``test_the_reference_sees_the_scales`` checks that.

Beside: the FP8 run differs from the float32-KV run (so the comparison is not of two unquantized runs),
prefix-cache hits, chunked prefill, preemption and the host tier give one clean run's tokens, the pool
holds 2x the tokens of bf16 and 4x of fp32 in the same bytes, the write saturates instead of making NaN,
and a bad dtype name is a clear error.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.loading.source import ModelSource, resolve_model
from services.engine.ops import kv_fp8
from services.engine.ops.reference import rope_and_write_kv
from tests.checkpoints import make_checkpoint
from tests.parity import hf_greedy, run_to_completion

NUM_TOKENS = 24
PROMPTS = [[(7 * i + 3) % 300 + 10 for i in range(n)] for n in (5, 19, 37)]
PROMPTS.append(PROMPTS[2][:16] + [(5 * i + 1) % 300 + 10 for i in range(13)])  # shares 16 tokens with prompt 2
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
LLAMA_SCALES = {0: (0.37, 1.7), 1: (1.3, 0.23)}
DEEPSEEK_SCALES = {0: (0.61, 1.0), 1: (1.45, 1.0), 2: (0.29, 1.0)}  # MLA: one latent-row scale, the k_scale


def fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache gives back for ``x``: the reference's own statement of it (not ``ops.kv_fp8``)."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def _register_fp8_attention(scales: dict[int, tuple[float, float]]) -> str:
    """An HF attention function rounding K and V through e4m3 with the layer's scales, then SDPA."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        return sdpa_attention_forward(module, query, fake_quant(key, k_scale), fake_quant(value, v_scale),
                                      attention_mask, **kwargs)

    name = f"fp8_sdpa_{id(scales)}"
    AttentionInterface.register(name, attention)
    return name


def _hf_fp8_greedy(hf, scales: dict[int, tuple[float, float]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    hf.set_attn_implementation(_register_fp8_attention(scales))
    try:
        return hf_greedy(hf, PROMPTS, NUM_TOKENS)
    finally:
        hf.set_attn_implementation("sdpa")


def _source(checkpoint: str, scales: dict[int, tuple[float, float]]) -> ModelSource:
    return dataclasses.replace(resolve_model(checkpoint), kv_scales=scales)


def _engine(source: ModelSource, kv_cache_dtype: str = "fp8_e4m3", **kw) -> LLMEngine:
    settings = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=24)
    return LLMEngine(EngineConfig(model=source.name, kv_cache_dtype=kv_cache_dtype, **{**settings, **kw}), source)


def _tokens_and_logits(engine: LLMEngine, prompts=PROMPTS):
    requests, outputs = run_to_completion(engine, prompts, GREEDY)
    return requests, [o.token_ids for o in outputs], outputs


def _max_rel_error(outputs, logits: list[torch.Tensor]) -> float:
    worst = 0.0
    for out, expected in zip(outputs, logits, strict=True):
        for start, chunk in out.logits:
            ref = expected[start:start + len(chunk)]
            worst = max(worst, float((chunk - ref).abs().max() / ref.abs().max()))
    return worst


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory, hf = make_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    tokens, logits = _hf_fp8_greedy(hf, LLAMA_SCALES)
    return str(directory), hf, tokens, logits


def test_greedy_tokens_match_hf_with_the_same_fake_quantization(llama) -> None:
    checkpoint, _, tokens, logits = llama
    engine = _engine(_source(checkpoint, LLAMA_SCALES))
    assert engine.kv_cache.buffers[0].dtype == torch.float8_e4m3fn
    _, got, outputs = _tokens_and_logits(engine)
    assert got == tokens
    # The same e4m3 values on both sides; what is left is float32 rounding (and an fp8 rounding that one
    # ulp of float32 tips over, rarely): far below what the quantization itself moves (next test).
    assert _max_rel_error(outputs, logits) < 1e-3


def test_fp8_differs_from_a_float32_cache_and_from_unit_scales(llama) -> None:
    checkpoint, _, tokens, logits = llama
    _, fp32_tokens, fp32_out = _tokens_and_logits(_engine(_source(checkpoint, LLAMA_SCALES), "auto"))
    _, unit_tokens, unit_out = _tokens_and_logits(_engine(_source(checkpoint, {})))
    assert _max_rel_error(fp32_out, logits) > 1e-2, "an FP8 cache must move the logits"
    assert _max_rel_error(unit_out, logits) > 1e-2, "the scales must matter"
    assert fp32_tokens != tokens and unit_tokens != tokens


def test_the_reference_sees_the_scales(llama) -> None:
    """The HF side with other scales gives other tokens: a reference that ignored them would fail the parity."""
    _, hf, tokens, _ = llama
    swapped = {layer: (v, k) for layer, (k, v) in LLAMA_SCALES.items()}
    assert _hf_fp8_greedy(hf, swapped)[0] != tokens


def test_prefix_hits_chunks_and_preemption_give_one_clean_run(llama) -> None:
    checkpoint, _, tokens, _ = llama
    source = _source(checkpoint, LLAMA_SCALES)
    clean = [o.token_ids for o in _engine(source, max_num_batched_tokens=512).generate(
        PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))]
    assert clean == tokens
    engine = _engine(source, max_num_batched_tokens=8)  # every prompt prefilled in chunks of <= 8 tokens
    assert _tokens_and_logits(engine)[1] == clean
    _, again, outputs = _tokens_and_logits(engine)  # second run: prefix-cache hits
    assert all(o.num_cached_tokens > 0 for o in outputs[1:]) and again == clean
    small = _engine(source, num_kv_blocks=30)
    requests, preempted, _ = _tokens_and_logits(small)
    assert sum(r.num_preemptions for r in requests) > 0, "the pool is too small not to preempt"
    assert preempted == clean


def test_host_tier_stores_and_loads_fp8_blocks(llama) -> None:
    checkpoint, _, _, _ = llama
    source = _source(checkpoint, LLAMA_SCALES)
    prompt, other = [(3 * i + 1) % 300 + 10 for i in range(120)], [(11 * i + 5) % 300 + 10 for i in range(120)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in _engine(source).generate([prompt, other], params)]
    engine = _engine(source, num_kv_blocks=40, kv_offload_bytes=1 << 22, kv_offload_block_factor=2)
    assert engine.host_tier.buffers[0].dtype == torch.float8_e4m3fn
    assert engine.generate([prompt], params)[0].token_ids == expected[0]
    _settle(engine)
    assert engine.generate([other], params)[0].token_ids == expected[1]  # pushes `prompt` out of the device pool
    _settle(engine)
    again = engine.generate([prompt], params)[0]
    assert again.token_ids == expected[0]
    assert engine.scheduler.prefix_stats.host_hits == 1 and engine.host_tier.stats().bytes_loaded > 0
    engine.close()


def _settle(engine: LLMEngine) -> None:
    import time

    tier, deadline = engine.host_tier, time.monotonic() + 10
    while tier.stats().store_queue_depth or tier.stats().loads_in_flight or tier.has_completions:
        engine.scheduler.take_finished_loads()
        assert time.monotonic() < deadline, "host tier copies did not finish"
        time.sleep(0.005)


def test_pool_holds_2x_bf16_and_4x_fp32_tokens(llama, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint, _, _, _ = llama
    source = _source(checkpoint, {})
    budget = 3 * 2**20
    blocks = {}
    for name in ("float32", "bfloat16", "fp8_e4m3"):
        with caplog.at_level(logging.INFO, logger="services.engine.runner.rank_runtime"):
            engine = _engine(source, name, num_kv_blocks=None, kv_cache_memory_bytes=budget)
        blocks[name] = engine.kv_layout.num_blocks  # the scratch block included: budget // bytes per block
        assert engine.kv_cache.num_bytes <= budget
    assert blocks["bfloat16"] == 2 * blocks["float32"] and blocks["fp8_e4m3"] == 4 * blocks["float32"]
    line = caplog.records[-1].getMessage()
    assert "float8_e4m3fn" in line and f"{(blocks['fp8_e4m3'] - 1) * 4} tokens" in line


def test_write_saturates_and_reads_back_scaled() -> None:
    cache = torch.zeros(2, 4, 1, 4, dtype=torch.float8_e4m3fn)
    k = torch.tensor([[[1000.0, -1000.0, 0.3, -2.5]]])
    v = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    rope_and_write_kv(None, k, v, None, None, None, cache, cache[1:], torch.tensor([0]), torch.tensor([2]),
                      (0.5, 2.0))
    got = kv_fp8.from_cache(cache[0, 2, 0], 0.5, torch.float32)
    assert got.tolist() == [224.0, -224.0, fake_quant(torch.tensor(0.3), 0.5).item(), -2.5]  # 448 * 0.5: no NaN
    assert kv_fp8.from_cache(cache[1, 2, 0], 2.0, torch.float32).tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("bad", ["fp8", "float8", "int8"])
def test_a_bad_kv_cache_dtype_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="dummy:tiny", kv_cache_dtype=bad)


def test_a_bad_scale_is_a_clear_error(llama) -> None:
    checkpoint, _, _, _ = llama
    with pytest.raises(ValueError, match="layer 0"):
        _engine(_source(checkpoint, {0: (0.0, 1.0)}))
    with pytest.raises(ValueError, match="layer 5"):
        _engine(_source(checkpoint, {5: (1.0, 1.0)}))


# ---- DeepSeek-V3 (MLA): the latent row through e4m3 -----------------------------------------------------------
def _hf_mla_fp8_greedy(hf, scales: dict[int, tuple[float, float]]):
    """Round each layer's cached latent (c_kv) and rotated k_pe through e4m3 with the layer's k_scale before
    transformers expands them: what the engine's latent-row cache holds."""
    originals = []
    for layer in hf.model.layers:
        attn = layer.self_attn
        scale = scales[attn.layer_idx][0]
        originals.append((attn, attn.expand_kv))
        attn.expand_kv = (lambda c, r, expand=attn.expand_kv, s=scale: expand(fake_quant(c, s), fake_quant(r, s)))
    try:
        return hf_greedy(hf, PROMPTS, NUM_TOKENS)
    finally:
        for attn, expand in originals:
            attn.expand_kv = expand


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    directory, hf = make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))
    tokens, logits = _hf_mla_fp8_greedy(hf, DEEPSEEK_SCALES)
    return str(directory), tokens, logits


@pytest.mark.parametrize("mla_form", ["auto", "expanded", "absorbed"])
def test_deepseek_latent_rows_match_hf_fake_quant(deepseek, mla_form: str) -> None:
    """Both MLA forms read the same dequantized rows (``auto``: absorbed decodes, expanded prefills)."""
    checkpoint, tokens, logits = deepseek
    engine = _engine(_source(checkpoint, DEEPSEEK_SCALES))
    engine.model.mla_form = mla_form
    assert engine.kv_cache.buffers[0].dtype == torch.float8_e4m3fn
    _, got, outputs = _tokens_and_logits(engine)
    assert got == tokens
    assert _max_rel_error(outputs, logits) < 1e-3


def test_deepseek_fp8_differs_from_a_float32_cache(deepseek) -> None:
    checkpoint, _, logits = deepseek
    _, _, fp32_out = _tokens_and_logits(_engine(_source(checkpoint, DEEPSEEK_SCALES), "auto"))
    assert _max_rel_error(fp32_out, logits) > 1e-2


# ---- hybrids: Gemma-4 (sliding + full + KV-shared layers) and Granite (Mamba2 state layers) ----------------------
def test_gemma4_engine_runs_fp8_and_matches_hf_fake_quant(tmp_path: Path) -> None:
    """Every layer its own scales: a KV-shared layer reads its source's cache, so its own scales must go unused and
    the source's apply (HF hands the shared layer the source's raw K/V, which the reference rounds with the source's
    scales)."""
    from services.engine.model_config.hf import ModelConfig

    directory, hf = make_checkpoint("gemma4", tmp_path)
    layers = ModelConfig.from_file(directory / "config.json").layers
    own = {i: (0.37 + 0.11 * i, 1.7 - 0.13 * i) for i in range(len(layers))}
    sources = {i: spec.kv_source for i, spec in enumerate(layers) if spec.kv_source is not None}
    assert sources, "the checkpoint must have KV-shared layers"
    read_with = {i: own[sources.get(i, i)] for i in own}  # what each layer's attention reads K/V with
    _check_hybrid(str(directory), hf, read_with, "eager", engine_scales=own)


def test_granite_hybrid_engine_runs_fp8_and_keeps_its_state_dtype(tmp_path: Path) -> None:
    from tests.unit.engine.test_granite_hybrid import make_granite_checkpoint

    directory, hf = make_granite_checkpoint("rope", tmp_path)
    scales = {i: (0.37, 1.7) for i, t in enumerate(hf.config.layer_types) if t == "attention"}
    engine = _check_hybrid(str(directory), hf, scales, "sdpa")
    pool = engine.runtime.state_pool
    assert all(t.dtype == torch.float32 for t in (*pool.conv.values(), *pool.ssm.values()))


def _check_hybrid(checkpoint: str, hf, scales: dict[int, tuple[float, float]], base: str,
                  engine_scales: dict[int, tuple[float, float]] | None = None) -> LLMEngine:
    """HF with K/V rounded through e4m3 by ``scales`` (per layer, as each layer's attention reads them) against the
    engine given ``engine_scales`` (default: the same)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    base_fn = sdpa_attention_forward
    if base == "eager":
        from transformers.models.gemma4 import modeling_gemma4

        base_fn = modeling_gemma4.eager_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        return base_fn(module, query, fake_quant(key, k_scale), fake_quant(value, v_scale), attention_mask, **kwargs)

    name = f"fp8_{base}_{id(scales)}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[base])  # the base's mask form
    hf.set_attn_implementation(name)
    tokens, logits = hf_greedy(hf, PROMPTS[:3], 16)
    engine = _engine(_source(checkpoint, scales if engine_scales is None else engine_scales))
    _, outputs = run_to_completion(engine, PROMPTS[:3], dataclasses.replace(GREEDY, max_tokens=16))
    assert [o.token_ids for o in outputs] == tokens
    assert _max_rel_error(outputs, logits) < 1e-3
    return engine
