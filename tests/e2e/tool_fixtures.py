"""The function tools the tool-calling e2e tests offer: a weather lookup and an adder, in OpenAI's shape.

The bounds are parameters: the bundled SmolLM2 gets room to write a real city, a random checkpoint short strings
and small numbers, so that its grammar-driven calls end well inside the token limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def weather_tool(city_max_length: int) -> dict[str, Any]:
    """``get_weather(city, unit)``: a bounded city name and a unit enum, nothing else."""
    return {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object",
                           "properties": {"city": {"type": "string", "maxLength": city_max_length},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                           "required": ["city", "unit"], "additionalProperties": False},
        },
    }


def add_tool(minimum: int | None = None, maximum: int | None = None) -> dict[str, Any]:
    """``add(a, b)``: two integers, each within ``[minimum, maximum]`` where given."""
    integer: dict[str, Any] = {"type": "integer"}
    if minimum is not None:
        integer["minimum"] = minimum
    if maximum is not None:
        integer["maximum"] = maximum
    return {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": dict(integer), "b": dict(integer)},
                           "required": ["a", "b"], "additionalProperties": False},
        },
    }


def tool_schemas(tools: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's parameter schema by its name: what a call's arguments must validate against."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}
