"""Llama-3.1/3.2 JSON tool calls: the whole answer is the calls, ``; ``-separated, maybe after ``<|python_tag|>``.

Parses::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

(``"arguments"`` is accepted for ``"parameters"``). An answer that does not start, after whitespace, with ``{`` or
``<|python_tag|>`` is plain content, passed through as it arrives. A call ends where its JSON object closes
(brackets counted outside strings) and is then emitted whole; an object that is not a call, and anything after the
calls other than ``;`` and whitespace, is content as generated (and so is the rest of the answer).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from services.text.tool_calls.base import BufferedToolParser, JsonEndScanner, call_from_object, load_json

PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*;\s*")


class Llama3JsonToolParser(BufferedToolParser):
    """The Llama-3 JSON tool-call answer; states: start, object, after (a call), text (pass-through)."""

    name = "llama3_json"
    start_marker = '{"name"'

    def __init__(self, tools: Sequence[dict] = ()) -> None:
        super().__init__(tools)
        self._buf = ""
        self._state = "start"
        self._scanner = JsonEndScanner()

    def _advance(self, text: str, final: bool) -> None:
        self._buf += text
        step = {"start": self._start, "object": self._object, "after": self._after, "text": self._text}
        while step[self._state](final):
            pass

    def _start(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(PYTHON_TAG):
            stripped = stripped[len(PYTHON_TAG) :].lstrip()
            if not stripped.startswith("{"):
                if stripped or final:
                    self._state = "text"  # a python_tag answer that is not JSON (a built-in tool's code)
                    return True
                return False
        if stripped.startswith("{"):
            self._buf, self._state = stripped, "object"
            return True
        if not final and (not stripped or PYTHON_TAG.startswith(stripped)):
            return False
        self._state = "text"
        return True

    def _object(self, final: bool) -> bool:
        end = self._scanner.scan(self._buf)
        if end is None and not final:
            return False
        end = len(self._buf) if end is None else end
        ok, value = load_json(self._buf[:end])
        call = call_from_object(value, ("parameters", "arguments")) if ok else None
        if call is None:
            self._state = "text"  # not a call: it, and all after it, is content
            return True
        self._emit_call(call)
        self._buf, self._state, self._scanner = self._buf[end:], "after", JsonEndScanner()
        return True

    def _after(self, final: bool) -> bool:
        match = _SEPARATOR.match(self._buf)
        if match is not None and self._buf[match.end() :].startswith("{"):
            self._buf, self._state = self._buf[match.end() :], "object"
            return True
        if not self._buf.strip() or (match is not None and match.end() == len(self._buf)):
            if final:
                self._buf = ""  # trailing whitespace (or a dangling separator) after the calls
            return False
        self._state = "text"
        return True

    def _text(self, final: bool) -> bool:
        self._emit_text(self._buf)
        self._buf = ""
        return False
