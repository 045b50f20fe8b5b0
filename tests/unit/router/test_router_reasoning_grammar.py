"""A ``<think>`` model's planned grammar: the tool choice's or response_format's, after the reasoning.

The tiny model's template here ends the prompt with ``<think>\\n`` (as Qwen3's thinking models and DeepSeek-R1's do)
and its tokenizer has ``<think>``/``</think>`` as added tokens, so the grammar names them by id.
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import msgspec
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from services.router.chat_output import resolve_formats
from services.router.chat_plan import chat_plan
from services.router.protocol import ChatCompletionRequest, decode_request
from services.router.tokenizing import load_tokenizer
from services.text.tokenizer import Tokenizer
from tests.unit.router._router_model import write_tiny_model_dir

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    "{# an answer's reasoning ends with </think> #}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory) -> Tokenizer:
    directory = write_tiny_model_dir(tmp_path_factory.mktemp("tiny-thinking-model"), THINKING_TEMPLATE)
    path = Path(directory, "tokenizer.json")
    backend = BackendTokenizer.from_file(str(path))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<think>", "</think>")])
    backend.save(str(path))
    return load_tokenizer(str(directory))


def _chat(**extra) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], **extra}
    return decode_request(msgspec.json.encode(body), ChatCompletionRequest)


def _accepts(tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    backend = tokenizer.backend_json()
    n_vocab = BackendTokenizer.from_str(backend).get_vocab_size(with_added_tokens=True)
    lltok = llguidance.LLTokenizer(backend, n_vocab=n_vocab, eos_token=sorted(tokenizer.eos_token_ids))
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(lltok.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_tool_grammar_follows_the_open_reasoning(thinking_tokenizer: Tokenizer, choice) -> None:
    formats = resolve_formats(thinking_tokenizer)
    assert formats.reasoning_format == "think"
    plan = chat_plan(_chat(tools=[TOOL], tool_choice=choice), thinking_tokenizer, formats)
    prompt = thinking_tokenizer.decode(plan.prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<think>\n") and plan.grammar.kind == "grammar"
    reasoning, answer = json.loads(plan.grammar.schema)["grammars"]
    assert f"<[{formats.special_tokens['</think>']}]>" in reasoning["lark_grammar"]
    assert "get_weather" in answer["lark_grammar"]
    assert _accepts(thinking_tokenizer, plan.grammar.schema, f"Paris, so get_weather.</think>\n\n{CALL}")
    if choice != "auto":  # the call must come after the reasoning, never in place of it
        assert not _accepts(thinking_tokenizer, plan.grammar.schema, "Paris.</think>\n\nIt is sunny.")


def test_response_format_follows_the_reasoning_too(thinking_tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"]}
    request = _chat(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    plan = chat_plan(request, thinking_tokenizer, resolve_formats(thinking_tokenizer))
    assert plan.grammar is not None and plan.grammar.kind == "grammar"
    assert _accepts(thinking_tokenizer, plan.grammar.schema, 'It is June.</think>\n\n{"sunny":true}')
    assert not _accepts(thinking_tokenizer, plan.grammar.schema, 'It is June.</think>\n\n{"sunny":"yes"}')
    # no tools and no response_format: nothing to constrain
    assert chat_plan(_chat(), thinking_tokenizer, resolve_formats(thinking_tokenizer)).grammar is None


def test_without_a_reasoning_format_the_grammar_is_the_tools_alone(tokenizer: Tokenizer) -> None:
    plan = chat_plan(_chat(tools=[TOOL], tool_choice="required"), tokenizer, resolve_formats(tokenizer))
    assert plan.grammar.kind == "grammar" and not plan.grammar.schema.startswith("{")

