"""Turn a request's deltas into its endpoint's answer: one body, or SSE chunks.

One class per endpoint with the same three calls (``full``, ``chunks``, ``usage_chunk``), so the
HTTP layer streams both endpoints with one loop. A request may have several choices (``n``, a
batch of prompts): deltas arrive tagged with their choice's index, and each choice keeps its own
state (its logprobs' text offsets, whether its role or echo went out).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import msgspec

from services.router.chat_output import ChatOutput, ChatPiece
from services.router.generation import Delta
from services.router.protocol import AnyRequest, ChatCompletionRequest, CompletionRequest
from services.router.responses import (
    CalledFunctionOut,
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
    FunctionDeltaOut,
    LogprobFormatter,
    ToolCallDeltaOut,
    ToolCallOut,
    Usage,
)
from services.router.streaming import DONE_EVENT, sse_event
from services.text.tokenizer import Tokenizer
from services.text.tool_calls import ParsedDelta, join_deltas


class _Answer:
    done_event = DONE_EVENT  # a stream's last event

    def __init__(self, request_id: str, model: str, request: AnyRequest, tokenizer: Tokenizer | None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = request.include_usage
        self.wants_logprobs = request.wants_logprobs
        self._tokenizer = tokenizer
        self._as_token_ids = request.return_tokens_as_token_ids
        self._formatters: dict[int, LogprobFormatter] = {}

    @staticmethod
    def sse(chunk: msgspec.Struct) -> bytes:
        return sse_event(chunk)

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
    """``chat.completion`` bodies, each choice's text read by its ``ChatOutput`` (reasoning, content, tool calls)."""

    def __init__(self, request_id: str, model: str, request: AnyRequest, tokenizer: Tokenizer | None,
                 new_output: Callable[[], ChatOutput] = ChatOutput) -> None:
        super().__init__(request_id, model, request, tokenizer)
        self._new_output = new_output
        self._outputs: dict[int, ChatOutput] = {}
        self._sent_role: set[int] = set()

    def full(self, deltas: Mapping[int, Delta], usage: Usage) -> ChatCompletion:
        choices = []
        for index in sorted(deltas):
            delta, output = deltas[index], self._new_output()
            piece = output.feed(delta.text, final=True)
            calls = join_calls([piece])
            message = ChatMessageOut("assistant", None if calls and not piece.content else piece.content)
            if calls:
                message.tool_calls = calls
            if piece.reasoning:
                message.reasoning_content = message.reasoning = piece.reasoning
            choices.append(ChatChoice(index, message, self._logprobs(index, delta),
                                      output.finish_reason(delta.finish_reason)))
        return ChatCompletion(self.request_id, self.created, self.model, choices, usage)

    def chunks(self, index: int, delta: Delta) -> list[ChatCompletionChunk]:
        out = []
        if index not in self._sent_role:
            # OpenAI opens each choice's stream with the role alone.
            self._sent_role.add(index)
            self._outputs[index] = self._new_output()
            out.append(self._chunk(index, ChatDelta(role="assistant", content=""), None, None))
        output = self._outputs[index]
        piece = output.feed(delta.text, final=delta.finish_reason is not None)
        if piece or (self.wants_logprobs and delta.token_ids):
            out.append(self._chunk(index, chat_delta(piece), self._logprobs(index, delta), None))
        if delta.finish_reason is not None:
            out.append(self._chunk(index, ChatDelta(), None, output.finish_reason(delta.finish_reason)))
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


def chat_delta(piece: ChatPiece) -> ChatDelta:
    """A piece of an answer in OpenAI's streamed shape (only the parts it has)."""
    delta = ChatDelta(content=piece.content) if piece.content or not (piece.reasoning or piece.tool_calls) \
        else ChatDelta()
    if piece.reasoning:
        delta.reasoning_content = delta.reasoning = piece.reasoning
    if piece.tool_calls:
        delta.tool_calls = [
            ToolCallDeltaOut(c.index, FunctionDeltaOut(name=c.name if c.name is not None else msgspec.UNSET,
                                                       arguments=c.arguments),
                             id=c.id if c.id is not None else msgspec.UNSET,
                             type="function" if c.id is not None else msgspec.UNSET)
            for c in piece.tool_calls]
    return delta


def join_calls(pieces: Sequence[ChatPiece]) -> list[ToolCallOut]:
    """The calls of an answer's pieces, whole (the non-streamed message)."""
    _, calls = join_deltas([ParsedDelta("", p.tool_calls) for p in pieces])
    return [ToolCallOut(c.id, CalledFunctionOut(c.name, c.arguments)) for c in calls]


def answer_for(request_id: str, model: str, request: AnyRequest, tokenizer: Tokenizer | None,
               prompts: Sequence[Sequence[int]] = (), echo_texts: Sequence[str] | None = None,
               new_output: Callable[[], ChatOutput] = ChatOutput) -> CompletionAnswer | ChatAnswer:
    """``new_output``: a chat choice's parsers (``chat_output.chat_output``); plain text by default."""
    if isinstance(request, ChatCompletionRequest):
        return ChatAnswer(request_id, model, request, tokenizer, new_output)
    return CompletionAnswer(request_id, model, request, tokenizer, prompts, echo_texts)
