"""Tool calls from generated text, torch-free: one streaming parser per format behind ``ToolCallParser``.

``base`` (the interface, ``ToolCallDelta`` / ``ParsedDelta`` / ``ToolCall``, ``parse_all``, ``join_deltas``, and the
shared marker and JSON machinery), one module per format (``hermes``, ``llama3_json``, ``mistral``, ``deepseek_v3``,
``harmony``, ``qwen3_coder``), and ``registry`` (name -> class, and the format a chat template speaks).

Use: ``parser = tool_call_parser(name)(request.tools)``; per decoded delta ``parser.feed(text)``, at the end
``parser.finish()``; each returns a ``ParsedDelta`` (content, and tool-call pieces in OpenAI's streamed shape).
With a reasoning parser, run it first and feed its ``content`` here (``services.text.reasoning``).
"""

from services.text.tool_calls.base import (
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    join_deltas,
    parse_all,
)
from services.text.tool_calls.registry import TOOL_CALL_PARSERS, parser_name_for_template, tool_call_parser

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParsedDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "join_deltas",
    "parse_all",
    "parser_name_for_template",
    "tool_call_parser",
]
