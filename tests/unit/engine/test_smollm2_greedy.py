"""The real SmolLM2-135M-Instruct GGUF: the engine's greedy tokens equal transformers' on the same file."""

from __future__ import annotations

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.unit._smollm2 import smollm2_path, smollm2_tokenizer, transformers_model

NUM_TOKENS = 24
PLAIN = ["Once upon a time", "The quick brown fox", "def fibonacci(n):\n"]
CHATS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(smollm2_path()), device="cpu", dtype="float32"))


def _prompts() -> list[list[int]]:
    tok = smollm2_tokenizer()
    chat = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    return [tok.encode(t, add_special_tokens=False) for t in PLAIN + chat]


def _hf_greedy(prompt: list[int]) -> list[int]:
    model = transformers_model()
    model.generation_config.eos_token_id = None  # run the full length, like ignore_eos below
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_equal_transformers(engine: LLMEngine) -> None:
    prompts = _prompts()
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)  # all five run together in one batch
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == _hf_greedy(prompt), smollm2_tokenizer().decode(prompt)


def test_chat_answer_is_sensible(engine: LLMEngine) -> None:
    tok = smollm2_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"  # ended on <|im_end|>
