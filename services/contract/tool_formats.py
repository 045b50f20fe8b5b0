"""Each tool-call format's syntax as grammar rules: the exact text ``services.text.tool_calls`` parses back.

One writer per format name (the parsers' names). A writer gets the tools a call may name, the mode and whether
several calls may follow each other, and writes ``start``:

- "required" (and "named", with one tool): the whole output is the calls;
- "auto": free text, where the format's trigger starts calls (``<tool_call>``, ``[TOOL_CALLS]``, the DeepSeek
  wrapper) and what follows it is a valid call; the text never contains a trigger as text. Llama-3 JSON calls can
  only be the whole answer (as its parser reads them): text that does not start with ``{`` or calls. Harmony's
  calls live in message headers: any sequence of messages, where a commentary header addressed to
  ``functions.`` must name a tool and carry its arguments.

The markers come from the parsers' modules, so a format's syntax is written once. Compact JSON throughout;
the text between calls is what the models write (a newline, Llama's ``; ``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.contract.lark_text import LarkWriter, quote
from services.text import harmony as hm
from services.text.tool_calls import deepseek_v3 as ds
from services.text.tool_calls import qwen3_coder as qc
from services.text.tool_calls.hermes import HermesToolParser
from services.text.tool_calls.llama3_json import PYTHON_TAG
from services.text.tool_calls.mistral import ARGS, MistralToolParser

TOOL_CALL = HermesToolParser.start_marker
TOOL_CALL_END = HermesToolParser.end_marker
TOOL_CALLS = MistralToolParser.start_marker
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # the names the NAME[ARGS] form can carry
_HARMONY_MARKERS = (hm.START, hm.CHANNEL, hm.MESSAGE, hm.END, hm.CALL, hm.RETURN)


@dataclass(frozen=True)
class Tool:
    """A function a call may name, and the JSON schema its arguments keep (always an object)."""

    name: str
    parameters: dict


def _alternatives(items: list[str]) -> str:
    return items[0] if len(items) == 1 else "(" + " | ".join(items) + ")"


def _json_call(w: LarkWriter, tools: list[Tool], arguments_key: str) -> str:
    """``{"name":"NAME","<arguments_key>":{...}}`` for any of ``tools``."""
    calls = []
    for t in tools:
        head = quote('{"name":' + json.dumps(t.name) + ',"' + arguments_key + '":')
        calls.append(w.rule(f'{head} {w.json(t.parameters)} "}}"'))
    return _alternatives(calls)


@dataclass(frozen=True)
class _MarkerFormat:
    """A format whose calls follow a trigger: ``segment`` writes what follows it (one call, or all of them)."""

    trigger: str
    segment: Callable[[LarkWriter, list[Tool], bool], str]
    joiner: str | None  # between trigger-and-segment repeats; None: one segment holds every call
    excluded: tuple[str, ...]  # what free text may not contain


def _write_marker_format(fmt: _MarkerFormat, w: LarkWriter, tools: list[Tool], mode: str, parallel: bool) -> None:
    segment = fmt.segment(w, tools, parallel)
    repeat = parallel and fmt.joiner is not None
    if mode != "auto":
        one = w.rule(f"{w.marker(fmt.trigger)} {segment}")
        if not repeat:
            w.start(one)
        else:
            w.start(f"{one} ({quote(fmt.joiner)} {one})*" if fmt.joiner else f"{one}+")
        return
    text = w.free_text(fmt.excluded)
    w.start(f"({w.text_then(text, fmt.trigger)} {segment}){'*' if repeat else '?'} {text}")


def _hermes_segment(w: LarkWriter, tools: list[Tool], parallel: bool) -> str:
    return f'"\\n" {_json_call(w, tools, "arguments")} "\\n" {w.marker(TOOL_CALL_END)}'


def _mistral_segment(w: LarkWriter, tools: list[Tool], parallel: bool) -> str:
    """The v3 array (one item unless parallel), or ``NAME[ARGS]{...}`` (v11): the model writes the one it learnt."""
    call = _json_call(w, tools, "arguments")
    forms = [f'"[" {call} ("," {call})* "]"' if parallel else f'"[" {call} "]"']
    named = [t for t in tools if _MISTRAL_NAME.fullmatch(t.name)]
    forms += [f"{quote(t.name)} {w.marker(ARGS)} {w.json(t.parameters)}" for t in named]
    return _alternatives(forms)


def _deepseek_segment(w: LarkWriter, tools: list[Tool], parallel: bool) -> str:
    """After the wrapper: calls in the V3 form (type, name, fenced JSON) or V3.1's (name, bare JSON), then its end."""
    forms = []
    for t in tools:
        arguments, fenced = w.json(t.parameters), quote(t.name + "\n```json\n")
        v3 = f'"function" {w.marker(ds.SEP)} {fenced} {arguments} "\\n```"'
        forms += [v3, f"{quote(t.name)} {w.marker(ds.SEP)} {arguments}"]
    call = w.rule(f"{w.marker(ds.CALL_BEGIN)} {_alternatives(forms)} {w.marker(ds.CALL_END)}")
    return f'{call} ("\\n" {call})* {w.marker(ds.CALLS_END)}' if parallel else f"{call} {w.marker(ds.CALLS_END)}"


