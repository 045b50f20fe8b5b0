"""Tool-call formats by name, and which one a checkpoint's chat template speaks."""

from __future__ import annotations

from services.text.tool_calls.base import ToolCallParser
from services.text.tool_calls.deepseek_v3 import CALLS_BEGIN, DeepSeekV3ToolParser
from services.text.tool_calls.harmony import HarmonyToolParser
from services.text.tool_calls.hermes import HermesToolParser
from services.text.tool_calls.llama3_json import PYTHON_TAG, Llama3JsonToolParser
from services.text.tool_calls.mistral import MistralToolParser
from services.text.tool_calls.qwen3_coder import Qwen3CoderToolParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser
    for parser in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        DeepSeekV3ToolParser,
        HarmonyToolParser,
        Qwen3CoderToolParser,
    )
}


def tool_call_parser(name: str) -> type[ToolCallParser]:
    """The parser class of a format name (a ``--tool-call-parser`` value)."""
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(sorted(TOOL_CALL_PARSERS))}") from None


def parser_name_for_template(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model, by the markers it writes; None when none is recognised.

    Order matters: Qwen3-Coder's template also has ``<tool_call>``, and the most specific markers go first.
    """
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "qwen3_coder" if "<function=" in chat_template else "hermes"
    if CALLS_BEGIN in chat_template:
        return "deepseek_v3"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|channel|>" in chat_template:
        return "harmony"
    # Llama 3.1 writes <|python_tag|>; 3.2 only asks for {"name": ..., "parameters": ...} in a header-format prompt.
    if PYTHON_TAG in chat_template or ("<|start_header_id|>" in chat_template and '"parameters"' in chat_template):
        return "llama3_json"
    return None
