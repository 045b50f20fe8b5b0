"""A chat answer's text read as the model's formats: reasoning, then content and tool calls.

Which formats a model speaks is resolved once, at start, from ``--tool-call-parser`` / ``--reasoning-parser``
(``auto``: read from the chat template's markers; ``none``: off). Each choice of a request then has its own
``ChatOutput``: the reasoning parser reads the decoded text first and the tool-call parser reads its content,
so structured output and tools apply to the answer after the reasoning. The parsers keep one contract
whatever the split of the text into deltas (``services.text.tool_calls.base``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.contract.tool_grammar import added_tokens
from services.text.reasoning import reasoning_parser, reasoning_parser_name_for_template
from services.text.reasoning.base import ReasoningParser
from services.text.tokenizer import Tokenizer
from services.text.tool_calls import ToolCallDelta, ToolCallParser, parser_name_for_template, tool_call_parser
from services.text.tool_calls.harmony import HarmonyToolParser

AUTO = "auto"
OFF = "none"
# The format of templates that name none (SmolLM2's, say): Hermes' <tool_call> JSON, the most widely trained.
DEFAULT_TOOL_FORMAT = "hermes"
HARMONY = HarmonyToolParser.name


@dataclass(frozen=True, eq=False)  # hashed by identity: one per router, a key of chat_plan's grammar caches
class ChatFormats:
    """The model's tool-call and reasoning formats (None: not read), whether its template renders tools, and its
    added tokens (text -> id: a tool grammar names the markers among them by id)."""

    tool_format: str | None = None
    reasoning_format: str | None = None
    template_reads_tools: bool = False
    special_tokens: Mapping[str, int] = field(default_factory=dict)


def resolve_formats(tokenizer: Tokenizer | None, tool_flag: str = AUTO, reasoning_flag: str = AUTO) -> ChatFormats:
    """The formats from the flags and the chat template; ValueError naming an unknown format."""
    template = tokenizer.chat_template if tokenizer is not None else None
    if tool_flag == AUTO:
        tool_format = parser_name_for_template(template) or DEFAULT_TOOL_FORMAT
    else:
        tool_format = None if tool_flag == OFF else tool_call_parser(tool_flag).name
    if reasoning_flag == AUTO:
        reasoning_format = reasoning_parser_name_for_template(template)
    else:
        reasoning_format = None if reasoning_flag == OFF else reasoning_flag
        if reasoning_format is not None:
            reasoning_parser(reasoning_format)  # the name is known
    # A grammar names its markers (tool calls', </think>) by id where they are added tokens.
    grammar_markers = tool_format is not None or reasoning_format is not None
    special = added_tokens(tokenizer.backend_json()) if tokenizer is not None and grammar_markers else {}
    return ChatFormats(tool_format, reasoning_format, bool(template) and "tools" in template, special)


@dataclass(frozen=True)
class ChatPiece:
    """What one delta of generated text adds to the answer."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ChatOutput:
    """One choice's answer, parsed as it streams."""

    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None
    called: bool = field(default=False, init=False)  # a call was emitted: the finish reason is tool_calls

    def feed(self, text: str, final: bool = False) -> ChatPiece:
        reasoning, content = "", text
        if self.reasoning is not None:
            delta = self.reasoning.feed(text)
            if final:
                tail = self.reasoning.finish()
                delta = type(delta)(delta.reasoning + tail.reasoning, delta.content + tail.content)
            reasoning, content = delta.reasoning, delta.content
        calls: tuple[ToolCallDelta, ...] = ()
        if self.tools is not None:
            parsed = self.tools.feed(content)
            content, calls = parsed.content, parsed.tool_calls
            if final:
                tail = self.tools.finish()
                content, calls = content + tail.content, calls + tail.tool_calls
        self.called = self.called or bool(calls)
        return ChatPiece(reasoning, content, calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's ``tool_calls`` when the answer ended in calls (it stopped, rather than ran out)."""
        return "tool_calls" if reason == "stop" and self.called else reason


def chat_output(formats: ChatFormats, tools: Sequence[dict] | None, starts_in_reasoning: bool) -> ChatOutput:
    """The parsers one choice needs: reasoning when the model has a format, tool calls when tools are offered.

    Harmony's tool parser runs always, as it reads the channels (the harmony reasoning parser passes call messages
    on as harmony text); with no tools offered (``tool_choice: "none"``) it drops the calls, so the answer has none.
    """
    reasoning = None
    if formats.reasoning_format is not None:
        reasoning = reasoning_parser(formats.reasoning_format)(starts_in_reasoning=starts_in_reasoning)
    parser: ToolCallParser | None = None
    if formats.tool_format is not None and tools:
        parser = tool_call_parser(formats.tool_format)(list(tools))
    elif HARMONY in (formats.tool_format, formats.reasoning_format):
        parser = HarmonyToolParser(calls=False)
    return ChatOutput(reasoning, parser)
