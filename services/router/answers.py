"""Turn a request's deltas into its endpoint's answer: one body, or SSE chunks.

One class per endpoint with the same three calls (``full``, ``chunks``, ``usage_chunk``), so the
HTTP layer streams both endpoints with one loop. A request may have several choices (``n``, a
batch of prompts): deltas arrive tagged with their choice's index, and each choice keeps its own
state (its logprobs' text offsets, whether its role or echo went out).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import msgspec

from services.router.generation import Delta
from services.router.protocol import AnyRequest, ChatCompletionRequest, CompletionRequest
from services.router.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    LogprobFormatter,
    Usage,
)
from services.text.tokenizer import Tokenizer


class _Answer:
    def __init__(self, request_id: str, model: str, request: AnyRequest, tokenizer: Tokenizer | None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = request.include_usage
        self.wants_logprobs = request.wants_logprobs
        self._tokenizer = tokenizer
        self._as_token_ids = request.return_tokens_as_token_ids
        self._formatters: dict[int, LogprobFormatter] = {}

    def _formatter(self, index: int) -> LogprobFormatter:
        if index not in self._formatters:
            self._formatters[index] = LogprobFormatter(self._tokenizer, self._as_token_ids)
        return self._formatters[index]

    def _stream_usage(self) -> None | msgspec.UnsetType:
        """Chunks carry ``usage: null`` when usage was asked for, else no usage field at all."""
        return None if self.include_usage else msgspec.UNSET


class CompletionAnswer(_Answer):
    """``text_completion`` bodies; with ``echo`` each choice starts with its prompt (and its prompt's
    logprobs, when logprobs are asked for)."""

    def __init__(self, request_id: str, model: str, request: CompletionRequest, tokenizer: Tokenizer | None,
                 prompts: Sequence[Sequence[int]] = (), echo_texts: Sequence[str] | None = None) -> None:
        super().__init__(request_id, model, request, tokenizer)
        self._n = request.n
        self._prompts = prompts
        self._echo_texts = echo_texts if request.echo else None
        self._echoed: set[int] = set()

    def full(self, deltas: Mapping[int, Delta], usage: Usage) -> Completion:
        choices = []
        for index in sorted(deltas):
            delta = deltas[index]
            text, logprobs = self._echo(index, delta)
            logprobs = self._joined(logprobs, self._logprobs(index, delta))
            choices.append(CompletionChoice(index, text + delta.text, logprobs, delta.finish_reason))
        return Completion(self.request_id, self.created, self.model, choices, usage)

    def chunks(self, index: int, delta: Delta) -> list[CompletionChunk]:
        text, logprobs = self._echo(index, delta)
        if not (text or delta.text or delta.finish_reason or (self.wants_logprobs and delta.token_ids)):
            return []  # tokens whose text is still held back (half a character, a possible stop string)
        logprobs = self._joined(logprobs, self._logprobs(index, delta))
        choice = CompletionChoice(index, text + delta.text, logprobs, delta.finish_reason)
        return [CompletionChunk(self.request_id, self.created, self.model, [choice], usage=self._stream_usage())]

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return CompletionChunk(self.request_id, self.created, self.model, [], usage=usage)

    def _echo(self, index: int, delta: Delta) -> tuple[str, CompletionLogprobs | None]:
        """The prompt's text and logprobs, once per choice (with its first delta); else ("", None)."""
        if self._echo_texts is None or index in self._echoed:
            return "", None
        self._echoed.add(index)
        prompt_index = index // self._n
        logprobs = None
        if self.wants_logprobs:
            prompt = self._prompts[prompt_index]
            entries = delta.prompt_logprobs or (None,) * len(prompt)
            logprobs = self._formatter(index).completion(
                prompt, [e[0][1] if e else None for e in entries], [e[1:] if e else None for e in entries])
        return self._echo_texts[prompt_index], logprobs

    @staticmethod
    def _joined(first: CompletionLogprobs | None, second: CompletionLogprobs | None) -> CompletionLogprobs | None:
        if first is None or second is None:
            return second if first is None else first
        return CompletionLogprobs(first.tokens + second.tokens, first.token_logprobs + second.token_logprobs,
                                  first.top_logprobs + second.top_logprobs, first.text_offset + second.text_offset)

    def _logprobs(self, index: int, delta: Delta) -> CompletionLogprobs | None:
        if not self.wants_logprobs:
            return None
        return self._formatter(index).completion(delta.token_ids, delta.logprobs, delta.top_logprobs)


class ChatAnswer(_Answer):
    def __init__(self, request_id: str, model: str, request: AnyRequest, tokenizer: Tokenizer | None) -> None:
        super().__init__(request_id, model, request, tokenizer)
        self._sent_role: set[int] = set()

    def full(self, deltas: Mapping[int, Delta], usage: Usage) -> ChatCompletion:
        choices = [ChatChoice(index, ChatMessageOut("assistant", deltas[index].text),
                              self._logprobs(index, deltas[index]), deltas[index].finish_reason)
                   for index in sorted(deltas)]
        return ChatCompletion(self.request_id, self.created, self.model, choices, usage)

    def chunks(self, index: int, delta: Delta) -> list[ChatCompletionChunk]:
        out = []
        if index not in self._sent_role:
            # OpenAI opens each choice's stream with the role alone.
            self._sent_role.add(index)
            out.append(self._chunk(index, ChatDelta(role="assistant", content=""), None, None))
        if delta.text or (self.wants_logprobs and delta.token_ids):
            out.append(self._chunk(index, ChatDelta(content=delta.text), self._logprobs(index, delta), None))
        if delta.finish_reason is not None:
            out.append(self._chunk(index, ChatDelta(), None, delta.finish_reason))
        return out

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.request_id, self.created, self.model, [], usage=usage)

    def _chunk(self, index: int, delta: ChatDelta, logprobs: ChatLogprobs | None,
               finish_reason: str | None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index, delta, logprobs, finish_reason)
        return ChatCompletionChunk(self.request_id, self.created, self.model, [choice], usage=self._stream_usage())

    def _logprobs(self, index: int, delta: Delta) -> ChatLogprobs | None:
        if not self.wants_logprobs:
            return None
        return self._formatter(index).chat(delta.token_ids, delta.logprobs, delta.top_logprobs)


def answer_for(request_id: str, model: str, request: AnyRequest, tokenizer: Tokenizer | None,
               prompts: Sequence[Sequence[int]] = (),
               echo_texts: Sequence[str] | None = None) -> CompletionAnswer | ChatAnswer:
    if isinstance(request, ChatCompletionRequest):
        return ChatAnswer(request_id, model, request, tokenizer)
    return CompletionAnswer(request_id, model, request, tokenizer, prompts, echo_texts)
