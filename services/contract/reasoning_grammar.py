"""Any grammar (a tool grammar, a JSON schema's) after a ``<think>...</think>`` block: the model reasons first.

A grammar applies from the first generated token, so a model that thinks before it answers (Qwen3, DeepSeek-R1)
could not under ``tool_choice`` required/named or ``response_format``: structured output and tools are meant for
the answer after the reasoning. The result is one llguidance request of two grammars: the reasoning, then
``@answer``, the answer's grammar unchanged (its own lexer, its own lazy rules and ``%json``).

- ``starts_in_reasoning`` (the prompt ended with ``<think>``): free text, then ``</think>``, then the answer;
- otherwise an optional ``<think>`` free text ``</think>`` block, then the answer.

The reasoning never contains ``</think>`` as text (the reasoning parser, reading decoded text, would end there).
The markers are special tokens where the tokenizer has them (``lark_text.LarkWriter.marker``). Between
``</think>`` and the answer: up to two newlines, as the models write them (Qwen3 and DeepSeek-R1: ``</think>\\n\\n``).
Harmony's reasoning (analysis messages) is written inside the harmony tool grammar, not here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import llguidance

from services.contract.lark_text import LarkWriter
from services.contract.sampling_params import StructuredSpec
from services.contract.structured import StructuredOutputError, grammar_of
from services.text.reasoning.think import THINK_END, THINK_START

ANSWER = "answer"  # the name the reasoning grammar calls the answer's grammar by
_BETWEEN = r"/\n{1,2}/"  # after </think>, before the answer (none at all: the rule is optional)

__all__ = ["ANSWER", "think_then"]


def think_then(answer: StructuredSpec, starts_in_reasoning: bool,
               special_tokens: Mapping[str, int] | None = None) -> StructuredSpec:
    """A grammar spec: think reasoning, then ``answer`` (any spec: a grammar, a JSON schema, a JSON object).

    ``special_tokens``: the tokenizer's added tokens (text -> id). StructuredOutputError when ``answer`` cannot
    be used or is a list of several grammars (their ``@index`` references would shift).
    """
    grammars = _grammars(grammar_of(answer))
    if len(grammars) != 1:
        raise StructuredOutputError("a grammar of several grammars cannot follow the reasoning")
    top = {"grammars": [{"lark_grammar": _reasoning_lark(starts_in_reasoning, special_tokens or {})},
                        {**grammars[0], "name": ANSWER}]}
    text = json.dumps(top, ensure_ascii=False)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise StructuredOutputError(f"the grammar cannot follow the reasoning: {error}")
    return StructuredSpec("grammar", text)


def _reasoning_lark(starts_in_reasoning: bool, special_tokens: Mapping[str, int]) -> str:
    """The outer grammar: the reasoning block (required or optional), the newlines, then ``@answer``."""
    writer = LarkWriter(special_tokens)
    thought = writer.text_then(writer.free_text([THINK_END]), THINK_END)
    between = writer.terminal(_BETWEEN)
    if starts_in_reasoning:
        writer.start(f"{thought} {between}? @{ANSWER}")
    else:
        writer.start(f"({writer.marker(THINK_START)} {thought} {between}?)? @{ANSWER}")
    return writer.text()


def _grammars(text: str) -> list[dict]:
    """The grammars of a grammar text: a JSON request (``{"grammars": [...]}``) or one Lark grammar."""
    if text.lstrip().startswith("{"):
        try:
            grammars = json.loads(text).get("grammars")
        except (ValueError, AttributeError):
            grammars = None
        if isinstance(grammars, list) and all(isinstance(g, dict) for g in grammars):
            return grammars
    return [{"lark_grammar": text}]
