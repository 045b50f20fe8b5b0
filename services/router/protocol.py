"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``, decoded and checked at the door.

Types and ranges are declared on the Structs, so msgspec rejects a wrong type or an out-of-range
number with the JSON path of the field; what needs more than one field, or is an OpenAI feature
pdserve does not have, is checked in ``check()``. Unknown fields are ignored, as OpenAI does; known
ones we cannot honour (``n`` > 1, ``echo``, alternatives in ``logprobs``) are a 400 rather
than a silently different answer. Nothing here talks to a worker.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from services.proto_gen.pdserve.v1 import worker_pb2
from services.router.errors import InvalidRequest, from_decode_error

_MAX_U31 = 2**31 - 1
_TOKEN_ID_KEY = re.compile(r"[0-9]+")
PositiveInt = Annotated[int, Meta(ge=1, le=_MAX_U31)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=_MAX_U31)]
TokenId = Annotated[int, Meta(ge=0, le=_MAX_U31)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
StopString = Annotated[str, Meta(min_length=1)]
# OpenAI allows 4 stop strings; we allow a few more, but not an unbounded scan per token.
MAX_STOP_STRINGS = 16
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]

Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
LogitBias = Annotated[float, Meta(ge=-100.0, le=100.0)]
# OpenAI's limit on logit_bias entries (the engine's too).
MAX_LOGIT_BIAS = 300

# Completions default to 16 tokens, as OpenAI's legacy endpoint does.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    # -1 and 0 mean "off", as in vLLM.
    top_k: Annotated[int, Meta(ge=-1, le=_MAX_U31)] | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    user: str | None = None
    # OpenAI: subtracted from the logits of tokens in the output so far (once, and per occurrence).
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # OpenAI: token id (a string key in JSON) -> bias added to its logit.
    logit_bias: Annotated[dict[str, LogitBias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM's extensions: HF repetition penalty over prompt and output (1 = off); min-p filtering (0 = off).
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    # vLLM's extension: logprobs name tokens as "token_id:<id>" (exact, and needs no tokenizer).
    return_tokens_as_token_ids: bool = False

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_common(self) -> None:
        if self.n != 1:
            raise InvalidRequest(f"n={self.n} is not supported: pdserve returns exactly one choice", param="n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options can only be given with stream=true", param="stream_options")
        if not math.isfinite(self.repetition_penalty):
            raise InvalidRequest("repetition_penalty must be a finite number > 0", param="repetition_penalty")
        for key in self.logit_bias or {}:
            if not _TOKEN_ID_KEY.fullmatch(key) or int(key) > _MAX_U31:
                raise InvalidRequest(f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                                     param="logit_bias")

    @property
    def logit_bias_pairs(self) -> list[tuple[int, float]]:
        """``logit_bias`` as (token id, bias) pairs in id order; ``check()`` has validated the keys."""
        return sorted((int(key), bias) for key, bias in (self.logit_bias or {}).items())

    def check_vocab(self, vocab_size: int) -> None:
        """400 naming ``logit_bias`` when one of its ids is outside the vocabulary."""
        bad = [t for t, _ in self.logit_bias_pairs if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                                 param="logit_bias")


class CompletionRequest(_Common, kw_only=True):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[TokenId]
    # Only 0 (the chosen token's logprob) is supported; alternatives are not computed.
    logprobs: NonNegativeInt | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check(self) -> None:
        self._check_common()
        if not self.prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if self.logprobs:
            raise InvalidRequest(
                f"logprobs={self.logprobs} is not supported: only logprobs=0 (the chosen token's logprob)",
                param="logprobs")
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise InvalidRequest(f"best_of={self.best_of} is not supported (only 1)", param="best_of")
        _check_min_tokens(self.min_tokens, self.max_tokens, "max_tokens")


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text; a list of parts is joined (only text parts exist here)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ResponseFormat(msgspec.Struct):
    type: str


class ChatCompletionRequest(_Common, kw_only=True):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    # Only 0 is supported: alternatives are not computed.
    top_logprobs: NonNegativeInt | None = None
    tools: list[msgspec.Raw] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (current OpenAI) wins over ``max_tokens`` (deprecated)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        """The messages as the chat template reads them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def check(self) -> None:
        self._check_common()
        if self.top_logprobs:
            raise InvalidRequest(
                f"top_logprobs={self.top_logprobs} is not supported: only the chosen token's logprob",
                param="top_logprobs")
        if self.tools:
            raise InvalidRequest("tools are not supported", param="tools")
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequest(f"response_format {self.response_format.type!r} is not supported (only 'text')",
                                 param="response_format")
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if part.type != "text":
                    raise InvalidRequest(f"content parts of type {part.type!r} are not supported (only 'text')",
                                         param=f"messages[{i}].content[{j}].type")
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        _check_min_tokens(self.min_tokens, self.requested_max_tokens, name)


def _check_min_tokens(min_tokens: int, max_tokens: int | None, max_name: str) -> None:
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({min_tokens}) must not exceed {max_name} ({max_tokens})",
                             param="min_tokens")


AnyRequest = CompletionRequest | ChatCompletionRequest
RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)

_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (CompletionRequest, ChatCompletionRequest)}


def decode_request(body: bytes, kind: type[RequestT]) -> RequestT:
    """Decode and check a request body; raise InvalidRequest (400) naming the parameter at fault."""
    try:
        request = _DECODERS[kind].decode(body)
    except (msgspec.DecodeError, UnicodeError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deeply
        raise from_decode_error(exc) from None
    request.check()
    return request


def to_sampling_params(request: AnyRequest, max_tokens: int) -> worker_pb2.SamplingParams:
    """The worker's SamplingParams; ``max_tokens`` is the router's final figure (context-checked)."""
    params = worker_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=max(request.top_k or 0, 0),
        stop=list(request.stop_strings),
        stop_token_ids=list(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        logprobs=request.wants_logprobs,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=dict(request.logit_bias_pairs),
        min_p=request.min_p,
    )
    if request.seed is not None:
        params.seed = request.seed
    return params
