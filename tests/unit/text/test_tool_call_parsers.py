"""Tool-call parsers: golden outputs per format, each re-split at every boundary, char by char and at random."""

from __future__ import annotations

import json
import random

import pytest

from services.text.tool_calls import (
    ParsedDelta,
    ToolCallParser,
    join_deltas,
    parse_all,
    parser_name_for_template,
    tool_call_parser,
)
from services.text.tool_calls.harmony import HarmonyToolParser
from services.text.tool_calls.qwen3_coder import convert_parameter

_PROPERTIES = {
    "city": {"type": "string"},
    "days": {"type": "integer"},
    "ratio": {"type": "number"},
    "metric": {"type": "boolean"},
    "filters": {"type": "object"},
    "hours": {"type": "array"},
    "limit": {"type": ["integer", "null"]},
    "when": {"type": "date"},
}
TOOLS = [
    {"type": "function",
     "function": {"name": "get_weather", "parameters": {"type": "object", "properties": _PROPERTIES}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
WEATHER = '{"city": "Paris"}'
NESTED = '{"city": "Zürich \\"}\\" <tool_call>", "filters": {"a": [1, {"b": null}]}}'
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _ds(name: str, arguments: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


def _hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _run(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[ParsedDelta]]:
    """Feed ``pieces``; check the streamed shape; return (content, [(name, arguments)], deltas)."""
    parser = tool_call_parser(fmt)(TOOLS)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    seen: set[int] = set()
    for piece in (p for delta in deltas for p in delta.tool_calls):
        first = piece.index not in seen
        assert (piece.id is not None, piece.name is not None) == (first, first), piece
        assert piece.index == len(seen) or not first, "indices run 0, 1, ... in order"
        seen.add(piece.index)
    content, calls = join_deltas(deltas)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict), call
    assert len({call.id for call in calls}) == len(calls)
    return content, [(call.name, call.arguments) for call in calls], deltas


def _split_invariant(fmt: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    """The joined result for ``text``, after checking every way of splitting it gives the same."""
    content, calls, _ = _run(fmt, [text])
    whole = (content, calls)
    for cut in range(len(text) + 1):
        assert _run(fmt, [text[:cut], text[cut:]])[:2] == whole, f"split at {cut}: {text[:cut]!r}"
    assert _run(fmt, list(text))[:2] == whole, "char by char"
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _run(fmt, pieces)[:2] == whole, pieces
    return whole


CASES: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    # hermes
    ("hermes", "Plain text, a < b and <tool_call is no tag.", "Plain text, a < b and <tool_call is no tag.", []),
    ("hermes", _hermes("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("hermes", _hermes("get_weather", NESTED) + "\n\n" + _hermes("get_time", "{}"), "",
     [("get_weather", NESTED), ("get_time", "{}")]),
    ("hermes", "Let me check.\n" + _hermes("get_weather", '{"city":"Paris"}') + "\n", "Let me check.\n",
     [("get_weather", WEATHER)]),
    ("hermes", "Hi " + _hermes("get_weather", '{"city": bad}') + " end", "Hi " + _hermes("get_weather", '{"city": bad}')
     + " end", []),
    ("hermes", _hermes("get_time", "{}") + "\nDone.", "\nDone.", [("get_time", "{}")]),
    ("hermes", "Let me see <tool_", "Let me see <tool_", []),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", "{}")]),  # stopped before tag
    ("hermes", '<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"x\\": 1}"}</tool_call>', "",
     [("get_time", '{"x": 1}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    # llama3_json
    ("llama3_json", "The weather is nice {not json}; ok", "The weather is nice {not json}; ok", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + NESTED + '}', "",
     [("get_weather", NESTED)]),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     "", [("get_weather", WEATHER), ("get_time", "{}")]),
    ("llama3_json", '{"name": "get_time", "parameters": {}} and then text', " and then text", [("get_time", "{}")]),
    ("llama3_json", '{"name": "get_time", "parameters": {bad}}', '{"name": "get_time", "parameters": {bad}}', []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("llama3_json", '{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', []),
    ("llama3_json", "<|python", "<|python", []),
    ("llama3_json", "<|python_tag|>brave_search.call(query='x')", "<|python_tag|>brave_search.call(query='x')", []),
    # mistral
    ("mistral", "Sure, [TOOL] is a word, and [TOOL_CALLS is not a marker.", "Sure, [TOOL] is a word, and [TOOL_CALLS is"
     " not a marker.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [("get_weather", WEATHER)]),
    ("mistral", 'Calling: [TOOL_CALLS] [{"name": "get_weather", "arguments": ' + NESTED + '}, {"name": "get_time", '
     '"arguments": {}}]', "Calling: ", [("get_weather", NESTED), ("get_time", "{}")]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" + NESTED + "[TOOL_CALLS]get_time[ARGS] {}", "",
     [("get_weather", NESTED), ("get_time", "{}")]),
    ("mistral", "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}", "", [("get_time", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {bad}}]',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {bad}}]', []),
    ("mistral", "[TOOL_CALLS] hello there", "[TOOL_CALLS] hello there", []),
    ("mistral", "[TOOL_CALLS]get time[ARGS]{}", "[TOOL_CALLS]get time[ARGS]{}", []),
    ("mistral", "[TOOL_CALLS]get_time[ARGS]x {}", "[TOOL_CALLS]get_time[ARGS]x {}", []),
    ("mistral", "The end [TOOL_CA", "The end [TOOL_CA", []),
    # deepseek_v3
    ("deepseek_v3", "No tools needed, a<b.", "No tools needed, a<b.", []),
    ("deepseek_v3", DS_BEGIN + _ds("get_weather", WEATHER) + DS_END, "", [("get_weather", WEATHER)]),
    ("deepseek_v3", "Checking.\n" + DS_BEGIN + _ds("get_weather", NESTED) + "\n" + _ds("get_time", "{}") + DS_END,
     "Checking.\n", [("get_weather", NESTED), ("get_time", "{}")]),
    ("deepseek_v3", DS_BEGIN + DS_CALL + "get_time" + DS_SEP + "{}" + DS_CALL_END + DS_END, "", [("get_time", "{}")]),
    ("deepseek_v3", DS_BEGIN + _ds("get_weather", "{oops") + DS_END, _ds("get_weather", "{oops"), []),
    ("deepseek_v3", "Thinking <｜tool▁call", "Thinking <｜tool▁call", []),
    # harmony
    ("harmony", "<|channel|>final<|message|>It is sunny, a <| b.<|return|>", "It is sunny, a <| b.", []),
    ("harmony", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>', "", [("get_weather", WEATHER)]),
    ("harmony", '<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to=functions.get_weather'
     '<|channel|>commentary json<|message|>' + NESTED + '<|call|><|start|>assistant<|channel|>commentary '
     'to=functions.get_time<|message|>{}<|call|>', "Checking both.", [("get_weather", NESTED), ("get_time", "{}")]),
    ("harmony", " to=functions.get_time<|channel|>commentary<|message|>{}", "", [("get_time", "{}")]),
    ("harmony", "<|channel|>commentary to=functions.get_time<|message|>{bad}<|call|>",
     "<|channel|>commentary to=functions.get_time<|message|>{bad}<|call|>", []),
    ("harmony", "<|channel|>commentary to=browser.search<|message|>{}<|call|>",
     "<|channel|>commentary to=browser.search<|message|>{}<|call|>", []),
    ("harmony", "Not harmony at all <|chan", "Not harmony at all <|chan", []),
    # qwen3_coder
    ("qwen3_coder", "Use <tool_call> tags, or <function=x>.", "Use <tool_call> tags, or <function=x>.", []),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "Sure.\n",
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=ratio>\n-1.5e2\n</parameter>\n<parameter=metric>\n"
     "True\n</parameter>\n<parameter=filters>\n{\"a\": [1]}\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
     "<parameter=days>\nthree\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n<parameter=when>\n2024\n</parameter>"
     "\n<parameter=other>\n x < y\n\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
     "</function>\n</tool_call>", "",
     [("get_weather", '{"ratio": -150.0, "metric": true, "filters": {"a": [1]}, "hours": [1, 2], "days": "three", '
       '"limit": null, "when": "2024", "other": " x < y\\n"}'), ("get_time", "{}")]),
    ("qwen3_coder", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "",
     [("get_weather", '{"city": "Par"}')]),
    ("qwen3_coder", "<tool_call><function=get_time>junk</function></tool_call>Bye", "Bye", [("get_time", "{}")]),
    ("qwen3_coder", "See <tool_", "See <tool_", []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_golden_output_under_every_split(fmt: str, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert _split_invariant(fmt, text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), [c[1:] for c in CASES if c[0] == "harmony"])
def test_harmony_without_calls_drops_what_would_be_a_call(text: str, content: str, calls: list) -> None:
    """``tool_choice: "none"`` (no tools offered): the same content as with calls, and never a call."""
    for cut in range(len(text) + 1):
        parser = HarmonyToolParser(calls=False)
        got = join_deltas([parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()])
        assert got == (content, []), f"split at {cut}: {text[:cut]!r}"


def test_partial_marker_is_held_until_known() -> None:
    parser = tool_call_parser("hermes")(TOOLS)
    assert parser.feed("Hello <tool_") == ParsedDelta("Hello ")
    assert parser.feed("x") == ParsedDelta("<tool_x")
    parser = tool_call_parser("hermes")(TOOLS)
    assert parser.feed("Hello <tool_") == ParsedDelta("Hello ")
    assert parser.finish() == ParsedDelta("<tool_")


def test_json_formats_emit_a_call_whole_at_its_end() -> None:
    parser = tool_call_parser("hermes")(TOOLS)
    text = _hermes("get_weather", WEATHER)
    assert parser.feed(text[:-3]) == ParsedDelta()
    (call,) = parser.feed(text[-3:]).tool_calls
    assert (call.index, call.name, call.arguments) == (0, "get_weather", WEATHER)
    assert call.id is not None and call.id.startswith("call_")


def test_qwen3_coder_streams_arguments_per_parameter() -> None:
    parser = tool_call_parser("qwen3_coder")(TOOLS)
    first = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa")
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_weather", "{")]
    second = parser.feed("ris\n</parameter>\n<parameter=days>\n")
    assert [(d.name, d.arguments) for d in second.tool_calls] == [(None, '"city": "Paris"')]
    third = parser.feed("2\n</parameter>\n</function>\n</tool_call>")
    assert [d.arguments for d in third.tool_calls] == [', "days": 2', "}"]


def test_parse_all_and_ids() -> None:
    content, calls = parse_all(tool_call_parser("hermes")(TOOLS), "Hi" + _hermes("get_time", "{}"))
    assert content == "Hi" and [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    assert calls[0].id.startswith("call_") and len(calls[0].id) > 10
    _, calls = parse_all(tool_call_parser("mistral")(TOOLS), "[TOOL_CALLS]get_time[ARGS]{}")
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()  # Mistral's templates accept only these back
    _, calls = parse_all(tool_call_parser("mistral")(TOOLS), "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}")
    assert calls[0].id == "a1B2c3D4e"


def test_feed_after_finish_is_an_error() -> None:
    parser: ToolCallParser = tool_call_parser("hermes")(TOOLS)
    parser.finish()
    assert parser.finish() == ParsedDelta()
    with pytest.raises(ValueError):
        parser.feed("x")


@pytest.mark.parametrize(
    ("raw", "kind", "value"),
    [("3", "integer", 3), ("3.0", "integer", "3.0"), ("1e999", "number", "1e999"), ("false", "boolean", False),
     ("[1]", "object", "[1]"), ("null", "string", "null"), ("null", "integer", None), ("x", None, "x")],
)
def test_qwen3_coder_conversion(raw: str, kind: str | None, value: object) -> None:
    assert convert_parameter(raw, kind) == value


@pytest.mark.parametrize(
    ("template", "name"),
    [
        ("...<tool_call>\n<function=example>\n<parameter=x>...", "qwen3_coder"),
        ("{{- '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}", "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] }}", "deepseek_v3"),
        ("<|start|>assistant<|channel|>analysis<|message|>", "harmony"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ('<|start_header_id|>user<|end_header_id|>{"name": function name, "parameters": dictionary}', "llama3_json"),
        ("{% for message in messages %}{{ message.content }}{% endfor %}", None),
        (None, None),
    ],
)
def test_parser_name_for_template(template: str | None, name: str | None) -> None:
    assert parser_name_for_template(template) == name


def test_unknown_format_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes"):
        tool_call_parser("nope")
