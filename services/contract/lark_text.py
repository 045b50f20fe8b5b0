"""Writing llguidance Lark grammars: markers that are special tokens or text, free text, inline JSON schemas.

One ``LarkWriter`` collects the rules of one grammar. What it knows that plain Lark does not:

- A marker (``<tool_call>``, ``[TOOL_CALLS]``, ``<|channel|>``) is a token of its own in some tokenizers and text
  in others, and llguidance treats every added token as special: a text literal never matches it, and a special
  token reference fails to compile where the tokenizer lacks it. So the writer is told the tokenizer's added
  tokens and writes ``<[id]>`` (by id: ``<[TOOL_CALLS]>`` would read as an id list) or the quoted text.
- Free text is ``/(?s:.*)/`` minus every string that would start a call (as text: a model can spell a special
  marker in ordinary pieces, which a parser reading decoded text cannot tell apart).
- Free text that ends at a text marker is one lazy lexeme (``TEXT "<tool_call>"``, ended at the first marker):
  a greedy text lexeme would swallow the marker's first bytes and never give them back. Before a special token
  no laziness is needed: no text regex matches a special token's bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

# Compact JSON (no free whitespace, ``,`` and ``:``); keywords llguidance does not implement are ignored rather than
# refused: a tool's schema is written for the model's prompt, and one odd keyword should not fail every request.
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": True}


def added_tokens(tokenizer_json: str) -> dict[str, int]:
    """The added tokens (text -> id) of a ``tokenizers`` JSON: the markers llguidance sees as special tokens."""
    return {token["content"]: token["id"] for token in json.loads(tokenizer_json).get("added_tokens", ())}


def quote(text: str) -> str:
    """A Lark string literal (llguidance reads JSON string escapes)."""
    return json.dumps(text)


class LarkWriter:
    """The rules of one grammar, written in order; ``text()`` is the grammar."""

    def __init__(self, special_tokens: Mapping[str, int]) -> None:
        self._special = special_tokens
        self._lines = ["%llguidance {}"]
        self._names: dict[str, str] = {}  # rule body -> its name, so equal bodies are written once
        self._count = 0

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"

    def is_special(self, marker: str) -> bool:
        return marker in self._special

    def marker(self, text: str) -> str:
        """A marker: its special token where the tokenizer has one, else its text."""
        return f"<[{self._special[text]}]>" if text in self._special else quote(text)

    def rule(self, body: str, name: str = "", options: str = "") -> str:
        """A rule for ``body`` (named ``name``, or a fresh name); returns its name."""
        key = f"{options}|{body}"
        if not name and key in self._names:
            return self._names[key]
        if not name:
            self._count += 1
            name = f"r{self._count}"
        self._names.setdefault(key, name)
        self._lines.append(f"{name}{f'[{options}]' if options else ''}: {body}")
        return name

    def start(self, body: str) -> None:
        self.rule(body, "start")

    def json(self, schema: Any) -> str:
        """A rule matching compact JSON valid against ``schema``."""
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": JSON_OPTIONS}
        return self.rule("%json " + json.dumps(schema, ensure_ascii=False))

    def free_text(self, excluded: Iterable[str] = (), pattern: str = r"(?s:.*)") -> str:
        """A terminal: text matching ``pattern`` (a regex) that contains none of ``excluded``."""
        body = f"/{_slashed(pattern)}/"
        excluded = sorted(set(excluded))
        if excluded:
            alternatives = "|".join(re.escape(text) for text in excluded)
            body += f" & ~/{_slashed(f'(?s:.*)(?:{alternatives})(?s:.*)')}/"
        return self.terminal(body)

    def terminal(self, body: str) -> str:
        """A terminal (one lexeme) for a regex expression ``body``; returns its name."""
        if body in self._names:
            return self._names[body]
        self._count += 1
        name = f"TEXT{self._count}"
        self._names[body] = name
        self._lines.append(f"{name}: {body}")
        return name

    def text_then(self, text: str, marker: str) -> str:
        """Free text (the terminal ``text``) up to and with ``marker``: two lexemes, or one lazy one for text."""
        if self.is_special(marker):
            return f"{text} {self.marker(marker)}"
        return self.rule(f"{text} {quote(marker)}", options="lazy")


def _slashed(regex: str) -> str:
    """A regex written between Lark's slashes."""
    return regex.replace("/", "\\/")
