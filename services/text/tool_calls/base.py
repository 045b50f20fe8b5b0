"""The tool-call parser interface, its streamed shape, and the machinery the formats share.

A parser turns the text a model generates into OpenAI's ``content`` and ``tool_calls``, one decoded
delta at a time. The contract every format keeps, whatever the split of the text into ``feed`` calls:

- The joined output (``join_deltas``) is the same as for the whole text fed at once.
- Text that may be the start of a marker is held back until it is known not to be one.
- Content before a call is content; whitespace between (and after) consecutive calls is dropped.
- A call's arguments are emitted only while they are known to be valid JSON: the JSON formats hold a
  call until its end (its closing marker, or the end of its JSON value), then emit id, name and the
  whole arguments in one delta; a call that does not parse is content, as generated. Arguments are
  re-serialized with ``json.dumps(arguments, ensure_ascii=False)``.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from services.text.markers import find_first, hold_start


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of one call, in OpenAI's streamed shape (``choices[].delta.tool_calls[]``)."""

    index: int  # the call's position in this answer (0, 1, ...)
    id: str | None = None  # on the call's first delta only
    name: str | None = None  # on the call's first delta only
    arguments: str = ""  # a fragment of the arguments' JSON text


@dataclass(frozen=True)
class ParsedDelta:
    """What one ``feed`` (or ``finish``) adds: text for the user, and pieces of calls."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """A whole call: the deltas of one index joined."""

    id: str
    name: str
    arguments: str


class FoundCall(NamedTuple):
    """A complete call read from the text; ``id`` only when the model wrote one."""

    name: str
    arguments: str
    id: str | None = None


def new_call_id() -> str:
    """A fresh OpenAI-style call id."""
    return "call_" + secrets.token_hex(12)


class ToolCallParser(ABC):
    """Streams one answer's text into content and tool calls (one parser per answer)."""

    name: ClassVar[str]
    start_marker: ClassVar[str]  # the text that starts a call (a lazy grammar's trigger)

    def __init__(self, tools: Sequence[dict] = ()) -> None:
        # OpenAI ``tools`` entries by function name; formats that type their arguments read the schemas.
        self.tools: dict[str, dict] = {}
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                self.tools[function["name"]] = function

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """Add the next decoded text (any length, any split); return what can be shown now."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """End of generation: flush what was held back (an unfinished call that parses, else its text)."""


def join_deltas(deltas: Iterable[ParsedDelta]) -> tuple[str, list[ToolCall]]:
    """Join deltas the way a client does: content concatenated, calls by index (first id and name)."""
    content: list[str] = []
    heads: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.tool_calls:
            if piece.index not in heads:
                heads[piece.index] = (piece.id or "", piece.name or "")
                arguments[piece.index] = []
            arguments[piece.index].append(piece.arguments)
    calls = [ToolCall(heads[i][0], heads[i][1], "".join(arguments[i])) for i in sorted(heads)]
    return "".join(content), calls


def parse_all(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """Parse a whole answer at once (the non-streamed response)."""
    return join_deltas([parser.feed(text), parser.finish()])


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(text: str) -> tuple[bool, Any]:
    """(True, value) when ``text`` is strict JSON (no NaN/Infinity, which would not re-serialize as JSON)."""
    try:
        return True, json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return False, None


def arguments_text(value: Any) -> str | None:
    """The arguments' JSON text: a JSON object, or a string holding one; None for anything else."""
    if isinstance(value, str):
        ok, value = load_json(value)
        if not ok:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: Any, argument_keys: Sequence[str] = ("arguments", "parameters")) -> FoundCall | None:
    """A call from ``{"name": ..., "arguments": {...}}`` (missing arguments are ``{}``); None if it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    raw = next((obj[key] for key in argument_keys if key in obj), {})
    arguments = arguments_text(raw)
    if arguments is None:
        return None
    call_id = obj.get("id")
    return FoundCall(name.strip(), arguments, call_id if isinstance(call_id, str) and call_id else None)


class BufferedToolParser(ToolCallParser):
    """Collects one feed's output; formats implement ``_advance`` and emit through ``_emit_*``."""

    def __init__(self, tools: Sequence[dict] = ()) -> None:
        super().__init__(tools)
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._next_index = 0
        self._after_call = False  # whitespace is held (and dropped before a call or at the end)
        self._held_space = ""
        self._finished = False

    def feed(self, text: str) -> ParsedDelta:
        if self._finished:
            raise ValueError(f"{type(self).__name__} fed after finish")
        self._advance(text, final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        if self._finished:
            return ParsedDelta()
        self._advance("", final=True)
        self._held_space = ""
        self._finished = True
        return self._take()

    @abstractmethod
    def _advance(self, text: str, final: bool) -> None:
        """Read ``text``; at ``final`` everything held must be resolved."""

    def _new_id(self) -> str:
        return new_call_id()

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        if self._after_call:
            if text.isspace():
                self._held_space += text
                return
            text, self._held_space, self._after_call = self._held_space + text, "", False
        self._content.append(text)

    def _start_call(self, name: str, call_id: str | None = None, arguments: str = "") -> int:
        """Emit a call's first delta; return its index."""
        index = self._next_index
        self._next_index += 1
        self._held_space, self._after_call = "", True
        self._deltas.append(ToolCallDelta(index, call_id or self._new_id(), name, arguments))
        return index

    def _emit_arguments(self, index: int, fragment: str) -> None:
        if fragment:
            self._deltas.append(ToolCallDelta(index, arguments=fragment))

    def _emit_call(self, call: FoundCall) -> None:
        self._start_call(call.name, call.id, call.arguments)

    def _take(self) -> ParsedDelta:
        delta = ParsedDelta("".join(self._content), tuple(self._deltas))
        self._content, self._deltas = [], []
        return delta


class MarkerToolParser(BufferedToolParser):
    """Text with calls between markers: scan for ``start_marker``, then ``_call_step`` reads the call.

    The default call step holds the call's text until ``end_marker`` and hands it to ``_parse_body``;
    formats that stream a call, or end it without a marker, override ``_call_step``.
    """

    end_marker: ClassVar[str] = ""
    # Markers removed from content without meaning anything (a wrapper around a run of calls).
    dropped_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: Sequence[dict] = ()) -> None:
        super().__init__(tools)
        self._buf = ""  # text not yet emitted: a possible partial marker, or the call being read
        self._in_call = False
        self._search_from = 0  # where the next search for the end marker starts in ``_buf``

    def _advance(self, text: str, final: bool) -> None:
        self._buf += text
        while self._call_step(final) if self._in_call else self._text_step(final):
            pass

    def _text_step(self, final: bool) -> bool:
        """Emit text up to the next marker; False once the buffer holds at most a partial marker."""
        markers = (self.start_marker, *self.dropped_markers)
        found = find_first(self._buf, markers)
        if found is None:
            cut = len(self._buf) if final else hold_start(self._buf, markers)
            self._emit_text(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        position, marker = found
        self._emit_text(self._buf[:position])
        self._buf = self._buf[position + len(marker) :]
        self._in_call = marker == self.start_marker
        return True

    def _call_step(self, final: bool) -> bool:
        """Read the call after the start marker; False while it needs more text (never at ``final``)."""
        end = self._buf.find(self.end_marker, self._search_from)
        if end < 0 and not final:
            self._search_from = max(0, len(self._buf) - len(self.end_marker) + 1)
            return False
        closed = end >= 0
        body = self._buf[:end] if closed else self._buf
        self._buf = self._buf[end + len(self.end_marker) :] if closed else ""
        self._in_call, self._search_from = False, 0
        calls = self._parse_body(body)
        if calls is None:
            self._emit_text(self.start_marker + body + (self.end_marker if closed else ""))
        for call in calls or ():
            self._emit_call(call)
        return True

    def _parse_body(self, body: str) -> list[FoundCall] | None:
        """The calls between the markers, or None when the text is not a call (it is then content)."""
        raise NotImplementedError(f"{type(self).__name__} reads calls in _call_step")


class JsonEndScanner:
    """Where the JSON object or array at the start of a growing text ends, reading each character once.

    Counts brackets outside strings; whether the text is valid JSON is left to ``json.loads``.
    """

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    def scan(self, text: str) -> int | None:
        """``text``: the value so far (the same text, grown). The index just past its end, or None."""
        i = self._pos
        while i < len(text):
            char = text[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._pos = i
                    return i
        self._pos = i
        return None
