"""Tool-call grammars: what llguidance lets SmolLM2's tokens spell is what each format's parser reads as valid calls.

Two vocabularies: SmolLM2's own, where every marker is text, and SmolLM2's with the formats' markers added as
special tokens, as in the models that speak them (Qwen, Mistral, DeepSeek, gpt-oss, Llama 3). Generation is a
seeded random walk over each mask, the harshest sampler: whatever it writes must parse and validate.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import jsonschema
import llguidance
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from services.contract.structured import StructuredOutputError
from services.contract.tool_formats import TOOL_CALL, TOOL_CALL_END, TOOL_CALLS
from services.contract.tool_grammar import MODES, TOOL_GRAMMAR_FORMATS, added_tokens, tool_call_grammar
from services.text import harmony as hm
from services.text.default_model import default_model_path
from services.text.tokenizer import Tokenizer
from services.text.tool_calls import deepseek_v3 as ds
from services.text.tool_calls import parse_all, tool_call_parser
from services.text.tool_calls.llama3_json import PYTHON_TAG
from services.text.tool_calls.mistral import ARGS

MARKERS = (TOOL_CALL, TOOL_CALL_END, TOOL_CALLS, ARGS, ds.CALLS_BEGIN, ds.CALLS_END, ds.CALL_BEGIN, ds.CALL_END,
           ds.SEP, hm.START, hm.CHANNEL, hm.MESSAGE, hm.CONSTRAIN, hm.END, hm.CALL, hm.RETURN, PYTHON_TAG)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any object
TOOLS = [WEATHER, NOW]
# What a call of get_weather(city="Paris", days=3) looks like after each format's trigger (compact JSON).
CANONICAL = {
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":3}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris","days":3}}]',
    "deepseek_v3": f'{ds.CALLS_BEGIN}{ds.CALL_BEGIN}function{ds.SEP}get_weather\n```json\n{{"city":"Paris","days":3}}'
                   f"\n```{ds.CALL_END}{ds.CALLS_END}",
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Paris","days":3}}',
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":3}',
}
# Other forms the grammars allow (the model writes the one it learnt), and a free object's arguments.
VARIANTS = {
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city":"Paris","days":3}[TOOL_CALLS]now[ARGS]{"tz":"UTC"}',
    "deepseek_v3": f'{ds.CALLS_BEGIN}{ds.CALL_BEGIN}get_weather{ds.SEP}{{"city":"Paris","days":3}}{ds.CALL_END}\n'
                   f'{ds.CALL_BEGIN}now{ds.SEP}{{"tz":"UTC"}}{ds.CALL_END}{ds.CALLS_END}',
    "hermes": CANONICAL["hermes"] + '\n<tool_call>\n{"name":"now","arguments":{"tz":"UTC"}}\n</tool_call>',
    "qwen3_coder": CANONICAL["qwen3_coder"] + "\n<tool_call>\n<function=now>\n<parameter=tz>\nUTC\n</parameter>\n"
                                              "</function>\n</tool_call>",
    "llama3_json": f'{PYTHON_TAG}{CANONICAL["llama3_json"]}; {{"name":"now","parameters":{{"tz":"UTC"}}}}',
    "harmony": f"<|channel|>analysis<|message|>Weather.{hm.END}{hm.START}assistant" + CANONICAL["harmony"],
}
# What starts an "auto" answer's call (after some text), and what a free answer looks like.
TRIGGERS = {"hermes": TOOL_CALL, "qwen3_coder": TOOL_CALL, "mistral": TOOL_CALLS, "deepseek_v3": ds.CALLS_BEGIN,
            "llama3_json": '{"name":"', "harmony": f"{hm.CHANNEL}commentary to=functions."}
LEAD = {"llama3_json": "", "harmony": f"{hm.CHANNEL}analysis{hm.MESSAGE}Let me see.{hm.END}{hm.START}assistant"}
FREE_LEAD = {"harmony": f"{hm.CHANNEL}final{hm.MESSAGE}"}


@dataclass(frozen=True)
class Vocab:
    """One llguidance tokenizer and the added tokens a grammar for it names by id."""

    tokenizer: llguidance.LLTokenizer
    special_tokens: dict[str, int]
    eos: frozenset[int]


@functools.cache
def vocab(with_markers: bool) -> Vocab:
    tokenizer = Tokenizer.from_gguf(default_model_path())
    backend = BackendTokenizer.from_str(tokenizer.backend_json())
    if with_markers:
        backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    text = backend.to_str()
    eos = sorted(tokenizer.eos_token_ids)
    lltok = llguidance.LLTokenizer(text, n_vocab=backend.get_vocab_size(with_added_tokens=True), eos_token=eos)
    return Vocab(lltok, added_tokens(text), frozenset(eos))


def _matcher(v: Vocab, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(v.tokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _walk(v: Vocab, matcher: llguidance.LLMatcher, seed: int, until_accepting: bool = False) -> list[int]:
    """Random allowed tokens until the matcher stops (or accepts); past a budget, special tokens first (they end
    harmony's free text). EOS tokens are not returned: the engine stops on them and shows no text."""
    rng, tokens, n_vocab = np.random.default_rng(seed), [], v.tokenizer.vocab_size
    for step in range(600):
        if matcher.is_stopped() or until_accepting and matcher.is_accepting():
            return [t for t in tokens if t not in v.eos]
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                                               bitorder="little")[:n_vocab])
        assert len(allowed), "a dead end: nothing may follow"
        special = [t for t in allowed if v.tokenizer.is_special_token(int(t))] if step > 150 else []
        token = int(rng.choice(special or allowed))
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    raise AssertionError(f"the walk did not end in 600 tokens: {_text(v, tokens)!r}")


