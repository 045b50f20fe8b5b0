"""The reasoning parser interface: split generated text into reasoning (``reasoning_content``) and the answer.

The same streaming contract as the tool-call parsers: whatever the split of the text into ``feed`` calls, the
joined output is the same as for the whole text at once, and text that may be the start of a marker is held back
until it is known not to be one. With tools, a reasoning parser runs first and the tool-call parser reads its
``content``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ReasoningDelta:
    """What one ``feed`` (or ``finish``) adds to the reasoning and to the answer."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser(ABC):
    """Streams one answer's text into reasoning and content (one parser per answer)."""

    name: ClassVar[str]

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        # True when the prompt already opened the reasoning (a template ending its prompt with "<think>\n").
        self.starts_in_reasoning = starts_in_reasoning

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """Add the next decoded text (any length, any split); return what can be shown now."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """End of generation: flush what was held back."""


class StreamingReasoningParser(ReasoningParser):
    """The feed/finish guard every format shares (no feed after finish; a second finish adds nothing), around the
    format's ``_advance``, as ``BufferedToolParser`` does for the tool-call parsers."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        super().__init__(starts_in_reasoning)
        self._finished = False

    def feed(self, text: str) -> ReasoningDelta:
        if self._finished:
            raise ValueError(f"{type(self).__name__} fed after finish")
        return self._advance(text, final=False)

    def finish(self) -> ReasoningDelta:
        if self._finished:
            return ReasoningDelta()
        self._finished = True
        return self._advance("", final=True)

    @abstractmethod
    def _advance(self, text: str, final: bool) -> ReasoningDelta:
        """Read ``text``; at ``final`` everything held must be resolved. What it adds now."""


def join_reasoning(deltas: Iterable[ReasoningDelta]) -> tuple[str, str]:
    """(reasoning, content), each concatenated."""
    reasoning: list[str] = []
    content: list[str] = []
    for delta in deltas:
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    return "".join(reasoning), "".join(content)


def parse_reasoning(parser: ReasoningParser, text: str) -> tuple[str, str]:
    """Parse a whole answer at once: (reasoning, content)."""
    return join_reasoning([parser.feed(text), parser.finish()])
