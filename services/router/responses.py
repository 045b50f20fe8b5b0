"""Response bodies in OpenAI's shapes: completion, chat completion, their stream chunks, usage, models.

Only the wire shapes live here (``answers.py`` fills them from the flow's deltas). ``object`` is
each Struct's msgspec tag, so it is always written; optional fields OpenAI leaves out are
``UNSET`` (never written) rather than null.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from msgspec import UNSET, UnsetType

from services.engine.tokenizer import Tokenizer
from services.router.flow import Delta, Outcome
from services.router.text import token_label


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET


def usage_of(outcome: Outcome) -> Usage:
    details = UNSET if outcome.num_cached_tokens is None else PromptTokensDetails(outcome.num_cached_tokens)
    return Usage(outcome.num_prompt_tokens, outcome.num_generated_tokens,
                 outcome.num_prompt_tokens + outcome.num_generated_tokens, details)


# ---- logprobs ------------------------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct):
    """Legacy completions logprobs; ``top_logprobs`` holds only the chosen token (logprobs=0)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[dict] = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class LogprobFormatter:
    """Names tokens for logprobs the same way across a request (text, or ``token_id:<id>``)."""

    def __init__(self, tokenizer: Tokenizer | None, as_token_ids: bool) -> None:
        self._tokenizer = tokenizer
        self._as_token_ids = as_token_ids
        self._text_offset = 0

    def completion(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> CompletionLogprobs:
        tokens = [token_label(self._tokenizer, t, self._as_token_ids) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return CompletionLogprobs(tokens, list(logprobs), [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)],
                                  offsets)

    def chat(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> ChatLogprobs:
        content = []
        for token_id, logprob in zip(token_ids, logprobs, strict=True):
            token = token_label(self._tokenizer, token_id, self._as_token_ids)
            content.append(ChatTokenLogprob(token, logprob, list(token.encode("utf-8"))))
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


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str


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


class ChatDelta(msgspec.Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


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


class CompletionChunk(msgspec.Struct, tag_field="object", tag="text_completion"):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET


def join_deltas(deltas: Sequence[Delta]) -> Delta:
    """The whole answer as one delta (non-streaming responses)."""
    return Delta(
        text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        logprobs=tuple(lp for d in deltas for lp in d.logprobs),
        finish_reason=deltas[-1].finish_reason if deltas else None,
    )


# ---- models --------------------------------------------------------------------------------------


class ModelCard(msgspec.Struct, tag_field="object", tag="model"):
    id: str
    created: int
    owned_by: str = "pdserve"
    max_model_len: int | UnsetType = UNSET


class ModelList(msgspec.Struct, tag_field="object", tag="list"):
    data: list[ModelCard]
