"""Tool calling and reasoning on random checkpoints whose tokenizer and chat template speak the format, as the real
ones do, served 1P1D with every request disaggregated (``--direct-decode-threshold 0``).

- A Qwen3-style checkpoint: Hermes ``<tool_call>`` markers and ``<think>``/``</think>`` as added tokens, a Qwen-like
  template that writes the tools in the system prompt and ``<tool_call>`` history (the router reads the format from
  it: hermes, think). ``required`` and named choices give calls valid against the tools' schemas, streamed and not;
  the generated ids equal a colocated engine's under the same prompt and grammar (the grammar runs on prefill's
  first token and on decode: P and D must agree on its state), also prefill TP 1 -> decode TP 2.
- A gpt-oss checkpoint with a harmony tokenizer and template: a ``required`` call is a harmony commentary message
  parsed into ``tool_calls``; an analysis message is ``reasoning_content``; free text is split as the raw ids say,
  and no harmony marker reaches the content.

A random model writes random tokens: structure comes from the grammar (and ``logit_bias`` to pick a branch of it),
correctness from exact equality with the colocated engine and with the raw generated ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import msgspec
import openai
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.router.chat_output import resolve_formats
from services.router.chat_plan import chat_plan
from services.router.protocol import ChatCompletionRequest
from services.text.tokenizer import Tokenizer
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import TP_PAIRS, Stack, http_client, pull_totals, stack
from tests.e2e.tool_fixtures import add_tool, tool_schemas, weather_tool

WEATHER = weather_tool(city_max_length=8)
ADD = add_tool(minimum=0, maximum=999)
TOOLS = [WEATHER, ADD]
SCHEMAS = tool_schemas(TOOLS)
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NAMED_ADD = {"type": "function", "function": {"name": "add"}}
MAX_TOKENS = 72
TOKEN_IDS = {"logprobs": True, "return_tokens_as_token_ids": True}
# The think format's grammar lets an answer think first (<think>...</think>, then the calls): a random model that
# takes <think> writes on to the length limit. Its calls are asked for without <think> (ids: QWEN_ADDED after the
# 256 bytes and 3 special tokens), one call (parallel, it writes calls to the length limit).
QWEN_THINK, QWEN_THINK_END = 261, 262
ONE_CALL = {"parallel_tool_calls": False, "logit_bias": {str(QWEN_THINK): -100}}

QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")
# Qwen3's template, shortened: tools in the system prompt, calls and results in the history, thinking in history.
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{% if not loop.first or m.content %}\n{% endif %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

HARMONY_SPECIAL = ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                   "<|return|>", "<|call|>")
# gpt-oss's harmony template, shortened: the tools as a TypeScript namespace in the developer message.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT.\nReasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{%- endif %}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{%- for t in tools %}// {{ t.function.description }}\ntype {{ t.function.name }} = (_: "
    "{{ t.function.parameters | tojson }}) => any;\n\n{% endfor %}} // namespace functions<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{%- for c in m.tool_calls %}<|start|>assistant<|channel|>"
    "commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments | tojson }}"
    "<|call|>{%- endfor %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


def _write_tokenizer(directory: Path, special: tuple[str, ...], added: tuple[str, ...], eos: str | list[str],
                     template: str) -> Tokenizer:
    """A byte-level tokenizer (one token per byte, ids < 256) with the format's markers as added tokens after it,
    inside the checkpoints' 320-token vocabulary; the model's EOS ids written where the real checkpoints have them
    (and a context long enough for byte-long prompts)."""
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = BackendTokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in special])
    backend.add_tokens([AddedToken(t, special=False) for t in added])
    backend.save(str(directory / "tokenizer.json"))
    eos_list = [eos] if isinstance(eos, str) else eos
    eos_ids = [backend.token_to_id(t) for t in eos_list]
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": eos_list[0], "add_bos_token": False, "chat_template": template}))
    for name in ("config.json", "generation_config.json"):
        path = directory / name
        config = json.loads(path.read_text()) if path.exists() else {}
        if name == "config.json":  # a byte per token: the prompts with tools are ~1000 tokens long
            config["max_position_embeddings"] = 2048
        config.update(bos_token_id=None, eos_token_id=eos_ids if name == "generation_config.json" else eos_ids[0],
                      pad_token_id=backend.token_to_id("<|endoftext|>"))
        path.write_text(json.dumps(config))
    return Tokenizer.from_hf_dir(directory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[str, Tokenizer]:
    directory, _ = make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3_tools"), seed=5)
    return str(directory), _write_tokenizer(directory, QWEN_SPECIAL, QWEN_ADDED, "<|im_end|>", QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[str, Tokenizer]:
    directory, _ = make_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss_tools"), seed=3)
    return str(directory), _write_tokenizer(directory, HARMONY_SPECIAL, (), ["<|return|>", "<|call|>"],
                                            HARMONY_TEMPLATE)


def _served(model: str) -> Iterator[tuple[Stack, openai.OpenAI]]:
    with stack(model, 1, 1, "--direct-decode-threshold", "0") as s:
        yield s, openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def qwen3_served(qwen3) -> Iterator[tuple[Stack, openai.OpenAI]]:
    yield from _served(qwen3[0])


@pytest.fixture(scope="module")
def gpt_oss_served(gpt_oss) -> Iterator[tuple[Stack, openai.OpenAI]]:
    yield from _served(gpt_oss[0])


class Colocated:
    """One engine doing prefill and decode (CPU, float32, as the workers run), given the router's own chat plan:
    the prompt ids and the tool choice's grammar, so its ids are what a disaggregated answer must equal."""

    def __init__(self, model: str, tokenizer: Tokenizer) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=256))
        self.tokenizer, self.formats = tokenizer, resolve_formats(tokenizer)

    def __call__(self, body: dict) -> list[int]:
        request = msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)
        plan = chat_plan(request, self.tokenizer, self.formats)
        assert plan.grammar is not None
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0, structured=plan.grammar,
                                logit_bias=tuple(sorted((int(k), v) for k, v in body.get("logit_bias", {}).items())))
        return self.engine.generate([plan.prompt_token_ids], params)[0].token_ids


