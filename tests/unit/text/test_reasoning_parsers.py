"""Reasoning parsers: golden outputs re-split at every boundary, and reasoning-then-tools for harmony."""

from __future__ import annotations

import random

import pytest

from services.text.reasoning import (
    REASONING_PARSERS,
    ReasoningDelta,
    join_reasoning,
    parse_reasoning,
    prompt_starts_in_reasoning,
    reasoning_parser,
    reasoning_parser_name_for_template,
)
from services.text.tool_calls import join_deltas, tool_call_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _splits(text: str) -> list[list[str]]:
    """Every two-way split, char by char, and a few random multi-way splits."""
    ways = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 12))))
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return ways


def _run(fmt: str, pieces: list[str], starts_in_reasoning: bool) -> tuple[str, str]:
    parser = reasoning_parser(fmt)(starts_in_reasoning=starts_in_reasoning)
    return join_reasoning([parser.feed(piece) for piece in pieces] + [parser.finish()])


HARMONY_CALL = (
    "<|channel|>analysis<|message|>User wants weather; a <| b.<|end|><|start|>assistant<|channel|>commentary"
    '<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
    '<|message|>{"city": "Paris"}<|call|>'
)
CASES: list[tuple[str, bool, str, str, str]] = [
    ("think", False, "Just an answer, a < b.", "", "Just an answer, a < b."),
    ("think", False, "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "\n\nHello!"),
    ("think", False, "Preface <think>hmm</think>answer <think>again</think>", "hmm",
     "Preface answer <think>again</think>"),
    ("think", False, "<think>still thinking when cut off", "still thinking when cut off", ""),
    ("think", False, "Answer with a dangling <thi", "", "Answer with a dangling <thi"),
    ("think", True, "reasoning from the prompt's <think>\n</think>\n\nAnswer.", "reasoning from the prompt's <think>\n",
     "\n\nAnswer."),
    ("think", True, "all reasoning, </thin", "all reasoning, </thin", ""),
    ("deepseek_r1", True, "r</think>c", "r", "c"),
    ("harmony", False, "<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hi!<|return|>", "Simple greeting.", "Hi!"),
    ("harmony", False, "<|channel|>analysis<|message|>cut off", "cut off", ""),
    ("harmony", False, "plain text, no harmony <|st", "", "plain text, no harmony <|st"),
    ("harmony", False, HARMONY_CALL, "User wants weather; a <| b.", "Checking.<|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'),
]


@pytest.mark.parametrize(("fmt", "starts", "text", "reasoning", "content"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_golden_output_under_every_split(fmt: str, starts: bool, text: str, reasoning: str, content: str) -> None:
    for pieces in _splits(text):
        assert _run(fmt, pieces, starts) == (reasoning, content), pieces


def _reasoning_then_tools(reasoning_fmt: str, tools_fmt: str, pieces: list[str]) -> tuple[str, str, list]:
    """The router's composition: each reasoning delta's content goes to the tool-call parser."""
    reasoner = reasoning_parser(reasoning_fmt)()
    tools = tool_call_parser(tools_fmt)(TOOLS)
    reasoning: list[str] = []
    deltas = []
    for delta in [reasoner.feed(piece) for piece in pieces] + [reasoner.finish()]:
        reasoning.append(delta.reasoning)
        deltas.append(tools.feed(delta.content))
    deltas.append(tools.finish())
    content, calls = join_deltas(deltas)
    return "".join(reasoning), content, [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize(
    ("reasoning_fmt", "tools_fmt", "text", "expected"),
    [
        ("harmony", "harmony", HARMONY_CALL,
         ("User wants weather; a <| b.", "Checking.", [("get_weather", '{"city": "Paris"}')])),
        ("harmony", "harmony", " to=functions.get_weather<|channel|>commentary json<|message|>{}<|call|>"
         "<|start|>assistant<|channel|>final<|message|>Done.", ("", "Done.", [("get_weather", "{}")])),
        ("think", "hermes", '<think>call it</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n'
         "</tool_call>", ("call it", "\n\n", [("get_weather", "{}")])),
    ],
)
def test_reasoning_then_tools(reasoning_fmt: str, tools_fmt: str, text: str, expected: tuple) -> None:
    for pieces in _splits(text):
        assert _reasoning_then_tools(reasoning_fmt, tools_fmt, pieces) == expected, pieces


def test_harmony_tool_parser_alone_drops_analysis() -> None:
    parser = tool_call_parser("harmony")(TOOLS)
    content, calls = join_deltas([parser.feed(HARMONY_CALL), parser.finish()])
    assert content == "Checking." and [c.name for c in calls] == ["get_weather"]


def test_partial_marker_is_held_until_known() -> None:
    parser = reasoning_parser("think")()
    assert parser.feed("<thi") == ReasoningDelta()
    assert parser.feed("nk>ab</th") == ReasoningDelta(reasoning="ab")
    assert parser.feed("ink>c") == ReasoningDelta(content="c")
    assert parser.finish() == ReasoningDelta()
    with pytest.raises(ValueError):
        parser.feed("x")


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_every_format_keeps_the_feed_finish_guard(name: str) -> None:
    parser = reasoning_parser(name)()
    parser.feed("text")
    parser.finish()
    assert parser.finish() == ReasoningDelta()
    with pytest.raises(ValueError, match="fed after finish"):
        parser.feed("x")


def test_parse_reasoning_and_registry() -> None:
    assert parse_reasoning(reasoning_parser("qwen3")(), "<think>a</think>b") == ("a", "b")
    with pytest.raises(ValueError, match="think"):
        reasoning_parser("nope")
    assert reasoning_parser_name_for_template("{{ '<think>\\n' }}...{{ '</think>' }}") == "think"
    assert reasoning_parser_name_for_template("<|start|>assistant<|channel|>final") == "harmony"
    assert reasoning_parser_name_for_template("{{ messages }}") is None


@pytest.mark.parametrize(
    ("prompt", "starts"),
    [("<｜User｜>hi<｜Assistant｜><think>\n", True), ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
     ("<|im_start|>assistant\n", False)],
)
def test_prompt_starts_in_reasoning(prompt: str, starts: bool) -> None:
    assert prompt_starts_in_reasoning(prompt) is starts
