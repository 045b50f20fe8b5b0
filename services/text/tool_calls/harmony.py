"""gpt-oss (harmony) tool calls: a commentary message addressed to ``functions.NAME``, its body the arguments.

Parses (see ``services.text.harmony`` for the message syntax)::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(one line, ``commentary`` and ``to=`` separated by a space) -> the call ``get_weather`` ``{"city": "Paris"}``, no
content. ``final`` and commentary without a recipient (a preamble) are content, ``analysis`` is reasoning and is
dropped here (``services.text.reasoning.harmony`` returns it), text outside messages is content. A call is held until
its ``<|call|>`` (or the end of generation: ``<|call|>`` is a stop token) and emitted whole; a body that is not a JSON
object, or a recipient outside ``functions.``, is content, header and all, as generated.

With no tools offered (``tool_choice: "none"``, or none sent) the router still runs this parser, as it separates the
channels, but with ``calls=False``: a message that would be a call is dropped, never returned as ``tool_calls``
(OpenAI: with ``none`` the answer has no calls). Dropped, not content: it is an action addressed to a tool, not words
for the user, as vLLM's harmony output keeps only ``final`` and preambles as content when no tool parser reads calls;
its JSON alone would read as the answer, and its harmony text would put special tokens in the content.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.text.harmony import MESSAGE, HarmonyEvent, HarmonyHeader, HarmonySplitter
from services.text.tool_calls.base import BufferedToolParser, FoundCall, arguments_text, load_json

FUNCTIONS = "functions."


class HarmonyToolParser(BufferedToolParser):
    """Harmony messages to content and calls; also reads the content of ``HarmonyReasoningParser``."""

    name = "harmony"
    start_marker = "to=functions."

    def __init__(self, tools: Sequence[dict] = (), *, calls: bool = True) -> None:
        super().__init__(tools)
        self._calls = calls  # False: calls are dropped (no tools offered)
        self._splitter = HarmonySplitter()
        self._header: HarmonyHeader | None = None
        self._body: list[str] = []

    def _advance(self, text: str, final: bool) -> None:
        for event in self._splitter.feed(text, final):
            self._on_event(event)

    def _on_event(self, event: HarmonyEvent) -> None:
        if event.kind == "header":
            self._header, self._body = event.header, []
        elif event.kind == "stray":
            self._emit_text(event.text)
        elif self._header is None:
            return
        elif self._header.recipient is not None:
            if event.kind == "body":
                self._body.append(event.text)
            else:
                self._end_call(self._header, "".join(self._body), event.text)
        elif event.kind == "body" and self._header.channel != "analysis":
            self._emit_text(event.text)

    def _end_call(self, header: HarmonyHeader, body: str, terminator: str) -> None:
        call = None
        if header.recipient is not None and header.recipient.startswith(FUNCTIONS):
            ok, value = load_json(body)
            arguments = arguments_text(value) if ok and isinstance(value, dict) else None
            name = header.recipient[len(FUNCTIONS) :]
            call = FoundCall(name, arguments) if arguments is not None and name else None
        if call is None:
            self._emit_text(header.raw + MESSAGE + body + terminator)
        elif self._calls:
            self._emit_call(call)
        self._header, self._body = None, []
