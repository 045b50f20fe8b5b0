"""Reasoning from generated text, torch-free: one streaming parser per format behind ``ReasoningParser``.

``base`` (the interface, ``StreamingReasoningParser``: the feed/finish guard the formats share, ``ReasoningDelta``,
``parse_reasoning``, ``join_reasoning``), ``think`` (``<think>...</think>``: DeepSeek-R1, Qwen3), ``harmony``
(gpt-oss's analysis channel), ``registry`` (name -> class, the format a template speaks, whether a rendered prompt
opened the reasoning).

Use: ``parser = reasoning_parser(name)(starts_in_reasoning=prompt_starts_in_reasoning(prompt))``; per decoded delta
``parser.feed(text)``, at the end ``parser.finish()``; with tools, feed each delta's ``content`` to the tool-call
parser (for harmony, always: tool-call messages reach content as harmony text).
"""

from services.text.reasoning.base import ReasoningDelta, ReasoningParser, join_reasoning, parse_reasoning
from services.text.reasoning.registry import (
    REASONING_PARSERS,
    prompt_starts_in_reasoning,
    reasoning_parser,
    reasoning_parser_name_for_template,
)

__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "join_reasoning",
    "parse_reasoning",
    "prompt_starts_in_reasoning",
    "reasoning_parser",
    "reasoning_parser_name_for_template",
]
