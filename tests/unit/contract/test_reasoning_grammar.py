"""Grammars after ``<think>`` reasoning: the reasoning is free, then only the answer's grammar (calls, JSON).

SmolLM2's vocabulary twice: with every marker as text, and with ``<think>``, ``</think>`` and Hermes' markers added
as special tokens (as Qwen3's tokenizer has them). What the matcher lets through is read as the router reads it:
the think reasoning parser first, then the tool-call parser on the content.
"""

from __future__ import annotations

import functools
import json

import jsonschema
import llguidance
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from services.contract.reasoning_grammar import ANSWER, think_then
from services.contract.sampling_params import StructuredSpec
from services.contract.structured import StructuredOutputError
from services.contract.tool_formats import TOOL_CALL, TOOL_CALL_END
from services.contract.tool_grammar import added_tokens, tool_call_grammar
from services.text.default_model import default_model_path
from services.text.reasoning.base import parse_reasoning
from services.text.reasoning.think import THINK_END, THINK_START, ThinkReasoningParser
from services.text.tokenizer import Tokenizer
from services.text.tool_calls import parse_all, tool_call_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER]
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":3}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


@functools.cache
def vocab(markers: bool) -> tuple[llguidance.LLTokenizer, dict[str, int], frozenset[int]]:
    """(the llguidance tokenizer, its added tokens, its EOS ids)."""
    tokenizer = Tokenizer.from_gguf(default_model_path())
    backend = BackendTokenizer.from_str(tokenizer.backend_json())
    if markers:
        backend.add_special_tokens([AddedToken(m, special=True, normalized=False)
                                    for m in (THINK_START, THINK_END, TOOL_CALL, TOOL_CALL_END)])
    text = backend.to_str()
    eos = sorted(tokenizer.eos_token_ids)
    lltok = llguidance.LLTokenizer(text, n_vocab=backend.get_vocab_size(with_added_tokens=True), eos_token=eos)
    return lltok, added_tokens(text), frozenset(eos)


def _tools_spec(mode: str, special: dict[str, int]) -> StructuredSpec:
    return StructuredSpec("grammar", tool_call_grammar(TOOLS, "hermes", mode, False, function="get_weather",
                                                       special_tokens=special))


def _matcher(markers: bool, answer: StructuredSpec, starts_in_reasoning: bool) -> llguidance.LLMatcher:
    lltok, special, _ = vocab(markers)
    matcher = llguidance.LLMatcher(lltok, think_then(answer, starts_in_reasoning, special).schema)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _accepts(markers: bool, matcher: llguidance.LLMatcher, text: str) -> bool:
    return matcher.consume_tokens(vocab(markers)[0].tokenize_str(text)) and matcher.is_accepting()


def _read(text: str, starts_in_reasoning: bool) -> tuple[str, str, list]:
    """(reasoning, content, calls) as the router reads the answer."""
    reasoning, content = parse_reasoning(ThinkReasoningParser(starts_in_reasoning), text)
    content, calls = parse_all(tool_call_parser("hermes")(TOOLS), content)
    return reasoning, content, calls


def _walk(markers: bool, matcher: llguidance.LLMatcher, seed: int) -> str:
    """Random allowed tokens until the matcher stops; after a while ``</think>`` where it may follow (a random walk
    would never spell it), and later special tokens first."""
    lltok, _, eos = vocab(markers)
    rng, tokens = np.random.default_rng(seed), []
    close = lltok.tokenize_str(THINK_END)
    for step in range(800):
        if step == 30 and matcher.validate_tokens(close) == len(close):
            assert matcher.consume_tokens(close), matcher.get_error()
            tokens += close
        if matcher.is_stopped():
            return lltok.decode_bytes([t for t in tokens if t not in eos]).decode()
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                                               bitorder="little")[:lltok.vocab_size])
        assert len(allowed), "a dead end: nothing may follow"
        urgent = [t for t in allowed if lltok.is_special_token(int(t))] if step > 100 else []
        token = int(rng.choice(urgent or allowed))
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    raise AssertionError("the walk did not end in 800 tokens")


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("mode", ["required", "named", "auto"])
@pytest.mark.parametrize("between", ["", "\n", "\n\n"])
def test_reasoning_then_a_call_is_accepted_and_read(markers: bool, mode: str, between: str) -> None:
    text = f"The user wants Paris.\nI'll call get_weather {{\"city\": 1}} </tool>.{THINK_END}{between}{CALL}"
    assert _accepts(markers, _matcher(markers, _tools_spec(mode, vocab(markers)[1]), True), text)
    reasoning, content, calls = _read(text, True)
    assert reasoning.startswith("The user wants Paris.") and content.strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("mode", ["required", "auto"])
