"""Agent frameworks pointed at pdserve unchanged: the ``openai-agents`` SDK, LangChain (``bind_tools`` and
``with_structured_output(method="function_calling")``) and LiteLLM, against a 1P1D stack on the bundled SmolLM2.

Greedy SmolLM2-135M is no planner, so the tests ask for the call (``tool_choice``) where a larger model would
choose it; what is checked is that each framework's own path (its request shapes, its parsing of our answers,
its tool loop) works end to end, and that the arguments it gets validate against the tool's schema.
"""

from __future__ import annotations

import asyncio
import json
import os

import jsonschema
import pytest

from tests.e2e.stack import Stack

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
               "additionalProperties": False}


@pytest.fixture(scope="module")
def served(smollm2_stack: Stack) -> tuple[Stack, str]:
    """The shared SmolLM2 stack (tests/e2e/conftest.py) and the name it serves the model by."""
    import openai

    model = openai.OpenAI(base_url=f"{smollm2_stack.url}/v1", api_key="unused").models.list().data[0].id
    return smollm2_stack, model


def test_openai_agents_calls_a_tool_and_answers(served) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    s, model = served
    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 degrees in {city}."

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        seen.append(city)
        return f"It is noon in {city}."

    client = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
    agent = Agent(name="assistant", instructions="Use the tools to answer.", tools=[get_weather, get_time],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert seen, "the agent never called a tool"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert calls and len(outputs) == len(calls)


def test_langchain_bind_tools_and_function_calling_structured_output(served) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    s, model = served

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model=model, base_url=f"{s.url}/v1", api_key="unused", temperature=0, max_tokens=60,
                     max_retries=0)
    # strict: LangChain closes the schema (additionalProperties false), as OpenAI's strict mode wants.
    bound = llm.bind_tools([get_weather], tool_choice="required", strict=True)
    message = bound.invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], CITY_SCHEMA | {"properties": {"city": {"type": "string"}}})

    class City(BaseModel):
        """A city and its country."""

        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    structured = llm.with_structured_output(City, method="function_calling", strict=True)
    city = structured.invoke("Name the capital of France.")
    assert isinstance(city, City) and city.name


def test_litellm_completion_with_tools(served) -> None:
    import litellm

    s, model = served
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": CITY_SCHEMA}}]
    response = litellm.completion(model=f"openai/{model}", api_base=f"{s.url}/v1", api_key="unused",
                                  messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                                  tool_choice="required", temperature=0, max_tokens=60)
    call = response.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and response.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), CITY_SCHEMA)
    plain = litellm.completion(model=f"openai/{model}", api_base=f"{s.url}/v1", api_key="unused",
                               messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=8)
    assert plain.choices[0].message.content
