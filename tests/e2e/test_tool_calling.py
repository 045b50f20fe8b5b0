"""Tool calling, reasoning-free answers and ``/v1/responses`` through the official ``openai`` client, against a
1P1D stack on the bundled SmolLM2 (its template renders no tools: the router lists them the Hermes way and reads
``<tool_call>`` JSON back), every request disaggregated (``--direct-decode-threshold 0``)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.stack import Stack, http_post, pull_totals
from tests.e2e.tool_fixtures import add_tool, tool_schemas, weather_tool

WEATHER = weather_tool(city_max_length=20)
ADD = add_tool()
TOOLS = [WEATHER, ADD]
SCHEMAS = tool_schemas(TOOLS)
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def served(smollm2_stack: Stack) -> tuple[Stack, openai.OpenAI]:
    """The shared SmolLM2 stack (tests/e2e/conftest.py) and a client of it."""
    client = openai.OpenAI(base_url=f"{smollm2_stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return smollm2_stack, client


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _valid(call) -> dict:
    """The call's arguments, checked against its tool's schema."""
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_and_named_calls_validate_streamed_or_not_and_are_pulled(served) -> None:
    s, client = served
    model = _model(client)
    before = pull_totals(s.decode[0])
    answer = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=80)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        _valid(call)
    named = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"] and named.choices[0].finish_reason == "tool_calls"
    assert set(_valid(calls[0])) == {"a", "b"}
    # Streamed: OpenAI's delta shape (id and name on a call's first piece), joined to the same calls.
    pieces = [c.choices[0].delta for c in client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80, stream=True)
        if c.choices]
    streamed: dict[int, list[str]] = {}
    for delta in pieces:
        for piece in delta.tool_calls or ():
            if piece.id is not None:
                streamed[piece.index] = [piece.function.name, ""]
            streamed[piece.index][1] += piece.function.arguments or ""
    assert [v[0] for v in streamed.values()] == [c.function.name for c in choice.message.tool_calls]
    assert [json.loads(v[1]) for v in streamed.values()] == [json.loads(c.function.arguments)
                                                             for c in choice.message.tool_calls]
    after = pull_totals(s.decode[0])
    assert after["pulls"] - before["pulls"] >= 3 and after["recomputed"] == before["recomputed"]


def test_none_and_auto_answer_text_and_a_tool_result_continues(served) -> None:
    _, client = served
    model = _model(client)
    plain = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=16)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    after_tool = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0,
                                                max_tokens=24)
    choice = after_tool.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_bad_tool_requests_are_400_naming_the_field(served) -> None:
    s, _ = served
    cases = [
        ({"tools": [{"type": "code_interpreter", "function": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ]
    for extra, param in cases:
        response = http_post(f"{s.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra},
                             timeout=30)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param


def test_responses_plain_streamed_with_a_tool_and_with_a_schema(served) -> None:
    _, client = served
    model = _model(client)
    plain = client.responses.create(model=model, input="What is the capital of France?", max_output_tokens=12,
                                    temperature=0, instructions="Answer briefly.")
    assert plain.status in ("completed", "incomplete") and plain.output_text
    assert plain.usage.output_tokens <= 12
    events = list(client.responses.create(model=model, input="What is the capital of France?",
                                          max_output_tokens=12, temperature=0, instructions="Answer briefly.",
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    tool = {"type": "function", **WEATHER["function"]}
    called = client.responses.create(model=model, input="Weather in Paris?", tools=[tool], tool_choice="required",
                                     temperature=0, max_output_tokens=80)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    streamed = list(client.responses.create(model=model, input="Weather in Paris?", tools=[tool], temperature=0,
                                            tool_choice="required", max_output_tokens=80, stream=True))
    pieces = [e for e in streamed if e.type == "response.function_call_arguments.delta"]
    arguments = "".join(e.delta for e in pieces if e.item_id == pieces[0].item_id)
    assert json.loads(arguments) == json.loads(calls[0].arguments)
    done = [e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    shaped = client.responses.create(model=model, input="Name a city in France.", max_output_tokens=40,
                                     temperature=0, text={"format": {"type": "json_schema", "name": "city",
                                                                     "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(shaped.output_text), schema)


def test_responses_refuses_state_and_unknown_paths_say_so(served) -> None:
    s, client = served
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=_model(client), input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model=_model(client), input="hi", store=True)
    response = http_post(f"{s.url}/v1/assistants", json={}, timeout=10)
    assert response.status_code == 404
    assert "does not exist" in response.json()["error"]["message"]
