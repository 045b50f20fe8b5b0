"""Qwen3-Coder XML tool calls: one ``<parameter=P>`` element per argument, typed by the tool's schema.

Parses, text before it being content, any number in a row::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

-> ``get_weather`` with arguments ``{"city": "Paris", "days": 3}`` when the schema says ``days`` is an integer.
Values (one newline trimmed at each end) become ``integer``, ``number``, ``boolean``, ``null`` or, for ``object`` and
``array``, parsed JSON, as the parameter's schema type says; an unknown parameter or type, or a failed conversion,
keeps the string. Arguments stream: ``{`` with the name once ``<function=NAME>`` is read, each parameter once it
closes, ``}`` at ``</function>``; each value is serialized by us, so the arguments are always valid JSON. Once the
call has started nothing can turn it back into content: stray text between parameters is dropped, and at the end of
generation an open parameter takes the text so far and the object is closed. ``<tool_call>`` not followed by
``<function=NAME>`` is content.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from services.text.markers import find_first, search_from
from services.text.tool_calls.base import MarkerToolParser, load_json

FUNCTION = "<function="
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
FUNCTION_END = "</function>"
CALL_END = "</tool_call>"
_OPEN = re.compile(r"<(function|parameter)=([^>\n]*)>")
_VALUE_ENDS = (PARAMETER_END, FUNCTION_END)
_INTEGER = re.compile(r"-?(?:0|[1-9]\d*)")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


class Qwen3CoderToolParser(MarkerToolParser):
    """``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``, streamed."""

    name = "qwen3_coder"
    start_marker = "<tool_call>"

    def __init__(self, tools: Sequence[dict] = ()) -> None:
        super().__init__(tools)
        self._phase = "head"
        self._index = -1
        self._function = ""
        self._parameter = ""
        self._count = 0  # parameters emitted in the current call

    def _call_step(self, final: bool) -> bool:
        step = {"head": self._head, "params": self._params, "value": self._value, "tail": self._tail}
        return step[self._phase](final)

    def _head(self, final: bool) -> bool:
        text = self._buf.lstrip()
        match = _OPEN.match(text)
        if match is not None and match.group(1) == "function" and match.group(2).strip():
            self._function = match.group(2).strip()
            self._buf, self._phase, self._count = text[match.end() :], "params", 0
            self._index = self._start_call(self._function, arguments="{")
            return True
        if not final and _may_open(text, FUNCTION):
            return False
        self._in_call = False  # not this format: the marker was text, and what follows is read as text
        self._emit_text(self.start_marker)
        return True

    def _params(self, final: bool) -> bool:
        text = self._buf.lstrip()
        if text.startswith(FUNCTION_END):
            self._buf = text[len(FUNCTION_END) :]
            self._close()
            return True
        match = _OPEN.match(text)
        if match is not None and match.group(1) == "parameter":
            self._parameter, self._buf, self._phase = match.group(2).strip(), text[match.end() :], "value"
            return True
        if final:
            self._buf = ""
            self._close()
            return True
        if _may_open(text, PARAMETER) or FUNCTION_END.startswith(text):
            return False
        skip = text.find("<", 1)  # stray text inside the call: dropped up to the next tag
        self._buf = text[skip:] if skip > 0 else ""
        return True

    def _value(self, final: bool) -> bool:
        found = find_first(self._buf, _VALUE_ENDS, self._search_from)
        if found is None and not final:
            self._search_from = search_from(self._buf, _VALUE_ENDS)
            return False
        position = len(self._buf) if found is None else found[0]
        value = self._buf[:position]
        # </parameter> is consumed; an implicit end at </function> is left for _params.
        consumed = position + len(PARAMETER_END) if found is not None and found[1] == PARAMETER_END else position
        self._buf, self._search_from, self._phase = self._buf[consumed:], 0, "params"
        self._emit_parameter(value)
        return True

    def _tail(self, final: bool) -> bool:
        text = self._buf.lstrip()
        if text.startswith(CALL_END):
            self._buf = text[len(CALL_END) :]
        elif not final and CALL_END.startswith(text):
            return False
        self._in_call, self._phase = False, "head"  # without </tool_call>, what follows is text
        return True

    def _close(self) -> None:
        self._emit_arguments(self._index, "}")
        self._phase = "tail"

    def _emit_parameter(self, raw: str) -> None:
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = convert_parameter(raw, self._parameter_type())
        key = json.dumps(self._parameter, ensure_ascii=False)
        separator = ", " if self._count else ""
        self._emit_arguments(self._index, f"{separator}{key}: {json.dumps(value, ensure_ascii=False)}")
        self._count += 1

    def _parameter_type(self) -> str | None:
        parameters = self.tools.get(self._function, {}).get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        schema = properties.get(self._parameter) if isinstance(properties, dict) else None
        kind = schema.get("type") if isinstance(schema, dict) else None
        if isinstance(kind, list):  # ["integer", "null"]: the first type that is not null
            kind = next((k for k in kind if k != "null"), None)
        return kind if isinstance(kind, str) else None


def convert_parameter(raw: str, kind: str | None) -> Any:
    """A parameter's text as the JSON value its schema type names; the text itself when it does not convert."""
    text = raw.strip()
    if kind in (None, "string"):
        return raw
    if text.lower() == "null":
        return None
    if kind == "integer" and _INTEGER.fullmatch(text):
        return int(text)
    if kind == "number" and _NUMBER.fullmatch(text):
        value = json.loads(text)
        if math.isfinite(value):  # 1e999 is inf, which is no JSON
            return value
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind in ("object", "array"):
        ok, value = load_json(text)
        if ok and isinstance(value, dict if kind == "object" else list):
            return value
    return raw


def _may_open(text: str, opener: str) -> bool:
    """Whether ``text`` may still grow into ``opener`` NAME ``>`` (no newline in the name)."""
    if opener.startswith(text):
        return True
    return text.startswith(opener) and ">" not in text and "\n" not in text
