"""The router's tool-calling and Responses plumbing without workers: request checks, the rendered prompt, the
chat answer's pieces (reasoning, content, calls) and the Responses events, each joined as a client would."""

from __future__ import annotations

import json

import msgspec
import pytest

from services.router.answers import ChatAnswer
from services.router.chat_output import ChatFormats, chat_output, resolve_formats
from services.router.chat_plan import chat_plan, hermes_messages
from services.router.errors import InvalidRequest
from services.router.generation import Delta
from services.router.protocol import ChatCompletionRequest, decode_request
from services.router.responses import Usage
from services.router.responses_answer import ResponsesAnswer
from services.router.responses_request import decode_responses_request

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = ('<think>Need weather.</think>Checking.<tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Paris"}}\n</tool_call>')
USAGE = Usage(10, 5, 15)


def _chat(**extra) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], **extra}
    return decode_request(msgspec.json.encode(body), ChatCompletionRequest)


def _deltas(text: str, size: int) -> list[Delta]:
    parts = [text[i:i + size] for i in range(0, len(text), size)]
    return [Delta(p, (), (), "stop" if i == len(parts) - 1 else None) for i, p in enumerate(parts)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_chat_answer_splits_reasoning_content_and_calls_the_same_way_however_streamed(size: int) -> None:
    formats = ChatFormats("hermes", "think", False)
    request = _chat(tools=[TOOL])
    answer = ChatAnswer("chatcmpl-1", "m", request, None, lambda: chat_output(formats, [TOOL], False))
    chunks = [c for d in _deltas(CALL_TEXT, size) for c in answer.chunks(0, d)]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].delta.content)
    reasoning = "".join(c.choices[0].delta.reasoning_content for c in chunks
                        if c.choices[0].delta.reasoning_content is not msgspec.UNSET)
    calls = [t for c in chunks if c.choices[0].delta.tool_calls is not msgspec.UNSET
             for t in c.choices[0].delta.tool_calls]
    assert (reasoning, content) == ("Need weather.", "Checking.")
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads("".join(t.function.arguments for t in calls)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = ChatAnswer("chatcmpl-1", "m", request, None, lambda: chat_output(formats, [TOOL], False))
    body = whole.full({0: Delta(CALL_TEXT, (), (), "stop")}, USAGE)
    message = body.choices[0].message
    assert (message.content, message.reasoning_content, message.reasoning) == ("Checking.", "Need weather.",
                                                                               "Need weather.")
    assert message.tool_calls[0].function.name == "get_weather" and body.choices[0].finish_reason == "tool_calls"


HARMONY_CALL_TEXT = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary"
                     "<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
                     '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_harmony_with_tool_choice_none_answers_without_calls(size: int) -> None:
    """gpt-oss may still write a call when none is allowed: it is dropped (no tool_calls, finish_reason stop);
    the preamble stays content and the analysis reasoning, streamed or not."""
    formats = ChatFormats("harmony", "harmony", True)
    request = _chat(tools=[TOOL], tool_choice="none")
    assert "tools" not in request.template_vars()
    answer = ChatAnswer("chatcmpl-1", "m", request, None, lambda: chat_output(formats, None, False))
    chunks = [c for d in _deltas(HARMONY_CALL_TEXT, size) for c in answer.chunks(0, d)]
    assert all(c.choices[0].delta.tool_calls is msgspec.UNSET for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    assert chunks[-1].choices[0].finish_reason == "stop"
    whole = ChatAnswer("chatcmpl-1", "m", request, None, lambda: chat_output(formats, None, False))
    body = whole.full({0: Delta(HARMONY_CALL_TEXT, (), (), "stop")}, USAGE)
    message = body.choices[0].message
    assert (message.content, message.reasoning_content) == ("Checking.", "Need weather.")
    assert b"tool_calls" not in msgspec.json.encode(body) and body.choices[0].finish_reason == "stop"
    offered = ChatAnswer("chatcmpl-1", "m", request, None, lambda: chat_output(formats, [TOOL], False))
    called = offered.full({0: Delta(HARMONY_CALL_TEXT, (), (), "stop")}, USAGE)
    assert called.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_plain_text_is_untouched_without_tools_or_formats() -> None:
    answer = ChatAnswer("chatcmpl-1", "m", _chat(), None)
    body = answer.full({0: Delta(CALL_TEXT, (), (), "stop")}, USAGE)
    assert body.choices[0].message.content == CALL_TEXT and body.choices[0].finish_reason == "stop"
    assert b"tool_calls" not in msgspec.json.encode(body)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
])
def test_bad_tool_fields_are_400_naming_them(extra: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _chat(**extra)
    assert caught.value.param == param


def test_history_and_tools_reach_the_template_hermes_way_when_it_has_none(tokenizer) -> None:
    request = _chat(tools=[TOOL], tool_choice="auto", messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"}])
    messages = hermes_messages(request.template_messages(), request.template_vars()["tools"])
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in messages[2]["content"]
    assert messages[3] == {"role": "user", "content": "<tool_response>\ncold\n</tool_response>"}
    formats = resolve_formats(tokenizer)
    plan = chat_plan(request, tokenizer, formats)
    prompt = tokenizer.decode(plan.prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and "<tool_response>" in prompt and plan.keep_special_tokens
    with pytest.raises(InvalidRequest, match="not JSON"):
        _chat(messages=[{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]).template_messages()


def test_responses_input_items_become_chat_turns() -> None:
    request = decode_responses_request(msgspec.json.encode({
        "instructions": "Be brief.", "max_output_tokens": 9, "tools": [{"type": "function", **TOOL["function"]}],
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                  {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city":"Rome"}'},
                  {"type": "function_call_output", "call_id": "call_9", "output": "warm"}]}))
    chat = request.to_chat()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[2].tool_calls[0].id == "call_9" and chat.messages[3].tool_call_id == "call_9"
    assert chat.max_completion_tokens == 9 and chat.response_format.type == "json_schema"
    assert chat.tools[0].function.name == "get_weather"
    for body, param in [({"input": "x", "previous_response_id": "r"}, "previous_response_id"),
                        ({"input": "x", "store": True}, "store"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"input": [{"type": "image", "url": "u"}]}, "input[0].type")]:
        with pytest.raises(InvalidRequest) as caught:
            decode_responses_request(msgspec.json.encode(body)).to_chat()
        assert caught.value.param == param


@pytest.mark.parametrize("size", [2, 1000])
def test_responses_events_build_the_same_output_as_the_whole_answer(size: int) -> None:
    formats = ChatFormats("hermes", "think", False)
    request = decode_responses_request(msgspec.json.encode({"input": "Weather?", "tools": [
        {"type": "function", **TOOL["function"]}]}))
    streamed = ResponsesAnswer("resp-1", "m", request, lambda: chat_output(formats, [TOOL], False))
    events = [e for d in _deltas(CALL_TEXT, size) for e in streamed.chunks(0, d)]
    events.append(streamed.usage_chunk(USAGE))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Checking."
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"} == json.loads(final["output"][2]["arguments"])
    whole = ResponsesAnswer("resp-1", "m", request, lambda: chat_output(formats, [TOOL], False))
    body = whole.full({0: Delta(CALL_TEXT, (), (), "stop")}, USAGE)
    strip = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in body["output"]]
    assert strip == [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in final["output"]]
    assert body["usage"]["total_tokens"] == 15 and body["status"] == "completed"
