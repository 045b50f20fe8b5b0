"""A request's tools as one llguidance grammar: what ``tool_choice`` allows, in the model's own call format.

The router sends the result as a ``StructuredSpec("grammar", ...)``; workers compile it like any other. The
grammar text depends on the tokenizer only through which markers are tokens of their own (``special_tokens``:
``added_tokens(tokenizer.backend_json())``, computed once per tokenizer): llguidance matches an added token only
by reference, never by its text, so a grammar written for the wrong tokenizer refuses the marker.

Modes (the formats' syntax: ``services.contract.tool_formats``):

- "required": the output is one call, or with ``parallel`` one or more, each naming one of the tools with
  arguments valid against its ``parameters`` (a missing schema is ``{"type": "object"}``);
- "named": the same, every call naming ``function``;
- "auto": free text, and after the format's trigger valid calls only. Lazy where the trigger is text (a lexeme
  that ends at the first trigger), two lexemes where it is a special token; for Llama-3 JSON (calls only as the
  whole answer) and harmony (calls in message headers) the grammar follows how the parser reads the answer.

A grammar starts at the first generated token: for a model that thinks first (``<think>``) the router puts the
reasoning before it (``services.contract.reasoning_grammar``; harmony's analysis messages are in its grammar).
What the grammars do not do: Qwen3-Coder string
values keep ``enum``/``const`` and length bounds only (no ``pattern`` or ``format``); values of a parameter
without a type are free text. Keywords llguidance does not implement are ignored (``lark_text.JSON_OPTIONS``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import llguidance

from services.contract.lark_text import LarkWriter, added_tokens
from services.contract.structured import StructuredOutputError
from services.contract.tool_formats import FORMAT_WRITERS, Tool

MODES = ("auto", "required", "named")
TOOL_GRAMMAR_FORMATS = tuple(sorted(FORMAT_WRITERS))
_NAME_FORBIDDEN = set("<>[]{}\"'\\")

__all__ = ["MODES", "TOOL_GRAMMAR_FORMATS", "added_tokens", "read_tools", "tool_call_grammar"]


def tool_call_grammar(tools: Sequence[dict], fmt: str, mode: str, parallel: bool, *, function: str | None = None,
                      special_tokens: Mapping[str, int] | None = None) -> str:
    """Grammar text for calls of ``tools`` (OpenAI ``tools`` entries) in format ``fmt`` under ``mode``.

    ``function``: the name "named" mode calls. ``special_tokens``: the tokenizer's added tokens (text -> id).
    StructuredOutputError for an unknown format or mode, a bad tool list, or schemas llguidance cannot use.
    """
    if fmt not in FORMAT_WRITERS:
        known = ", ".join(TOOL_GRAMMAR_FORMATS)
        raise StructuredOutputError(f"no tool-call grammar for format {fmt!r}; known: {known}")
    if mode not in MODES:
        raise StructuredOutputError(f"tool-call mode {mode!r} is not one of {', '.join(MODES)}")
    chosen = read_tools(tools)
    if mode == "named":
        chosen = [t for t in chosen if t.name == function]
        if not chosen:
            raise StructuredOutputError(f"tool_choice names {function!r}, which is not among the tools")
    if not chosen:
        raise StructuredOutputError("a tool-call grammar needs at least one function tool")
    writer = LarkWriter(special_tokens or {})
    FORMAT_WRITERS[fmt](writer, chosen, mode, parallel)
    grammar = writer.text()
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(f"the tools' schemas cannot be used: {error}")
    return grammar


def read_tools(tools: Sequence[dict]) -> list[Tool]:
    """The function tools (``{"type": "function", "function": {...}}``) with their arguments' schemas."""
    read: list[Tool] = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise StructuredOutputError(f"tools[{index}] is not a function tool")
        name = function.get("name")
        if not isinstance(name, str) or not name or any(c.isspace() or c in _NAME_FORBIDDEN for c in name):
            raise StructuredOutputError(f"tools[{index}]: {name!r} cannot be a function name in a call's text")
        if any(t.name == name for t in read):
            raise StructuredOutputError(f"tools[{index}]: the function {name!r} is declared twice")
        read.append(Tool(name, _arguments_schema(index, function.get("parameters"))))
    return read


def _arguments_schema(index: int, parameters: object) -> dict:
    """An object schema: missing parameters are any object, and a schema without a type is made an object's."""
    if parameters is None:
        return {"type": "object"}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise StructuredOutputError(f"tools[{index}]: parameters must be a JSON schema of an object")
    return {"type": "object", **parameters}