def test_without_an_open_think_the_block_is_optional(markers: bool, mode: str) -> None:
    spec = _tools_spec(mode, vocab(markers)[1])
    assert _accepts(markers, _matcher(markers, spec, False), CALL)
    assert _accepts(markers, _matcher(markers, spec, False), f"{THINK_START}\nParis.\n{THINK_END}\n\n{CALL}")
    if mode == "required":  # no reasoning and no call: refused
        assert not _accepts(markers, _matcher(markers, spec, False), "Sure, one moment.")


@pytest.mark.parametrize("markers", [False, True])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reasoning=st.text(st.characters(max_codepoint=0x7FF, exclude_categories=("Cs", "Cn", "Cc"),
                                       include_characters="\n"), max_size=60))
def test_with_an_open_think_the_text_before_it_closes_is_free(markers: bool, reasoning: str) -> None:
    if THINK_END in reasoning:
        reasoning = reasoning.replace(THINK_END, "")
    matcher = _matcher(markers, _tools_spec("required", vocab(markers)[1]), True)
    assert matcher.consume_tokens(vocab(markers)[0].tokenize_str(reasoning)), matcher.get_error()
    assert not matcher.is_accepting()  # no stopping in the reasoning: the call must follow
    assert _accepts(markers, matcher, f"{THINK_END}\n\n{CALL}")


@pytest.mark.parametrize("markers", [False, True])
def test_after_think_closes_only_the_answer_grammar(markers: bool) -> None:
    spec = _tools_spec("required", vocab(markers)[1])
    for answer in ("Sure, one moment.", f"{THINK_END}{CALL}", '<tool_call>\n{"name":"other","arguments":{}}'):
        assert not _accepts(markers, _matcher(markers, spec, True), f"Paris.{THINK_END}\n\n{answer}"), answer
    assert not _accepts(markers, _matcher(markers, spec, True), f"Paris.{THINK_END}\n\n\n\n{CALL}")  # 2 newlines


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("starts_in_reasoning", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_walks_reason_then_call(markers: bool, starts_in_reasoning: bool, seed: int) -> None:
    matcher = _matcher(markers, _tools_spec("required", vocab(markers)[1]), starts_in_reasoning)
    text = _walk(markers, matcher, seed)
    _, content, calls = _read(text, starts_in_reasoning)
    assert len(calls) == 1 and content.strip() == "", text
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_a_json_schema_answer_after_reasoning_validates(markers: bool, seed: int) -> None:
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    text = _walk(markers, _matcher(markers, spec, True), seed)
    reasoning, content = parse_reasoning(ThinkReasoningParser(True), text)
    jsonschema.validate(json.loads(content), SCHEMA)
    written = f'Think.{THINK_END}\n\n{{"answer":"yes","sure":true}}'
    assert _accepts(markers, _matcher(markers, spec, True), written)
    assert not _accepts(markers, _matcher(markers, spec, True), f'Think.{THINK_END}\n\n{{"answer":1}}')


@pytest.mark.parametrize("markers", [False, True])
def test_a_json_object_answer_may_follow_a_think_block(markers: bool) -> None:
    spec = StructuredSpec("json_object")
    assert _accepts(markers, _matcher(markers, spec, False), f'{THINK_START}Hm.{THINK_END}\n\n{{"a":[1]}}')
    assert _accepts(markers, _matcher(markers, spec, False), '{"a":[1]}')
    assert not _accepts(markers, _matcher(markers, spec, False), f"{THINK_START}Hm.{THINK_END}\n\nplain")


def test_the_answer_is_a_named_grammar_and_the_markers_tokens_by_id() -> None:
    _, special, _ = vocab(True)
    grammars = json.loads(think_then(StructuredSpec("json_object"), True, special).schema)["grammars"]
    assert grammars[1]["name"] == ANSWER and f"@{ANSWER}" in grammars[0]["lark_grammar"]
    assert f"<[{special[THINK_END]}]>" in grammars[0]["lark_grammar"]


def test_unusable_answers_are_refused() -> None:
    with pytest.raises(StructuredOutputError):
        think_then(StructuredSpec("json_schema", json.dumps({"type": "nonsense"})), True)
    two = json.dumps({"grammars": [{"lark_grammar": "start: @x"}, {"name": "x", "lark_grammar": 'start: "x"'}]})
    with pytest.raises(StructuredOutputError, match="several grammars"):
        think_then(StructuredSpec("grammar", two), True)
