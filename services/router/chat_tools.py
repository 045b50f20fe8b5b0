"""Tool calling at the door: OpenAI's ``tools``, ``tool_choice`` and tool turns in the history, checked and made
into what the chat template and the grammar need.

The shapes are OpenAI's. A tool is ``{"type": "function", "function": {"name", "description", "parameters"}}``;
``tool_choice`` is ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``.
History: an assistant turn may carry ``tool_calls`` (its arguments a JSON text, as the API returns them: the
template gets them as an object, as Hugging Face templates expect), a ``tool`` turn a ``tool_call_id``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from services.router.errors import InvalidRequest

# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICE_MODES = ("none", "auto", "required")
# OpenAI documents a limit of 128 tools per request.
MAX_TOOLS = 128


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct):
    type: str
    function: FunctionDef

    def as_template_dict(self) -> dict[str, Any]:
        """The tool as chat templates and the parsers read it (missing parameters: any object)."""
        function = {"name": self.function.name, "parameters": self.parameters()}
        if self.function.description is not None:
            function["description"] = self.function.description
        return {"type": "function", "function": function}

    def parameters(self) -> dict[str, Any]:
        return self.function.parameters if self.function.parameters is not None else {"type": "object"}


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    type: str
    function: NamedFunction


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str = "{}"


class ToolCallIn(msgspec.Struct):
    """An assistant turn's call, as the API returned it and the client sends it back."""

    function: CalledFunction
    id: str | None = None
    type: str = "function"


Tools = Annotated[list[ToolDef], Meta(max_length=MAX_TOOLS)]
ToolChoice = str | NamedToolChoice


def check_tools(tools: list[ToolDef] | None, tool_choice: ToolChoice | None) -> None:
    """400 naming the field when a tool or the choice is not usable."""
    names = set()
    for i, tool in enumerate(tools or ()):
        if tool.type != "function":
            raise InvalidRequest(f"tools[{i}].type must be 'function', got {tool.type!r}", param=f"tools[{i}].type")
        name = tool.function.name
        if not _FUNCTION_NAME.fullmatch(name):
            raise InvalidRequest(f"tools[{i}].function.name {name!r} must be 1-64 letters, digits, '_' or '-'",
                                 param=f"tools[{i}].function.name")
        if name in names:
            raise InvalidRequest(f"tools[{i}].function.name {name!r} is given twice", param="tools")
        names.add(name)
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            raise InvalidRequest(f"tool_choice must be one of {TOOL_CHOICE_MODES} or a named function, "
                                 f"got {tool_choice!r}", param="tool_choice")
        if tool_choice == "required" and not names:
            raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
    elif tool_choice is not None:
        if tool_choice.type != "function":
            raise InvalidRequest(f"tool_choice.type must be 'function', got {tool_choice.type!r}",
                                 param="tool_choice")
        if tool_choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names function {tool_choice.function.name!r}, which is not in tools",
                                 param="tool_choice")


def tool_mode(tools: list[ToolDef] | None, tool_choice: ToolChoice | None) -> str:
    """``none`` (no tools or turned off), ``auto``, ``required`` or ``named``; OpenAI's default is ``auto``."""
    if not tools or tool_choice == "none":
        return "none"
    if tool_choice is None:
        return "auto"
    return tool_choice if isinstance(tool_choice, str) else "named"


def offered_tools(tools: list[ToolDef] | None, tool_choice: ToolChoice | None) -> list[dict[str, Any]]:
    """The tools a call may name: all of them, or the one named by ``tool_choice``."""
    named = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
    return [t.as_template_dict() for t in tools or () if named is None or t.function.name == named]


def template_tool_calls(calls: list[ToolCallIn], index: int) -> list[dict[str, Any]]:
    """An assistant turn's calls as templates read them: arguments as an object (400 if they are not JSON)."""
    out = []
    for j, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
        except ValueError:
            raise InvalidRequest(f"messages[{index}].tool_calls[{j}].function.arguments is not JSON",
                                 param=f"messages[{index}].tool_calls[{j}].function.arguments") from None
        entry: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        if call.id is not None:
            entry["id"] = call.id
        out.append(entry)
    return out
