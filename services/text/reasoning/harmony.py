"""gpt-oss (harmony) reasoning: the ``analysis`` channel is reasoning, the rest is the answer.

Parses (see ``services.text.harmony`` for the message syntax)::

    <|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>

-> reasoning ``"Simple greeting."``, content ``"Hi!"``. ``final`` and commentary without a recipient (a preamble)
are content, bodies only. A message with a recipient (a tool call) is passed through as content in full, its header
rendered canonically (``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>``)
and its terminator kept, so that ``HarmonyToolParser`` reading this parser's content finds the call. So with
harmony the router always runs the tool parser after this one (with no tools offered, one that drops the calls), and
sends the tool parser's content to the client. Consecutive analysis messages are joined as they are;
``starts_in_reasoning`` has no effect.
"""

from __future__ import annotations

from services.text.harmony import HarmonyEvent, HarmonyHeader, HarmonySplitter
from services.text.reasoning.base import ReasoningDelta, StreamingReasoningParser


class HarmonyReasoningParser(StreamingReasoningParser):
    """Harmony messages to reasoning (analysis) and content (everything else, tool calls as harmony text)."""

    name = "harmony"

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        super().__init__(starts_in_reasoning)
        self._splitter = HarmonySplitter()
        self._header: HarmonyHeader | None = None

    def _advance(self, text: str, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        for event in self._splitter.feed(text, final):
            self._on_event(event, reasoning, content)
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _on_event(self, event: HarmonyEvent, reasoning: list[str], content: list[str]) -> None:
        header = self._header
        if event.kind == "header":
            self._header = event.header
            if event.header is not None and event.header.recipient is not None:
                content.append(event.header.render())
        elif event.kind == "stray":
            content.append(event.text)
        elif header is None:
            return
        elif event.kind == "end":
            if header.recipient is not None:
                content.append(event.text)
            self._header = None
        elif header.recipient is not None or header.channel != "analysis":
            content.append(event.text)
        else:
            reasoning.append(event.text)
