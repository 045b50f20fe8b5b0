"""DeepSeek-V3 / R1 tool calls, in the special tokens of their chat template (fullwidth ``｜``, ``▁``).

Parses (``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>`` wrap the run; calls are separated by a newline)::

    Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

-> content ``"Checking."`` and two calls. The V3.1 form
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>`` (name before the separator, bare JSON after)
is read too. Each call is held until ``<｜tool▁call▁end｜>``; one that
does not parse stays content, markers included. The wrapper markers are dropped from content.
"""

from __future__ import annotations

from services.text.tool_calls.base import FoundCall, MarkerToolParser, arguments_text, load_json

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(MarkerToolParser):
    """``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``."""

    name = "deepseek_v3"
    start_marker = CALL_BEGIN
    end_marker = CALL_END
    dropped_markers = (CALLS_BEGIN, CALLS_END)

    def _parse_body(self, body: str) -> list[FoundCall] | None:
        head, sep, rest = body.partition(SEP)
        if not sep:
            return None
        if rest.lstrip().startswith("{"):  # V3.1: NAME<｜tool▁sep｜>{json}
            name, payload = head.strip(), rest.strip()
        else:  # V3: TYPE<｜tool▁sep｜>NAME\n```json\n{json}\n```
            name, _, payload = rest.partition("\n")
            name, payload = name.strip(), payload.strip()
            if payload.startswith("```"):
                payload = payload.partition("\n")[2].strip()
                if not payload.endswith("```"):
                    return None
                payload = payload[:-3].strip()
        if not name or any(char.isspace() for char in name):
            return None
        ok, value = load_json(payload)
        arguments = arguments_text(value) if ok and isinstance(value, dict) else None
        return None if arguments is None else [FoundCall(name, arguments)]