def _text(v: Vocab, tokens: list[int]) -> str:
    return v.tokenizer.decode_bytes(tokens).decode()


def _check_calls(fmt: str, tools: list[dict], text: str, parallel: bool, named: str | None = None) -> str:
    """Parse ``text``; every call names a tool and its arguments validate; returns the content."""
    content, calls = parse_all(tool_call_parser(fmt)(tools), text)
    assert calls, f"no call in {text!r}"
    assert parallel or len(calls) == 1, text
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    for call in calls:
        assert call.name in schemas and (named is None or call.name == named), (call, text)
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    return content


# ---- random schemas ----------------------------------------------------------------------------------------------
_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
_SCALARS = st.one_of(
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.from_regex(r"[a-z][a-z ]{0,5}", fullmatch=True), min_size=1, max_size=3, unique=True).map(
        lambda values: {"type": "string", "enum": values}),
    st.tuples(st.integers(-50, 50), st.integers(0, 99)).map(
        lambda b: {"type": "integer", "minimum": b[0], "maximum": b[0] + b[1]}),
    st.just({"type": "number", "minimum": -10, "maximum": 10}),
    st.just({"type": "boolean"}),
)


def _objects(values: st.SearchStrategy) -> st.SearchStrategy:
    """Closed objects (no extra properties: generation stays bounded) with a random required list."""
    def build(properties: dict, data: st.DataObject) -> dict:
        required = data.draw(st.lists(st.sampled_from(sorted(properties)), unique=True)) if properties else []
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return st.builds(build, st.dictionaries(_NAMES, values, max_size=3), st.data())


_VALUES = st.one_of(_SCALARS, st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                                        _SCALARS, st.integers(0, 3)))
_PARAMETERS = _objects(st.one_of(_VALUES, _objects(_VALUES)))
_TOOLS = st.lists(_NAMES, min_size=1, max_size=3, unique=True).flatmap(lambda names: st.tuples(
    *[_PARAMETERS.map(lambda p, n=name: {"type": "function", "function": {"name": n, "parameters": p}})
      for name in names]))


