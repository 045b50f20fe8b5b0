"""Reasoning formats by name, which one a chat template speaks, and whether a prompt opened the reasoning."""

from __future__ import annotations

from services.text.reasoning.base import ReasoningParser
from services.text.reasoning.harmony import HarmonyReasoningParser
from services.text.reasoning.think import THINK_END, THINK_START, ThinkReasoningParser

# deepseek_r1 and qwen3 are vLLM's names for the same <think> format.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "think": ThinkReasoningParser,
    "deepseek_r1": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
    "harmony": HarmonyReasoningParser,
}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class of a format name (a ``--reasoning-parser`` value)."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning format {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None


def reasoning_parser_name_for_template(chat_template: str | None) -> str | None:
    """The reasoning format a chat template writes (``</think>`` or harmony channels); None when neither."""
    if not chat_template:
        return None
    if "<|channel|>" in chat_template:
        return "harmony"
    if THINK_END in chat_template:
        return "think"
    return None


def prompt_starts_in_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` (so the output starts as reasoning).

    Reading the rendered prompt, not the template, is exact: a template's ``<think>`` may belong to history or to
    the ``enable_thinking=False`` branch (``<think>\\n\\n</think>``), which closes it.
    """
    tail = prompt.rstrip()
    return tail.endswith(THINK_START)
