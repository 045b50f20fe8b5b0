"""Structured output (response_format): llguidance grammars masking SmolLM2's tokens, in the engine and at the door."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.contract.sampling_params import SamplingParams, StructuredSpec
from services.contract.structured import StructuredOutputError, check_spec
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.router.errors import InvalidRequest
from services.router.protocol import ChatCompletionRequest, CompletionRequest, decode_request, to_sampling_params

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                         "capital": {"type": "boolean"},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "capital", "rank"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=None, device="cpu", dtype="float32", num_kv_blocks=256))


@pytest.fixture(scope="module")
def prompt(engine: LLMEngine) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)


def _schema_spec(schema: dict = SCHEMA) -> StructuredSpec:
    return StructuredSpec("json_schema", json.dumps(schema))


def test_invalid_schemas_are_refused_by_name() -> None:
    with pytest.raises(StructuredOutputError, match="schema"):
        check_spec(_schema_spec({"type": "objectx"}))
    with pytest.raises(ValueError, match="JSON text"):
        StructuredSpec("json_schema", "{not json").validate()
    with pytest.raises(ValueError, match="kind"):
        SamplingParams(structured=StructuredSpec("yaml"))


def test_greedy_schema_output_parses_validates_and_stops(engine: LLMEngine, prompt: list[int]) -> None:
    out = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, structured=_schema_spec()))[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_sampled_rows_obey_their_grammar_and_free_rows_are_untouched(engine: LLMEngine, prompt: list[int]) -> None:
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = engine.generate([prompt], free)[0].token_ids
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s, structured=_schema_spec()) for s in range(3)]
    params.append(SamplingParams(max_tokens=48, temperature=0.0, structured=StructuredSpec("json_object")))
    outs = engine.generate([prompt] * 5, [*params, free])
    for out in outs[:3]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert outs[3].text.startswith("{")
    if outs[3].finish_reason == "stop":
        assert isinstance(json.loads(outs[3].text), dict)
    assert outs[4].token_ids == alone  # a row without a grammar is not masked


def test_a_grammar_started_past_a_first_token_continues_the_same_document(engine: LLMEngine,
                                                                            prompt: list[int]) -> None:
    """The decode worker's cases: the first token came with pulled KV, or is recomputed as part of the prompt."""
    params = SamplingParams(max_tokens=64, temperature=0.0, structured=_schema_spec())
    whole = engine.generate([prompt], params)[0].token_ids
    rest = SamplingParams(max_tokens=63, temperature=0.0, structured=_schema_spec())
    grammar = engine.grammars.matcher(rest.structured, prefix=whole[:1])
    engine.add_request("recomputed", [*prompt, whole[0]], rest, grammar=grammar)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() if o.request_id == "recomputed" for t in o.new_token_ids]
    assert tokens == whole[1:]
    pulled = engine.add_request_with_external_kv("pulled", prompt, params)
    assert pulled is not None
    with pytest.raises(ValueError, match="does not continue"):
        engine.complete_external_kv("pulled", engine.tokenizer.encode("hello")[0])
    engine.complete_external_kv("pulled", whole[0])
    engine.abort_request("pulled")
    while engine.has_unfinished_requests():
        engine.step()


def test_router_turns_response_format_into_the_worker_spec() -> None:
    body = {"messages": QUESTION, "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "answer", "schema": SCHEMA}}}
    request = decode_request(json.dumps(body).encode(), ChatCompletionRequest)
    params = to_sampling_params(request, max_tokens=8)
    assert params.structured_output.kind == "json_schema"
    assert json.loads(params.structured_output.schema) == SCHEMA
    completion = decode_request(json.dumps({"prompt": "x", "response_format": {"type": "json_object"}}).encode(),
                                CompletionRequest)
    assert to_sampling_params(completion, 4).structured_output.kind == "json_object"
    text = decode_request(json.dumps({"prompt": "x", "response_format": {"type": "text"}}).encode(), CompletionRequest)
    assert not to_sampling_params(text, 4).HasField("structured_output")


@pytest.mark.parametrize("response_format", [
    {"type": "yaml"},
    {"type": "json_schema"},
    {"type": "json_object", "json_schema": {"name": "x", "schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
    {"type": "json_schema", "json_schema": {"schema": {}}},
])
def test_bad_response_formats_are_400_naming_it(response_format: dict) -> None:
    body = json.dumps({"messages": QUESTION, "response_format": response_format}).encode()
    with pytest.raises(InvalidRequest) as info:
        decode_request(body, ChatCompletionRequest)
    assert info.value.param.startswith("response_format")
