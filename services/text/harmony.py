"""gpt-oss's harmony format, split into messages as it streams: headers, body text, ends.

The tool-call and the reasoning parser of harmony both read the text through ``HarmonySplitter``. A message is::

    <|start|>assistant<|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "P"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The generated text starts right after the prompt's ``<|start|>assistant``, so its first message usually has no
``<|start|>``: it begins ``<|channel|>`` or `` to=functions.NAME`` (the recipient may come before or after the
channel; ``<|constrain|>json``, or a bare ``json``, is optional). A body ends at ``<|end|>``, ``<|call|>`` or
``<|return|>``, or, implicitly, where the next header begins. Text outside any message (an answer that is not in
harmony at all, or text between messages) is "stray"; so is a header the generation ended inside of.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.text.markers import find_first, hold_start

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
_HEADER_STARTS = (START, CHANNEL)
# What the generated text may begin with when its first message's header follows the prompt's <|start|>assistant.
_FIRST_HEADER_STARTS = (START, CHANNEL, " to=", "to=", CONSTRAIN)
_BODY_ENDS = (END, CALL, RETURN)
_BODY_STOPS = (*_BODY_ENDS, *_HEADER_STARTS)  # a header start ends a body without <|end|>, and is not consumed
_ROLE = re.compile(r"<\|start\|>\s*([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CONSTRAIN = re.compile(r"<\|constrain\|>\s*([^\s<]+)|\s(json)\s*$")


@dataclass(frozen=True)
class HarmonyHeader:
    """A message's header: its channel, its recipient (``functions.NAME`` for a tool call), and the raw text."""

    raw: str  # as generated, up to (without) <|message|>
    role: str | None = None
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None  # "json" from <|constrain|>json

    def render(self) -> str:
        """The header in canonical form, ``<|start|>`` first, so it parses back wherever it is placed."""
        text = f"{START}{self.role or 'assistant'}"
        text += f"{CHANNEL}{self.channel}" if self.channel else ""
        text += f" to={self.recipient}" if self.recipient else ""
        text += f" {CONSTRAIN}{self.content_type}" if self.content_type else ""
        return text + MESSAGE


@dataclass(frozen=True)
class HarmonyEvent:
    """One step of the split: kind "header" (``header`` set), "body" or "stray" (``text``), or "end".

    An "end" carries its terminator in ``text`` (``<|call|>``...), or "" when the body ended implicitly or the
    generation ended inside it.
    """

    kind: str
    text: str = ""
    header: HarmonyHeader | None = None


def parse_header(raw: str) -> HarmonyHeader:
    """Read role, channel, recipient and content type from a header's text."""
    found = {name: pattern.search(raw) for name, pattern in (("role", _ROLE), ("channel", _CHANNEL),
                                                           ("recipient", _RECIPIENT), ("type", _CONSTRAIN))}
    role, channel, recipient, kind = (None if m is None else next(g for g in m.groups() if g) for m in found.values())
    return HarmonyHeader(raw, role, channel, recipient, kind)


class HarmonySplitter:
    """Splits streamed harmony text into events, holding back what may be the start of a marker."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "begin"  # begin | outside | header | body

    def feed(self, text: str, final: bool = False) -> list[HarmonyEvent]:
        """Events for ``text``; with ``final``, everything held is resolved (no event is left pending)."""
        self._buf += text
        events: list[HarmonyEvent] = []
        step = {"begin": self._begin, "outside": self._outside, "header": self._header, "body": self._body}
        while step[self._state](final, events):
            pass
        return events

    def _begin(self, final: bool, events: list[HarmonyEvent]) -> bool:
        if self._buf.startswith(_FIRST_HEADER_STARTS):
            self._state = "header"
            return True
        if not final and any(marker.startswith(self._buf) for marker in _FIRST_HEADER_STARTS):
            return False
        self._state = "outside"
        return True

    def _outside(self, final: bool, events: list[HarmonyEvent]) -> bool:
        found = find_first(self._buf, _HEADER_STARTS)
        cut = found[0] if found else len(self._buf) if final else hold_start(self._buf, _HEADER_STARTS)
        if cut:
            events.append(HarmonyEvent("stray", self._buf[:cut]))
            self._buf = self._buf[cut:]
        if found:
            self._state = "header"
        return found is not None

    def _header(self, final: bool, events: list[HarmonyEvent]) -> bool:
        position = self._buf.find(MESSAGE)
        if position < 0:
            if final and self._buf:
                events.append(HarmonyEvent("stray", self._buf))
                self._buf = ""
            return False
        events.append(HarmonyEvent("header", header=parse_header(self._buf[:position])))
        self._buf, self._state = self._buf[position + len(MESSAGE) :], "body"
        return True

    def _body(self, final: bool, events: list[HarmonyEvent]) -> bool:
        found = find_first(self._buf, _BODY_STOPS)
        cut = found[0] if found else len(self._buf) if final else hold_start(self._buf, _BODY_STOPS)
        if cut:
            events.append(HarmonyEvent("body", self._buf[:cut]))
            self._buf = self._buf[cut:]
        if found is None and not final:
            return False
        terminator = found[1] if found and found[1] in _BODY_ENDS else ""
        self._buf = self._buf[len(terminator) :]
        events.append(HarmonyEvent("end", terminator))
        self._state = "outside"
        return found is not None