def _qwen3_coder_segment(w: LarkWriter, tools: list[Tool], parallel: bool) -> str:
    """``<function=NAME>`` and one ``<parameter=P>`` per argument, in the schema's order, required ones present."""
    functions = []
    for t in tools:
        head, tail = quote("\n" + qc.FUNCTION + t.name + ">\n"), quote(qc.FUNCTION_END + "\n")
        parameters = "".join(f" {p}" for p in _qwen3_parameters(w, t.parameters))
        functions.append(w.rule(f"{head}{parameters} {tail}"))
    return f"{_alternatives(functions)} {w.marker(TOOL_CALL_END)}"


def _qwen3_parameters(w: LarkWriter, schema: dict) -> list[str]:
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        if schema.get("additionalProperties") is False:
            return []
        # A free object: any names, text values (what the parser makes of a parameter it has no type for).
        name = w.terminal(r"/[A-Za-z0-9_.\-]{1,64}/")
        value = w.text_then(w.free_text((qc.PARAMETER_END, qc.FUNCTION_END)), "\n" + qc.PARAMETER_END)
        return [w.rule(f'{quote(qc.PARAMETER)} {name} ">\\n" {value} "\\n"') + "*"]
    required = set(schema.get("required") or ())
    parameters = []
    for name, prop in properties.items():
        head = quote(qc.PARAMETER + name + ">\n")
        rule = w.rule(f'{head} {_qwen3_value(w, prop)} "\\n"')
        parameters.append(rule if name in required else rule + "?")
    return parameters


def _qwen3_value(w: LarkWriter, schema: Any) -> str:
    """A value and its ``\n</parameter>``, as the parser converts it: raw text where the schema's type is a
    string (or none), else JSON. Free text and its end are one lazy lexeme (``text_then``)."""
    end = quote("\n" + qc.PARAMETER_END)
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind not in (None, "string"):
        return f"{w.json(schema)} {end}"
    schema = schema if isinstance(schema, dict) else {}
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return f"{_alternatives([quote(c) for c in choices])} {end}"
    low, high = schema.get("minLength", 0), schema.get("maxLength", "")
    text = w.free_text((qc.PARAMETER_END, qc.FUNCTION_END), pattern=f"(?s:.){{{low},{high}}}")
    return w.text_then(text, "\n" + qc.PARAMETER_END)


_MARKER_FORMATS = {
    "hermes": _MarkerFormat(TOOL_CALL, _hermes_segment, "\n", (TOOL_CALL,)),
    "qwen3_coder": _MarkerFormat(TOOL_CALL, _qwen3_coder_segment, "\n", (TOOL_CALL,)),
    "mistral": _MarkerFormat(TOOL_CALLS, _mistral_segment, "", (TOOL_CALLS,)),
    "deepseek_v3": _MarkerFormat(ds.CALLS_BEGIN, _deepseek_segment, None, (ds.CALLS_BEGIN, ds.CALL_BEGIN)),
}


def _write_llama3_json(w: LarkWriter, tools: list[Tool], mode: str, parallel: bool) -> None:
    """``{"name":...,"parameters":{...}}``, ``; ``-separated, maybe after ``<|python_tag|>``; in auto, or text that
    does not start with ``{`` (nor ``<|python_tag|>``), as the parser reads a whole answer."""
    call = _json_call(w, tools, "parameters")
    calls = w.rule(f"{w.marker(PYTHON_TAG)}? {call}" + (f' ("; " {call})*' if parallel else ""))
    if mode != "auto":
        w.start(calls)
        return
    tag = re.escape(PYTHON_TAG).replace("/", "\\/")
    text = w.terminal(rf"/\s*(?:[^\s{{](?s:.*))?/ & ~/\s*{tag}(?s:.*)/")
    w.start(f"{calls} | {text}")


def _write_harmony(w: LarkWriter, tools: list[Tool], mode: str, parallel: bool) -> None:
    """Messages after the prompt's ``<|start|>assistant``; the grammar ends with the call's JSON, where the model
    writes ``<|call|>`` (a stop token: named in a grammar, llguidance's ``validate_tokens`` refuses it). One call
    per answer whatever ``parallel`` says: generation stops at the first ``<|call|>``."""
    channel, message = w.marker(hm.CHANNEL), w.marker(hm.MESSAGE)
    calls = [w.rule(f'{quote(f"commentary to=functions.{t.name} ")} {w.marker(hm.CONSTRAIN)} "json" {message} '
                    f"{w.json(t.parameters)}") for t in tools]
    body = w.free_text(_HARMONY_MARKERS)
    ended = f"{w.text_then(body, hm.END)} {w.marker(hm.START)} {quote('assistant')} {channel}"
    if mode != "auto":
        w.start(f'{channel} ("analysis" {message} {ended})* {_alternatives(calls)}')
        return
    header = w.terminal("/analysis|final|commentary/")
    w.start(f"{channel} ({header} {message} {ended})* ({header} {message} {body} | {_alternatives(calls)})")


def _writer(fmt: _MarkerFormat) -> Callable[[LarkWriter, list[Tool], str, bool], None]:
    return lambda w, tools, mode, parallel: _write_marker_format(fmt, w, tools, mode, parallel)


#: format name -> writer(writer, tools, mode, parallel), for the formats of ``services.text.tool_calls``.
FORMAT_WRITERS: dict[str, Callable[[LarkWriter, list[Tool], str, bool], None]] = {
    **{name: _writer(fmt) for name, fmt in _MARKER_FORMATS.items()},
    "llama3_json": _write_llama3_json,
    "harmony": _write_harmony,
}