def _chat(url: str, body: dict, stream: bool = False) -> tuple[dict, list[int]]:
    """The message (joined from the deltas when streamed: content, reasoning, calls by index), its finish reason and
    the generated token ids (logprobs named by id), straight over HTTP."""
    body = {"temperature": 0, **TOKEN_IDS, **body, "stream": stream}
    with http_client(timeout=300) as client:
        if not stream:
            response = client.post(f"{url}/v1/chat/completions", json=body)
            response.raise_for_status()
            choice = response.json()["choices"][0]
            return {**choice["message"], "finish_reason": choice["finish_reason"]}, _ids(choice["logprobs"])
        message: dict = {"content": None, "reasoning_content": None, "tool_calls": None, "finish_reason": None}
        ids: list[int] = []
        calls: dict[int, dict] = {}
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"]
                    for key in ("content", "reasoning_content"):
                        if delta.get(key):
                            message[key] = (message[key] or "") + delta[key]
                    for piece in delta.get("tool_calls") or ():
                        if piece.get("id") is not None:
                            calls[piece["index"]] = {"id": piece["id"], "type": piece["type"],
                                                     "function": {"name": piece["function"]["name"],
                                                                  "arguments": ""}}
                        calls[piece["index"]]["function"]["arguments"] += piece["function"].get("arguments") or ""
                    message["finish_reason"] = choice.get("finish_reason") or message["finish_reason"]
                    ids += _ids(choice.get("logprobs"))
        message["tool_calls"] = [calls[i] for i in sorted(calls)] or None
        return message, ids


def _ids(logprobs: dict | None) -> list[int]:
    return [int(e["token"].removeprefix("token_id:")) for e in (logprobs or {}).get("content") or ()]


def _calls(message: dict) -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each checked against its tool's schema."""
    out = []
    for call in message.get("tool_calls") or ():
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
        out.append((call["function"]["name"], arguments))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Qwen3-style: hermes calls, <think> reasoning


def test_qwen3_formats_come_from_the_template(qwen3) -> None:
    formats = resolve_formats(qwen3[1])
    assert (formats.tool_format, formats.reasoning_format, formats.template_reads_tools) == ("hermes", "think", True)
    assert {"<tool_call>", "</tool_call>"} <= set(formats.special_tokens)
    assert (qwen3[1].token_to_id("<think>"), qwen3[1].token_to_id("</think>")) == (QWEN_THINK, QWEN_THINK_END)


