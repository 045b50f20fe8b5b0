"""What a chat request needs beyond its sampling: its prompt (rendered with tools and the reasoning effort), the
grammar its tool choice asks for, and how its answer's text is read.

A ``<think>`` model's grammar (the tool choice's, or ``response_format``'s) follows its reasoning
(``services.contract.reasoning_grammar``): the tools and the structure apply to the answer after it.

A template that does not render tools (SmolLM2's, say) gets them the Hermes way, as most open models were
trained: a system message listing them and asking for ``<tool_call>`` JSON, earlier calls written as such.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from services.contract.reasoning_grammar import think_then
from services.contract.sampling_params import StructuredSpec
from services.contract.structured import StructuredOutputError
from services.contract.tool_grammar import tool_call_grammar
from services.router.chat_output import ChatFormats, ChatOutput, chat_output
from services.router.errors import InvalidRequest
from services.router.protocol import ChatCompletionRequest
from services.text.reasoning import prompt_starts_in_reasoning
from services.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatPlan:
    prompt_token_ids: list[int]
    grammar: StructuredSpec | None  # the tool choice's constraint, in place of response_format's; after any reasoning
    keep_special_tokens: bool  # the parsers read markers that may be special tokens
    new_output: Callable[[], ChatOutput]


def chat_plan(request: ChatCompletionRequest, tokenizer: Tokenizer | None, formats: ChatFormats) -> ChatPlan:
    """Render, tokenize and plan one chat request; a 400 naming what cannot be done."""
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer: send the prompt as a list of token ids", param="messages")
    mode = request.tool_mode
    if mode != "none" and formats.tool_format is None:
        raise InvalidRequest("tool calling is off on this server (--tool-call-parser none)", param="tools")
    messages, template_vars = request.template_messages(), request.template_vars()
    tools = template_vars.get("tools")  # absent when tool_choice is "none"
    if not formats.template_reads_tools:
        messages = hermes_messages(messages, template_vars.pop("tools", None))  # the template gets them as text
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                             **template_vars)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="messages") from None
    starts_in_reasoning = prompt_starts_in_reasoning(text)
    grammar = _grammar(request, formats, mode, tools) if tools is not None else None
    if formats.reasoning_format == "think":
        grammar = _after_reasoning(request, formats, grammar, starts_in_reasoning)

    def new_output() -> ChatOutput:
        return chat_output(formats, tools, starts_in_reasoning)

    probe = new_output()
    return ChatPlan(
        # The template writes its own BOS where it wants one.
        prompt_token_ids=tokenizer.encode(text, add_special_tokens=False),
        grammar=grammar,
        keep_special_tokens=probe.reasoning is not None or probe.tools is not None,
        new_output=new_output,
    )


def _grammar(request: ChatCompletionRequest, formats: ChatFormats, mode: str,
             tools: list[dict[str, Any]]) -> StructuredSpec | None:
    """The grammar of the calls the tool choice allows (``auto``: free text until a call starts) among ``tools``
    (all the request's, as the template got them)."""
    named = request.tool_choice.function.name if mode == "named" else None
    parallel = request.parallel_tool_calls and named is None  # a named choice is one call of it, as OpenAI's
    try:
        return _tool_grammar(formats, msgspec.json.encode(tools), mode, parallel, named)
    except StructuredOutputError as exc:
        raise InvalidRequest(str(exc), param="tools") from None


# Agents send the same tools every turn, and writing and checking their grammar takes milliseconds (20 tools: ~2.5 ms
# on one core): cached per model (``formats``, hashed by identity) and tools.
@functools.lru_cache(maxsize=256)
def _tool_grammar(formats: ChatFormats, tools: bytes, mode: str, parallel: bool, named: str | None) -> StructuredSpec:
    text = tool_call_grammar(msgspec.json.decode(tools), formats.tool_format, mode, parallel, function=named,
                             special_tokens=formats.special_tokens)
    return StructuredSpec("grammar", text)


@functools.lru_cache(maxsize=256)
def _think_then(formats: ChatFormats, grammar: StructuredSpec, starts_in_reasoning: bool) -> StructuredSpec:
    return think_then(grammar, starts_in_reasoning, formats.special_tokens)


def _after_reasoning(request: ChatCompletionRequest, formats: ChatFormats, grammar: StructuredSpec | None,
                     starts_in_reasoning: bool) -> StructuredSpec | None:
    """The grammar that applies (the tools', else response_format's) after a ``<think>`` block; None if none."""
    param = "tools" if grammar is not None else "response_format"
    if grammar is None and request.response_format is not None:
        grammar = request.response_format.spec()
    if grammar is None:
        return None
    try:
        return _think_then(formats, grammar, starts_in_reasoning)
    except StructuredOutputError as exc:
        raise InvalidRequest(str(exc), param=param) from None


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages with every call and result written as Hermes text, and the tools (if offered) in the system
    message: for a template that renders neither."""
    out = [dict(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        preamble = ("You may call one or more functions to assist with the user query. The functions are listed in "
                    f"<tools></tools> tags:\n<tools>\n{listing}\n</tools>\nFor each function call, return a JSON "
                    "object with the function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{preamble}"
        else:
            out.insert(0, {"role": "system", "content": preamble})
    for message in out:
        calls = message.pop("tool_calls", None)
        if calls:
            written = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]},
                                                           ensure_ascii=False) + "\n</tool_call>" for c in calls)
            message["content"] = f"{message['content'] or ''}{written}"
        if message["role"] == "tool":  # a result comes back as the user's turn, as Hermes templates write it
            message["role"] = "user"
            message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
            message.pop("tool_call_id", None)
    return out
