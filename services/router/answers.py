"""Turn a request's deltas into its endpoint's answer: one body, or SSE chunks.

One class per endpoint with the same three calls (``full``, ``chunks``, ``usage_chunk``), so the
HTTP layer streams both endpoints with one loop.
"""

from __future__ import annotations

import time

import msgspec

from services.engine.tokenizer import Tokenizer
from services.router.flow import Delta, Outcome
from services.router.protocol import AnyRequest, ChatCompletionRequest
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
    usage_of,
)


class _Answer:
    def __init__(self, request_id: str, model: str, request: AnyRequest, tokenizer: Tokenizer | None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = request.include_usage
        self.wants_logprobs = request.wants_logprobs
        self.logprobs = LogprobFormatter(tokenizer, request.return_tokens_as_token_ids)

    def _stream_usage(self) -> None | msgspec.UnsetType:
        """Chunks carry ``usage: null`` when usage was asked for, else no usage field at all."""
        return None if self.include_usage else msgspec.UNSET


class CompletionAnswer(_Answer):
    def full(self, delta: Delta, outcome: Outcome) -> Completion:
        choice = CompletionChoice(0, delta.text, self._logprobs(delta), delta.finish_reason)
        return Completion(self.request_id, self.created, self.model, [choice], usage_of(outcome))

    def chunks(self, delta: Delta) -> list[CompletionChunk]:
        if not (delta.text or delta.finish_reason or (self.wants_logprobs and delta.token_ids)):
            return []  # tokens whose text is still held back (half a character, a possible stop string)
        choice = CompletionChoice(0, delta.text, self._logprobs(delta), delta.finish_reason)
        return [CompletionChunk(self.request_id, self.created, self.model, [choice], usage=self._stream_usage())]

    def usage_chunk(self, outcome: Outcome) -> CompletionChunk:
        return CompletionChunk(self.request_id, self.created, self.model, [], usage=usage_of(outcome))

    def _logprobs(self, delta: Delta) -> CompletionLogprobs | None:
        return self.logprobs.completion(delta.token_ids, delta.logprobs) if self.wants_logprobs else None


class ChatAnswer(_Answer):
    def __init__(self, request_id: str, model: str, request: AnyRequest, tokenizer: Tokenizer | None) -> None:
        super().__init__(request_id, model, request, tokenizer)
        self._sent_role = False

    def full(self, delta: Delta, outcome: Outcome) -> ChatCompletion:
        choice = ChatChoice(0, ChatMessageOut("assistant", delta.text), self._logprobs(delta), delta.finish_reason)
        return ChatCompletion(self.request_id, self.created, self.model, [choice], usage_of(outcome))

    def chunks(self, delta: Delta) -> list[ChatCompletionChunk]:
        out = []
        if not self._sent_role:
            # OpenAI opens a chat stream with the role alone.
            self._sent_role = True
            out.append(self._chunk(ChatDelta(role="assistant", content=""), None, None))
        if delta.text or (self.wants_logprobs and delta.token_ids):
            out.append(self._chunk(ChatDelta(content=delta.text), self._logprobs(delta), None))
        if delta.finish_reason is not None:
            out.append(self._chunk(ChatDelta(), None, delta.finish_reason))
        return out

    def usage_chunk(self, outcome: Outcome) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.request_id, self.created, self.model, [], usage=usage_of(outcome))

    def _chunk(self, delta: ChatDelta, logprobs: ChatLogprobs | None, finish_reason: str | None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(0, delta, logprobs, finish_reason)
        return ChatCompletionChunk(self.request_id, self.created, self.model, [choice], usage=self._stream_usage())

    def _logprobs(self, delta: Delta) -> ChatLogprobs | None:
        return self.logprobs.chat(delta.token_ids, delta.logprobs) if self.wants_logprobs else None


def answer_for(request_id: str, model: str, request: AnyRequest,
               tokenizer: Tokenizer | None) -> CompletionAnswer | ChatAnswer:
    kind = ChatAnswer if isinstance(request, ChatCompletionRequest) else CompletionAnswer
    return kind(request_id, model, request, tokenizer)