def test_qwen3_required_and_named_calls_through_the_sdk_validate_and_are_pulled(qwen3_served) -> None:
    s, client = qwen3_served
    model = client.models.list().data[0].id
    before = pull_totals(s.decode[0])
    answer = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=MAX_TOKENS, **ONE_CALL)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    assert not choice.message.content
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED_ADD,
                                           temperature=0, max_tokens=MAX_TOKENS, **ONE_CALL)
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"] and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), ADD["function"]["parameters"])
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                temperature=0, max_tokens=MAX_TOKENS, stream=True, **ONE_CALL):
        for piece in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            if piece.id is not None:
                streamed[piece.index] = [piece.function.name, ""]
            streamed[piece.index][1] += piece.function.arguments or ""
    assert [(name, json.loads(arguments)) for name, arguments in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    after = pull_totals(s.decode[0])
    assert after["pulls"] - before["pulls"] >= 3 and after["recomputed"] == before["recomputed"]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_qwen3_disaggregated_ids_equal_colocated_under_the_grammar(qwen3, qwen3_served, choice: str) -> None:
    """The generated ids equal one engine's under the same grammar, streamed or not, and they are the format's
    markers by id around the call the answer reports (so the answer is the ids' parse, not a guess)."""
    model, tokenizer = qwen3
    s, _ = qwen3_served
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": MAX_TOKENS, **ONE_CALL,
            "tool_choice": "required" if choice == "required" else NAMED_ADD}
    before = pull_totals(s.decode[0])
    message, ids = _chat(s.url, body)
    streamed, streamed_ids = _chat(s.url, body, stream=True)
    after = pull_totals(s.decode[0])
    assert after["pulls"] - before["pulls"] == 2 and after["recomputed"] == before["recomputed"]
    reference = Colocated(model, tokenizer)(body)
    assert ids == streamed_ids == reference
    assert message["finish_reason"] == streamed["finish_reason"] == "tool_calls"
    assert _calls(message) == _calls(streamed) and _calls(message)
    if choice == "named":
        assert [name for name, _ in _calls(message)] == ["add"]
    # The raw ids: <tool_call> and </tool_call> as their added tokens, the JSON between them the reported calls.
    open_id, close_id = tokenizer.token_to_id("<tool_call>"), tokenizer.token_to_id("</tool_call>")
    assert ids[0] == open_id and close_id in ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    raw = [json.loads(m) for m in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)]
    assert [(c["name"], c["arguments"]) for c in raw] == _calls(message)


def test_qwen3_thinking_then_a_call_splits_as_the_raw_ids_say(qwen3, qwen3_served) -> None:
    """A small bias on ``</think>`` ends the thought the grammar allows before the call: reasoning_content is the
    text between the tags of the generated ids, the call the JSON after them, streamed or not, pulled as colocated."""
    model, tokenizer = qwen3
    s, _ = qwen3_served
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": MAX_TOKENS,
            "parallel_tool_calls": False, "logit_bias": {str(QWEN_THINK_END): 4}}
    message, ids = _chat(s.url, body)
    streamed, streamed_ids = _chat(s.url, body, stream=True)
    assert ids == streamed_ids == Colocated(model, tokenizer)(body)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    thought = re.fullmatch(r"<think>(.*?)</think>\n*<tool_call>\n(.*)\n</tool_call>", text, re.S)
    assert thought, text
    call = json.loads(thought.group(2))
    for answer in (message, streamed):
        assert answer["finish_reason"] == "tool_calls"
        assert answer["reasoning_content"] == thought.group(1)
        assert _calls(answer) == [(call["name"], call["arguments"])]
        assert not (answer.get("content") or "").strip()


