"""Mistral tool calls after ``[TOOL_CALLS]``: the v3 JSON array, or the newer ``NAME[ARGS]{json}`` form.

Parses, text before the marker being content::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

(each -> two calls). ``NAME[CALL_ID]id[ARGS]{json}`` is read too. There is no end marker: a call ends where its
JSON value closes (brackets counted outside strings), and is then emitted whole. A value that does not parse, or
a marker followed by neither form, is content as generated. Call ids are 9 letters and digits (the model's
own id when it wrote one), the only form Mistral's chat templates accept back in the conversation.
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Sequence

from services.text.tool_calls.base import (
    FoundCall,
    JsonEndScanner,
    MarkerToolParser,
    arguments_text,
    call_from_object,
    load_json,
)

ARGS = "[ARGS]"
_HEADER = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?")
_HEADER_CHARS = re.compile(r"[A-Za-z0-9_.\-\[\]]*")
_MAX_HEADER = 256  # a name (and call id) longer than this is not a header: the marker was text
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(MarkerToolParser):
    """``[TOOL_CALLS][{...}, ...]`` and ``[TOOL_CALLS]NAME[ARGS]{...}``, each held until its JSON closes."""

    name = "mistral"
    start_marker = "[TOOL_CALLS]"

    def __init__(self, tools: Sequence[dict] = ()) -> None:
        super().__init__(tools)
        self._json_at = -1  # where the JSON value starts in ``_buf`` once the form is known
        self._header: tuple[str, str | None] | None = None  # (name, id) of the NAME[ARGS] form
        self._scanner = JsonEndScanner()
        self._scanning = False

    def _new_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def _call_step(self, final: bool) -> bool:
        if self._json_at < 0:
            form = self._read_header(final)
            if form == "wait":
                return False
            if form == "text":  # neither form: the marker was text, and what follows is read as text
                self._leave_call(self.start_marker, 0)
                return True
        text = self._buf[self._json_at :]
        if not self._scanning:  # the value starts at the first character after whitespace
            stripped = text.lstrip()
            if not stripped and not final:
                return False
            if not stripped.startswith(("{", "[")):
                self._leave_call(self.start_marker + self._buf[: self._json_at], self._json_at)
                return True
            self._json_at += len(text) - len(stripped)
            text, self._scanning = stripped, True
        end = self._scanner.scan(text)
        if end is None and not final:
            return False
        end = len(text) if end is None else end
        calls = self._calls(text[:end])
        if calls is None:
            self._leave_call(self.start_marker + self._buf[: self._json_at + end], self._json_at + end)
        else:
            self._leave_call("", self._json_at + end)
            for call in calls:
                self._emit_call(call)
        return True

    def _leave_call(self, content: str, consumed: int) -> None:
        self._emit_text(content)
        self._buf = self._buf[consumed:]
        self._in_call, self._json_at, self._header = False, -1, None
        self._scanner, self._scanning = JsonEndScanner(), False

    def _read_header(self, final: bool) -> str:
        """Which form follows the marker: "ready" (``_json_at`` set), "wait" (unknown yet) or "text" (neither)."""
        stripped = self._buf.lstrip()
        if not stripped:
            return "text" if final else "wait"
        if stripped.startswith("["):  # the v3 array
            self._json_at = len(self._buf) - len(stripped)
            return "ready"
        position = self._buf.find(ARGS, 0, _MAX_HEADER + len(ARGS))
        if position >= 0:
            match = _HEADER.fullmatch(self._buf[:position])
            if match is None:
                return "text"
            self._header = (match.group(1), match.group(2))
            self._json_at = position + len(ARGS)
            return "ready"
        if not final and len(self._buf) < _MAX_HEADER + len(ARGS) and _HEADER_CHARS.fullmatch(self._buf):
            return "wait"  # may still become NAME[ARGS]
        return "text"

    def _calls(self, text: str) -> list[FoundCall] | None:
        ok, value = load_json(text)
        if not ok:
            return None
        if self._header is not None:
            arguments = arguments_text(value) if isinstance(value, dict) else None
            return None if arguments is None else [FoundCall(self._header[0], arguments, self._header[1])]
        if not isinstance(value, list) or not value:
            return None
        calls = [call_from_object(item) for item in value]
        return None if any(call is None for call in calls) else calls  # type: ignore[return-value]
