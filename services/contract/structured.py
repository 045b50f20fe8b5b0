"""A structured-output spec as llguidance grammar text: checked at the router's door and compiled by workers."""

from __future__ import annotations

import functools
import json

import llguidance

from services.contract.sampling_params import StructuredSpec

# Compact JSON (no free whitespace): the model cannot pad the document with endless blanks.
_JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredOutputError(ValueError):
    """The spec cannot be compiled (an invalid JSON schema, an unsupported feature)."""


@functools.lru_cache(maxsize=256)
def grammar_of(spec: StructuredSpec) -> str:
    """The grammar text of a spec, cached by spec; StructuredOutputError when the schema is not usable."""
    if spec.kind == "grammar":
        error = llguidance.LLMatcher.validate_grammar(spec.schema)
        if error:
            raise StructuredOutputError(f"the grammar cannot be used: {error}")
        return spec.schema
    schema = {"type": "object"} if spec.kind == "json_object" else json.loads(spec.schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise StructuredOutputError(f"the JSON schema cannot be used: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(f"the JSON schema cannot be used: {error}")
    return grammar


def check_spec(spec: StructuredSpec) -> None:
    """StructuredOutputError naming what is wrong with the spec (needs no tokenizer)."""
    grammar_of(spec)