def test_qwen3_history_with_a_call_and_its_result_continues_with_a_valid_call(qwen3_served) -> None:
    s, _ = qwen3_served
    history = ASK + [
        {"role": "assistant", "content": None, "reasoning_content": "The user wants weather.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "user", "content": "Now add 2 and 3."},
    ]
    message, ids = _chat(s.url, {"messages": history, "tools": TOOLS, "tool_choice": NAMED_ADD,
                                 "max_tokens": MAX_TOKENS, **ONE_CALL})
    assert message["finish_reason"] == "tool_calls" and [n for n, _ in _calls(message)] == ["add"]
    # The history rendered by the template: its prompt is longer than the question's by the turns' text at least.
    with http_client(timeout=60) as client:
        short = client.post(f"{s.url}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 1})
        long = client.post(f"{s.url}/v1/chat/completions", json={"messages": history, "tools": TOOLS,
                                                                  "max_tokens": 1})
    grown = long.json()["usage"]["prompt_tokens"] - short.json()["usage"]["prompt_tokens"]
    assert grown >= len('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
                        '</tool_call>{"temperature": 21}Now add 2 and 3.The user wants weather.') - 4


def test_qwen3_tp1_prefill_to_tp2_decode_equals_colocated(qwen3) -> None:
    model, tokenizer = qwen3
    prefill_args, decode_args = TP_PAIRS["P-tp1-D-tp2"]
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": MAX_TOKENS, **ONE_CALL}
    with stack(model, 1, 1, "--direct-decode-threshold", "0", prefill_args=prefill_args,
               decode_args=decode_args) as s:
        message, ids = _chat(s.url, body, stream=True)
        totals = pull_totals(s.decode[0])
    assert totals["pulls"] >= 1 and totals["recomputed"] == 0  # a pull per decode rank
    assert ids == Colocated(model, tokenizer)(body)
    assert message["finish_reason"] == "tool_calls" and _calls(message)


# ---------------------------------------------------------------------------------------------------------------
# gpt-oss: harmony calls and analysis reasoning


def _harmony_split(text: str) -> tuple[str, str, list[tuple[str, dict]]]:
    """(reasoning, content, calls) of generated harmony text, read by hand: messages separated by
    ``<|end|><|start|>assistant``, the first starting at the prompt's ``<|start|>assistant``."""
    reasoning, content, calls = "", "", []
    for message in re.split(r"<\|end\|><\|start\|>assistant", text.removesuffix("<|call|>")):
        header, _, body = message.partition("<|message|>")
        channel = re.match(r"<\|channel\|>(\w+)", header)
        assert channel, text
        recipient = re.search(r" to=functions\.(\w+)", header)
        if recipient:
            calls.append((recipient.group(1), json.loads(body)))
        elif channel.group(1) == "analysis":
            reasoning += body
        else:
            content += body
    return reasoning, content, calls


def test_gpt_oss_formats_come_from_the_template(gpt_oss) -> None:
    formats = resolve_formats(gpt_oss[1])
    assert (formats.tool_format, formats.reasoning_format, formats.template_reads_tools) == ("harmony", "harmony",
                                                                                              True)


def test_gpt_oss_required_call_is_parsed_into_tool_calls_and_equals_colocated(gpt_oss, gpt_oss_served) -> None:
    """``logit_bias`` on ``c`` picks the grammar's commentary branch over analysis: a call, whatever the weights."""
    model, tokenizer = gpt_oss
    s, client = gpt_oss_served
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 2 * MAX_TOKENS,
            "logit_bias": {str(tokenizer.token_to_id("c")): 30}}
    before = pull_totals(s.decode[0])
    message, ids = _chat(s.url, body)
    streamed, streamed_ids = _chat(s.url, body, stream=True)
    after = pull_totals(s.decode[0])
    assert after["pulls"] - before["pulls"] == 2 and after["recomputed"] == before["recomputed"]
    assert ids == streamed_ids == Colocated(model, tokenizer)(body)
    assert message["finish_reason"] == streamed["finish_reason"] == "tool_calls", message
    calls = _calls(message)
    assert len(calls) == 1 and calls == _calls(streamed)
    assert not message["content"] and not message.get("reasoning_content") and not streamed["content"]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|channel|>commentary to=functions.")
    assert _harmony_split(text) == ("", "", calls)
    # Through the SDK, named: the one function.
    named = client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS,
                                           tool_choice=NAMED_ADD, temperature=0, max_tokens=2 * MAX_TOKENS,
                                           logit_bias=body["logit_bias"])
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["add"]
    assert named.choices[0].finish_reason == "tool_calls" and not named.choices[0].message.content
    jsonschema.validate(json.loads(named.choices[0].message.tool_calls[0].function.arguments),
                        ADD["function"]["parameters"])


def test_gpt_oss_analysis_is_reasoning_content_not_content(gpt_oss, gpt_oss_served) -> None:
    """``logit_bias`` on ``a`` picks the analysis branch and then writes ``a`` on: all of it reasoning."""
    model, tokenizer = gpt_oss
    s, _ = gpt_oss_served
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 24,
            "logit_bias": {str(tokenizer.token_to_id("a")): 30}}
    message, ids = _chat(s.url, body)
    streamed, streamed_ids = _chat(s.url, body, stream=True)
    assert ids == streamed_ids == Colocated(model, tokenizer)(body)
    header = "<|channel|>analysis<|message|>"
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith(header)
    expected = "a" * (len(ids) - len(tokenizer.encode(header, add_special_tokens=False)))
    assert len(expected) > 8
    for answer in (message, streamed):
        assert answer["finish_reason"] == "length"
        assert answer["reasoning_content"] == expected
        assert not answer["content"] and not answer.get("tool_calls")


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_gpt_oss_free_answers_split_as_their_raw_ids_say(gpt_oss, gpt_oss_served, tool_choice: str) -> None:
    """Whatever the weights write: reasoning is the analysis bodies, content the rest, no marker in either."""
    _, tokenizer = gpt_oss
    s, _ = gpt_oss_served
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 24}
    message, ids = _chat(s.url, body)
    streamed, streamed_ids = _chat(s.url, body, stream=True)
    assert ids == streamed_ids and ids
    for answer in (message, streamed):
        for key in ("content", "reasoning_content"):
            assert "<|" not in (answer.get(key) or ""), answer
    if tool_choice == "auto":  # the grammar keeps it harmony: the hand split must agree
        reasoning, content, calls = _harmony_split(tokenizer.decode(ids, skip_special_tokens=False))
        assert (message.get("reasoning_content") or "") == reasoning == (streamed["reasoning_content"] or "")
        assert (message.get("content") or "") == content == (streamed["content"] or "")
        assert _calls(message) == calls == _calls(streamed)
