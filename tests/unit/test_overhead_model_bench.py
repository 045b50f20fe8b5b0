"""bench/overhead_model.py writes the router-overhead bench's model without transformers: a directory the engine
serves (its loader checks every tensor name and shape) with SmolLM2's tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.overhead_model import MAX_POSITIONS, make_overhead_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """Written in-process (``router_overhead.py --make-model DIR`` calls the same function): a subprocess would
    pay torch's import again."""
    return make_overhead_model(tmp_path_factory.mktemp("overhead") / "overhead_model")


def test_the_directory_is_small_and_the_engine_serves_it(model_dir: Path) -> None:
    from services.contract.sampling_params import SamplingParams
    from services.engine.engine_config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from services.engine.model_config.hf import ModelConfig

    assert sum(f.stat().st_size for f in model_dir.iterdir()) < 30 << 20
    config = ModelConfig.from_file(model_dir / "config.json")
    assert (config.num_layers, config.hidden_size, config.max_position_embeddings) == (2, 64, MAX_POSITIONS)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=16))
    out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_the_tokenizer_and_template_are_smollm2s(model_dir: Path) -> None:
    """The bundled tokenizer's JSON and template as written (comparing with the bundled GGUF would parse it again:
    seconds of a CI core): its vocabulary, special tokens and chat template read back through the HF path."""
    from services.text.tokenizer import Tokenizer

    written = Tokenizer.from_hf_dir(model_dir)
    text = "The router tokenizes real text, 200 KB of it: héllo wörld"
    ids = written.encode(text)
    assert written.vocab_size == 49152 and written.decode(ids) == text and len(ids) < len(text) / 2
    assert (written.bos_token_id, written.eos_token_ids, written.add_bos_token) == (1, frozenset({2}), False)
    prompt = written.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") and "SmolLM" in prompt
