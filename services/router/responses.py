"""Response bodies in OpenAI's shapes: completion, chat completion, their stream chunks, usage, models.

Only the wire shapes live here (``answers.py`` fills them from the flow's deltas). ``object`` is
each Struct's msgspec tag, so it is always written; optional fields OpenAI leaves out are
``UNSET`` (never written) rather than null.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from msgspec import UNSET, UnsetType

from services.router.generation import Alternatives, Delta, Outcome
from services.text.tokenizer import Tokenizer


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET


def usage_of(prompt_outcomes: Sequence[Outcome], choice_outcomes: Sequence[Outcome]) -> Usage:
    """Usage over a request's prompts (each counted once, whatever ``n``; cached tokens as its first
    choice found them) and all its choices' completion tokens."""
    prompt_tokens = sum(o.num_prompt_tokens for o in prompt_outcomes)
    completion_tokens = sum(o.num_generated_tokens for o in choice_outcomes)
    cached = [o.num_cached_tokens for o in prompt_outcomes if o.num_cached_tokens is not None]
    details = PromptTokensDetails(sum(cached)) if cached else UNSET
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)


# ---- logprobs ------------------------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct):
    """Legacy completions logprobs: per token its text, logprob, and a dict of the ``logprobs`` most
    likely tokens plus the chosen one. With ``echo`` the prompt's tokens come first, the very first
    with null (nothing precedes it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob] = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class LogprobFormatter:
    """One choice's logprobs, its tokens named the same way throughout (text, or ``token_id:<id>``)."""

    def __init__(self, tokenizer: Tokenizer | None, as_token_ids: bool) -> None:
        self._tokenizer = tokenizer
        self._as_token_ids = as_token_ids
        self._text_offset = 0

    def _label(self, token_id: int) -> str:
        if self._as_token_ids or self._tokenizer is None:  # asked for, or no tokenizer
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, token_ids: Sequence[int], logprobs: Sequence[float | None],
                   top: Sequence[Alternatives | None] = ()) -> CompletionLogprobs:
        """``top[i]`` (when given): the alternatives at token ``i``; None for an echoed first token."""
        tokens = [self._label(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        dicts: list[dict[str, float] | None] = []
        for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
            if logprob is None:
                dicts.append(None)
                continue
            entry = {self._label(t): lp for t, lp in top[i]} if top else {}
            entry.setdefault(token, logprob)  # OpenAI: the chosen token is always there
            dicts.append(entry)
        return CompletionLogprobs(tokens, list(logprobs), dicts, offsets)

    def chat(self, token_ids: Sequence[int], logprobs: Sequence[float],
             top: Sequence[Alternatives] = ()) -> ChatLogprobs:
        content = []
        for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
            token = self._label(token_id)
            alternatives = [ChatTopLogprob(label, lp, list(label.encode("utf-8")))
                            for label, lp in ((self._label(t), lp) for t, lp in top[i])] if top else []
            content.append(ChatTokenLogprob(token, logprob, list(token.encode("utf-8")), alternatives))
        return ChatLogprobs(content)


# ---- completions ---------------------------------------------------------------------------------


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct, tag_field="object", tag="text_completion"):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CalledFunctionOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: CalledFunctionOut
    type: str = "function"


class ChatMessageOut(msgspec.Struct):
    """An answer: content (null when it is only tool calls), its calls, its reasoning (``reasoning_content``,
    and ``reasoning``, the name vLLM uses now, beside it)."""

    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, tag_field="object", tag="chat.completion"):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDeltaOut(msgspec.Struct):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallDeltaOut(msgspec.Struct):
    """One piece of one call: its first carries id, type and name, the rest arguments only (OpenAI's shape)."""

    index: int
    function: FunctionDeltaOut
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class ChatDelta(msgspec.Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDeltaOut] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, tag_field="object", tag="chat.completion.chunk"):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    # With stream_options.include_usage: null on every chunk but the last (choices empty).
    usage: Usage | None | UnsetType = UNSET
    # pdserve's own, on the last chunk only: how the response was served (routes.py), final.
    pdserve_route: str | UnsetType = UNSET


class CompletionChunk(msgspec.Struct, tag_field="object", tag="text_completion"):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    # pdserve's own, on the last chunk only: how the response was served (routes.py), final.
    pdserve_route: str | UnsetType = UNSET


def join_deltas(deltas: Sequence[Delta]) -> Delta:
    """One choice's whole answer as one delta (non-streaming responses)."""
    return Delta(
        text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        logprobs=tuple(lp for d in deltas for lp in d.logprobs),
        finish_reason=deltas[-1].finish_reason if deltas else None,
        top_logprobs=tuple(a for d in deltas for a in d.top_logprobs),
        prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
    )


# ---- models --------------------------------------------------------------------------------------


class ModelCard(msgspec.Struct, tag_field="object", tag="model"):
    id: str
    created: int
    owned_by: str = "pdserve"
    max_model_len: int | UnsetType = UNSET


class ModelList(msgspec.Struct, tag_field="object", tag="list"):
    data: list[ModelCard]
