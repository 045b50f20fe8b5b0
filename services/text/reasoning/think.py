"""``<think>...</think>`` reasoning (DeepSeek-R1, Qwen3, QwQ, SmolLM3): the text between the tags is reasoning.

Parses::

    <think>
    The user greets me.
    </think>

    Hello!

-> reasoning ``"\\nThe user greets me.\\n"``, content ``"\\n\\nHello!"``. Text before ``<think>`` is content; after
``</think>`` everything is content (a later ``<think>`` included); without ``</think>`` everything after ``<think>``
is reasoning. With ``starts_in_reasoning`` (the prompt ended with ``<think>``, as DeepSeek-R1's and the Qwen3
thinking models' templates do) the text is reasoning from its first character. No newline is stripped next to the
tags: vLLM's deepseek_r1 and qwen3 parsers cut at the tags only, and we return the same strings.
"""

from __future__ import annotations

from services.text.markers import hold_start
from services.text.reasoning.base import ReasoningDelta, StreamingReasoningParser

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkReasoningParser(StreamingReasoningParser):
    """States: before (content, looking for ``<think>``), reasoning (looking for ``</think>``), after (content)."""

    name = "think"

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        super().__init__(starts_in_reasoning)
        self._state = "reasoning" if starts_in_reasoning else "before"
        self._buf = ""

    def _advance(self, text: str, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        self._buf += text
        while self._state != "after":
            marker = THINK_START if self._state == "before" else THINK_END
            out = content if self._state == "before" else reasoning
            position = self._buf.find(marker)  # the buffer holds only this feed's text and a partial marker
            if position < 0:
                cut = len(self._buf) if final else hold_start(self._buf, (marker,))
                out.append(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            out.append(self._buf[:position])
            self._buf = self._buf[position + len(marker) :]
            self._state = "reasoning" if self._state == "before" else "after"
        if self._state == "after":
            content.append(self._buf)
            self._buf = ""
        return ReasoningDelta("".join(reasoning), "".join(content))
