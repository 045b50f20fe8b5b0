"""The official ``openai`` client against a 1P1D stack on the real SmolLM2 model: every OpenAI feature
pdserve serves, checked against the colocated engine where the answer is deterministic."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.e2e.stack import Stack, metric_total

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time, in a small village"
TOKEN_IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def served(smollm2_stack: Stack) -> tuple[Stack, openai.OpenAI]:
    """The shared SmolLM2 stack (tests/e2e/conftest.py) and a client of it."""
    client = openai.OpenAI(base_url=f"{smollm2_stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return smollm2_stack, client


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The colocated reference: the same model and dtype as the stack's workers."""
    return LLMEngine(EngineConfig(model=None, device="cpu", dtype="float32", num_kv_blocks=256))


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_and_streaming_with_usage(served, engine: LLMEngine) -> None:
    s, client = served
    model = _model(client)
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens <= 12
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == answer.usage.completion_tokens


def test_top_logprobs_match_the_colocated_engine(served, engine: LLMEngine) -> None:
    _, client = served
    model = _model(client)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    reference = engine.generate([prompt_ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                             logprobs=True, top_logprobs=4))[0]
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=4,
                                           extra_body={"ignore_eos": True, **TOKEN_IDS})
    logprobs = completion.choices[0].logprobs
    assert _ids(logprobs.tokens) == reference.token_ids
    for got, want in zip(logprobs.top_logprobs, reference.top_logprobs, strict=True):
        assert _ids(list(got)) == list(want.token_ids)  # the chosen token is among the top 4 (greedy: first)
        assert list(got.values()) == pytest.approx(list(want.logprobs), abs=2e-3)
    # Chat, streamed: each content token carries its 3 alternatives.
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 5
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def test_n_choices_share_the_prefilled_prompt(served, engine: LLMEngine) -> None:
    s, client = served
    model = _model(client)
    prefill = s.prefill[0]
    cached_before = metric_total(prefill, "pdserve_kv_prefix_cached_tokens_total")
    messages = [{"role": "user", "content": "Write one sentence about the sea, the wind and a boat. " * 3}]
    sampled = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0,
                                             seed=11, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len({c.message.content for c in sampled.choices}) > 1  # seed + index: the choices differ
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0, seed=11,
                                           n=3, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in sampled.choices]
    # The siblings' prompts were prefix-cache hits on the prefill worker: the prompt was computed once.
    prompt_tokens = sampled.usage.prompt_tokens
    assert metric_total(prefill, "pdserve_kv_prefix_cached_tokens_total") - cached_before >= 2 * (prompt_tokens - 8)
    assert sampled.usage.completion_tokens == 3 * 8
    # Streamed, greedy: every choice equals the colocated answer.
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0, n=2,
                                                 stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    expected = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0)
    assert texts == {0: expected.choices[0].message.content, 1: expected.choices[0].message.content}


def test_echo_token_prompts_and_batches(served, engine: LLMEngine) -> None:
    _, client = served
    model = _model(client)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                       logprobs=1, extra_body=TOKEN_IDS)
    choice = echoed.choices[0]
    assert choice.text.startswith(PROMPT)
    assert _ids(choice.logprobs.tokens)[:len(prompt_ids)] == prompt_ids
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    reference = engine.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
    for got, want in zip(choice.logprobs.token_logprobs[1:len(prompt_ids)], reference.prompt_logprobs[1:],
                         strict=True):
        assert got == pytest.approx(want.logprobs[0], abs=2e-3)
    batch = client.completions.create(model=model, prompt=[prompt_ids, prompt_ids[:5]], max_tokens=4, temperature=0,
                                      n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    references = engine.generate([prompt_ids, prompt_ids[:5]],
                                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    texts = [engine.tokenizer.decode(r.token_ids) for r in references]
    assert [c.text for c in batch.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert batch.usage.prompt_tokens == len(prompt_ids) + 5 and batch.usage.completion_tokens == 16


def test_best_of_returns_the_candidates_with_the_highest_mean_logprob(served) -> None:
    _, client = served
    model = _model(client)
    best = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3, best_of=4,
                                     n=2, logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 4 * 5  # every candidate was generated
    means = [sum(c.logprobs.token_logprobs) / 5 for c in best.choices]
    assert means[0] >= means[1]
    # The candidates are choices 0..3 of the same request with n=4: the best two are among them.
    every = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3, n=4,
                                      logprobs=0, extra_body={"ignore_eos": True})
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]


def test_penalties_and_logit_bias(served, engine: LLMEngine) -> None:
    _, client = served
    model = _model(client)
    forced = engine.tokenizer.encode(" banana")[-1]
    biased = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(forced): 100}, logprobs=0, extra_body=TOKEN_IDS)
    assert _ids(biased.choices[0].logprobs.tokens) == [forced] * 4
    prompt_ids = engine.tokenizer.encode(PROMPT)
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    reference = engine.generate([prompt_ids], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                             **penalties))[0]
    penalised = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True, **TOKEN_IDS}, **penalties)
    assert _ids(penalised.choices[0].logprobs.tokens) == reference.token_ids


def test_json_schema_output_parses_and_validates(served) -> None:
    _, client = served
    model = _model(client)
    schema = {"type": "object",
              "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                             "capital": {"type": "boolean"}},
              "required": ["city", "capital"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    for seed in (None, 1, 2):
        answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40,
                                                temperature=0 if seed is None else 1.0, seed=seed,
                                                response_format=response_format)
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0,
                                            response_format=response_format, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}})
    assert info.value.body["param"] == "response_format"


def test_unsupported_fields_are_400_naming_them(served) -> None:
    _, client = served
    model = _model(client)
    for kwargs, param in [({"tools": [{"type": "file_search", "function": {"name": "f"}}]}, "tools[0].type"),
                          ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
                          ({"top_logprobs": 3}, "top_logprobs"), ({"store": True}, "store")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, **kwargs)
        assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, suffix="end")
    assert info.value.body["param"] == "suffix"