@pytest.mark.parametrize("fmt", TOOL_GRAMMAR_FORMATS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tools=_TOOLS, mode=st.sampled_from(MODES), parallel=st.booleans(), markers=st.booleans(),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_random_walks_write_valid_calls(fmt: str, tools: tuple[dict, ...], mode: str, parallel: bool,
                                        markers: bool, seed: int, data: st.DataObject) -> None:
    """Required and named: the whole output is calls; auto: text, the trigger, then only valid calls."""
    tools = list(tools)
    markers = markers or fmt == "harmony"  # harmony's free text ends only at special tokens: a random walk needs them
    v = vocab(markers)
    named = data.draw(st.sampled_from([t["function"]["name"] for t in tools])) if mode == "named" else None
    matcher = _matcher(v, tool_call_grammar(tools, fmt, mode, parallel, function=named,
                                            special_tokens=v.special_tokens))
    prefix = ""
    if mode == "auto":
        prefix = LEAD.get(fmt, "Let me check. ") + TRIGGERS[fmt]
        assert matcher.consume_tokens(v.tokenizer.tokenize_str(prefix)), matcher.get_error()
    text = prefix + _text(v, _walk(v, matcher, seed, until_accepting=mode == "auto"))
    content = _check_calls(fmt, tools, text, parallel, named)
    # A walk that stops at the first accepting token may have written a little free text after the call.
    assert content.startswith("Let me check. ") if mode == "auto" and fmt not in LEAD else content == "", text


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("fmt", TOOL_GRAMMAR_FORMATS)
def test_every_grammar_validates_and_compiles(fmt: str, markers: bool) -> None:
    v = vocab(markers)
    for mode in MODES:
        for parallel in (False, True):
            grammar = tool_call_grammar(TOOLS, fmt, mode, parallel, function="now", special_tokens=v.special_tokens)
            assert llguidance.LLMatcher.validate_grammar(grammar) == ""
            _matcher(v, grammar)


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("fmt", TOOL_GRAMMAR_FORMATS)
def test_what_the_models_write_is_accepted_and_parses(fmt: str, markers: bool) -> None:
    """Tokenized as the tokenizer does (tokens spanning a marker and the JSON), each form, a free object's too."""
    v = vocab(markers)
    for text, parallel in ((CANONICAL[fmt], False), (VARIANTS[fmt], fmt != "harmony")):
        for mode in ("required", "auto"):
            matcher = _matcher(v, tool_call_grammar(TOOLS, fmt, mode, parallel, special_tokens=v.special_tokens))
            tokens = v.tokenizer.tokenize_str(text)
            assert matcher.validate_tokens(tokens) == len(tokens), (mode, text)
            assert matcher.consume_tokens(tokens) and matcher.is_accepting(), (mode, text)
            assert _check_calls(fmt, TOOLS, text, parallel) == ""


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("fmt", TOOL_GRAMMAR_FORMATS)
@settings(max_examples=10, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Cn", "Co")), max_size=30))
def test_auto_accepts_text_without_a_trigger(fmt: str, markers: bool, text: str) -> None:
    if fmt == "llama3_json" and text.lstrip().startswith("{"):
        text = "x" + text  # an answer that starts with "{" is a call
    v = vocab(markers)
    answer = FREE_LEAD.get(fmt, "") + text.replace("<|", "<")
    matcher = _matcher(v, tool_call_grammar(TOOLS, fmt, "auto", True, special_tokens=v.special_tokens))
    tokens = v.tokenizer.tokenize_str(answer)
    assert matcher.consume_tokens(tokens) and matcher.is_accepting(), answer


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "mistral", "deepseek_v3"])
def test_auto_refuses_what_is_not_a_call_after_the_trigger(fmt: str, markers: bool) -> None:
    v = vocab(markers)
    grammar = tool_call_grammar(TOOLS, fmt, "auto", True, special_tokens=v.special_tokens)
    trigger = TRIGGERS[fmt]
    for text in (f"Sure. {trigger} not a call", f"Sure. {trigger}\n{{\"name\":\"nope\"", f"Sure. {trigger}[{{]"):
        tokens = v.tokenizer.tokenize_str(text)
        assert _matcher(v, grammar).validate_tokens(tokens) < len(tokens), text
    if not markers:
        return
    # A special trigger spelled in ordinary pieces is not free text either (a parser reading text sees a call).
    pieces = [t for i in range(0, len(trigger), 2) for t in v.tokenizer.tokenize_str(trigger[i:i + 2])]
    tokens = v.tokenizer.tokenize_str("Sure. ") + pieces
    assert _matcher(v, grammar).validate_tokens(tokens) < len(tokens)


def test_named_mode_calls_only_that_function() -> None:
    v = vocab(False)
    grammar = tool_call_grammar(TOOLS, "hermes", "named", False, function="now")
    wrong = v.tokenizer.tokenize_str(CANONICAL["hermes"])
    assert _matcher(v, grammar).validate_tokens(wrong) < len(wrong)
    right = v.tokenizer.tokenize_str('<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>')
    matcher = _matcher(v, grammar)
    assert matcher.consume_tokens(right) and matcher.is_stopped()


@pytest.mark.parametrize(("args", "match"), [
    ((TOOLS, "chatml", "auto", True), "format"),
    ((TOOLS, "hermes", "sometimes", True), "mode"),
    ((TOOLS, "hermes", "named", True), "not among"),
    (([], "hermes", "required", True), "at least one"),
    (([{"type": "function", "function": {"name": "a b"}}], "hermes", "auto", True), "function name"),
    (([NOW, NOW], "hermes", "auto", True), "twice"),
    (([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "hermes", "auto", True),
     "object"),
    (([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}],
      "hermes", "auto", True), "cannot be used"),
])
def test_bad_requests_are_refused_by_name(args: tuple, match: str) -> None:
    with pytest.raises(StructuredOutputError, match=match):
        tool_call_grammar(*args)
