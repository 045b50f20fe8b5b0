"""Hermes-style tool calls (Qwen2.5, Qwen3, SmolLM3, Hermes): a JSON object between ``<tool_call>`` tags.

Parses, any number in a row (whitespace between them dropped), text before them being content::

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

-> content ``"Let me check."``, a call ``get_weather`` with arguments ``{"city": "Paris"}``. The call is held
until ``</tool_call>`` (or the end of generation), then emitted whole; a body that is not such an object
(``"parameters"`` is accepted for ``"arguments"``) stays content, tags included.
"""

from __future__ import annotations

from services.text.tool_calls.base import FoundCall, MarkerToolParser, call_from_object, load_json


class HermesToolParser(MarkerToolParser):
    """``<tool_call>{json}</tool_call>``, held until the closing tag."""

    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def _parse_body(self, body: str) -> list[FoundCall] | None:
        ok, obj = load_json(body.strip())
        call = call_from_object(obj) if ok else None
        return None if call is None else [call]
