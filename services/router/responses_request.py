"""``POST /v1/responses`` bodies, the stateless subset the SDKs use, read as the chat request they amount to.

``input`` is a text (one user turn) or items: messages (``input_text`` / ``output_text`` parts), earlier
``function_call`` items and their ``function_call_output``; ``instructions`` is a system turn before them; function
``tools`` and ``tool_choice`` are the chat ones in the Responses shape; ``text.format`` is ``response_format``.
Nothing is stored: ``previous_response_id`` and ``store: true`` are a 400 naming the field, as is any tool that is
not a function (web search, file search, ...).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from services.router.chat_tools import (
    CalledFunction,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolCallIn,
    ToolDef,
)
from services.router.errors import InvalidRequest, decode_json
from services.router.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    PositiveInt,
    ResponseFormat,
)

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ResponsesTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedResponsesTool(msgspec.Struct):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextOptions(msgspec.Struct):
    format: TextFormat | None = None


class ReasoningOptions(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | NamedResponsesTool | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None

    def check(self) -> None:
        if self.previous_response_id is not None:
            raise InvalidRequest("previous_response_id is not supported: pdserve stores no responses; send the "
                                 "whole conversation in input", param="previous_response_id")
        if self.store:
            raise InvalidRequest("store=true is not supported: pdserve stores no responses", param="store")
        if self.truncation not in (None, "disabled"):
            raise InvalidRequest("truncation 'auto' is not supported (only 'disabled')", param="truncation")
        for i, tool in enumerate(self.tools or ()):
            if tool.type != "function" or not tool.name:
                raise InvalidRequest(f"tools[{i}]: only function tools with a name are supported, got type "
                                     f"{tool.type!r}", param=f"tools[{i}].type")

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this amounts to, checked as one (its 400s name the chat fields' counterparts)."""
        messages = ([ChatMessage("system", self.instructions)] if self.instructions else []) + _messages(self.input)
        if not messages:
            raise InvalidRequest("input must not be empty", param="input")
        chat = ChatCompletionRequest(
            messages=messages, model=self.model, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream, user=self.user,
            tools=[ToolDef("function", FunctionDef(t.name or "", t.description, t.parameters, t.strict))
                   for t in self.tools] if self.tools else None,
            tool_choice=_tool_choice(self.tool_choice), parallel_tool_calls=self.parallel_tool_calls,
            response_format=_response_format(self.text), metadata=self.metadata,
            reasoning_effort=self.reasoning.effort if self.reasoning is not None else None)
        chat.check()
        return chat


_DECODER = msgspec.json.Decoder(ResponsesRequest)


def decode_responses_request(body: bytes) -> ResponsesRequest:
    request = decode_json(_DECODER, body)
    request.check()
    return request


def _tool_choice(choice: str | NamedResponsesTool | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                             param="tool_choice")
    return NamedToolChoice("function", NamedFunction(choice.name))


def _response_format(text: TextOptions | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        return ResponseFormat("json_schema", JsonSchemaFormat(fmt.name or "output", fmt.schema, fmt.description,
                                                              fmt.strict))
    return ResponseFormat(fmt.type)


def _messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """Input items as chat turns: consecutive function calls join the assistant turn before them."""
    if isinstance(items, str):
        return [ChatMessage("user", items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, i))
        elif kind == "function_call":
            call = ToolCallIn(CalledFunction(_text_field(item, "name", i), _text_field(item, "arguments", i)),
                              _text_field(item, "call_id", i))
            if out and out[-1].role == "assistant" and (out[-1].tool_calls or not out[-1].text()):
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage("assistant", None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else msgspec.json.encode(output).decode()
            out.append(ChatMessage("tool", text, tool_call_id=_text_field(item, "call_id", i)))
        elif kind != "reasoning":  # an earlier answer's reasoning is not shown to the model again
            raise InvalidRequest(f"input[{i}]: items of type {kind!r} are not supported", param=f"input[{i}].type")
    return out


def _message(item: dict[str, Any], i: int) -> ChatMessage:
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidRequest(f"input[{i}].role must be one of {_ROLES}, got {role!r}", param=f"input[{i}].role")
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"input[{i}].content[{j}]: parts of type {kind!r} are not supported (text only)",
                                     param=f"input[{i}].content[{j}].type")
            parts.append(str(part.get("text") or part.get("refusal") or ""))
        content = "".join(parts)
    if not isinstance(content, str):
        raise InvalidRequest(f"input[{i}].content must be a text or a list of text parts", param=f"input[{i}].content")
    return ChatMessage("system" if role == "developer" else role, content)


def _text_field(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidRequest(f"input[{i}].{name} must be a string", param=f"input[{i}].{name}")
    return value
