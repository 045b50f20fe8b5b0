"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``, decoded and checked at the door.

Types and ranges are declared on the Structs, so msgspec rejects a wrong type or an out-of-range
number with the JSON path of the field; what needs more than one field, or is an OpenAI feature
pdserve does not have, is checked in ``check()``. Unknown fields are ignored, as OpenAI does; every
field OpenAI documents that pdserve cannot honour (``suffix``, ``audio``, ...) is declared
here only so that setting it is a 400 naming it rather than a silently different answer. Nothing
here talks to a worker.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from services.contract.sampling_params import (
    LOGIT_BIAS_BOUNDS,
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    PENALTY_BOUNDS,
    SamplingParams,
    StructuredSpec,
)
from services.contract.structured import StructuredOutputError, check_spec
from services.contract.wire import sampling_to_proto
from services.proto_gen.pdserve.v1 import worker_pb2
from services.router.chat_tools import (
    ToolCallIn,
    ToolChoice,
    Tools,
    check_tools,
    offered_tools,
    template_tool_calls,
    tool_mode,
)
from services.router.errors import InvalidRequest, decode_json

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

Penalty = Annotated[float, Meta(ge=PENALTY_BOUNDS[0], le=PENALTY_BOUNDS[1])]
LogitBias = Annotated[float, Meta(ge=LOGIT_BIAS_BOUNDS[0], le=LOGIT_BIAS_BOUNDS[1])]
# The limits on logit_bias entries and alternatives per token are the contract's (OpenAI's).
TopLogprobCount = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
# Choices per request (n, times the prompts of a batched completion): each is a sequence on the workers.
MAX_CHOICES = 64
ChoiceCount = Annotated[int, Meta(ge=1, le=MAX_CHOICES)]

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
    n: ChoiceCount = 1
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
    # OpenAI (chat), and vLLM's extension on completions: constrained decoding to JSON.
    response_format: ResponseFormat | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_top_logprobs(self) -> int:
        """Alternatives per output token (0: only the chosen token's logprob, if any)."""
        raise NotImplementedError

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice ``index``: ``seed + index`` (wrapped to int64), so seeded choices differ."""
        if self.seed is None:
            return None
        return (self.seed + index + 2**63) % 2**64 - 2**63

    def _check_common(self) -> None:
        self._check_response_format()
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

    def _check_response_format(self) -> None:
        if self.response_format is not None:
            self.response_format.check()

    def check_vocab(self, vocab_size: int) -> None:
        """400 naming ``logit_bias`` when one of its ids is outside the vocabulary."""
        bad = [t for t, _ in self.logit_bias_pairs if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                                 param="logit_bias")


class CompletionRequest(_Common, kw_only=True):
    """``POST /v1/completions``: one prompt (text or token ids) or a batch of them."""

    # A text, a list of token ids, or a batch: a list of texts or a list of token-id lists.
    prompt: str | list[str | TokenId | list[TokenId]]
    # Alternatives per token, as OpenAI's legacy endpoint has it (the chosen token's logprob is always there).
    logprobs: TopLogprobCount | None = None
    echo: bool = False
    suffix: str | None = None
    # Candidates per prompt, of which the n with the highest mean token logprob are returned (not streamed).
    best_of: ChoiceCount | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_candidates(self) -> int:
        """Sequences generated per prompt: ``best_of`` when given, else ``n``."""
        return self.best_of or self.n

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, each a text or a list of token ids (``check()`` has validated them)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)

    def check(self) -> None:
        self._check_common()
        self._check_prompt()
        num = self.num_candidates * len(self.prompts)
        if num > MAX_CHOICES:
            name = "best_of" if self.best_of else "n"
            raise InvalidRequest(f"{name}={self.num_candidates} over {len(self.prompts)} prompts makes {num} "
                                 f"sequences; at most {MAX_CHOICES} are allowed per request", param=name)
        if self.suffix:
            raise InvalidRequest("suffix is not supported (no model served here does fill-in-the-middle)",
                                 param="suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequest(f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.num_candidates > self.n and self.stream:
            raise InvalidRequest("best_of greater than n cannot be streamed (the best are known only at the end)",
                                 param="best_of")
        _check_min_tokens(self.min_tokens, self.max_tokens, "max_tokens")

    def _check_prompt(self) -> None:
        prompt = self.prompt
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if isinstance(prompt, str):
            return
        kinds = {type(p) for p in prompt}
        if len(kinds) != 1:
            raise InvalidRequest("prompt must be a text, a list of token ids, a list of texts or a list of "
                                 "token-id lists, not a mix", param="prompt")
        for i, p in enumerate(prompt):
            if isinstance(p, (str, list)) and not p:
                raise InvalidRequest(f"prompt[{i}] must not be empty", param="prompt")


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to that call
    reasoning_content: str | None = None  # an assistant turn's reasoning, for templates that show it

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it (only the fields it has)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(self.tool_calls, index)
            if self.content is None:
                message["content"] = None
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return message

    def text(self) -> str:
        """The message's text; a list of parts is joined (only text parts exist here)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class JsonSchemaFormat(msgspec.Struct):
    """OpenAI's ``response_format.json_schema``: the schema and its name (``strict`` is always honoured)."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    """``text`` (free), ``json_object`` (any JSON object) or ``json_schema`` (instances of a schema)."""

    type: str
    json_schema: JsonSchemaFormat | None = None

    def check(self) -> None:
        if self.type not in ("text", "json_object", "json_schema"):
            raise InvalidRequest(f"response_format type {self.type!r} is not supported "
                                 "(one of 'text', 'json_object', 'json_schema')", param="response_format")
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise InvalidRequest("response_format json_schema is needed with, and only with, type 'json_schema'",
                                 param="response_format")
        spec = self.spec()
        if spec is not None:
            try:
                check_spec(spec)
            except StructuredOutputError as exc:
                raise InvalidRequest(str(exc), param="response_format") from None

    def spec(self) -> StructuredSpec | None:
        if self.type == "json_object":
            return StructuredSpec("json_object")
        if self.type == "json_schema":
            schema = self.json_schema.schema if self.json_schema and self.json_schema.schema is not None else {}
            return StructuredSpec("json_schema", msgspec.json.encode(schema).decode())
        return None


# Chat fields OpenAI documents that pdserve has no use for at all; each may be sent with its "off" value.
_INERT_IF_OFF = ("audio", "prediction", "web_search_options", "functions", "verbosity")
# OpenAI's reasoning_effort values; passed to chat templates that read it (gpt-oss's), ignored by the rest.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


class ChatCompletionRequest(_Common, kw_only=True):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobCount | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    # Documented by OpenAI, accepted without effect: pdserve stores nothing and has one service tier.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None
    # Documented by OpenAI, not available here: a 400 naming the field when it is set.
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    verbosity: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0

    @property
    def num_candidates(self) -> int:
        return self.n

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (current OpenAI) wins over ``max_tokens`` (deprecated)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        """The messages as the chat template reads them."""
        return [m.template_dict(i) for i, m in enumerate(self.messages)]

    @property
    def tool_mode(self) -> str:
        """``none``, ``auto``, ``required`` or ``named`` (``chat_tools.tool_mode``)."""
        return tool_mode(self.tools, self.tool_choice)

    def template_vars(self) -> dict[str, Any]:
        """What the chat template gets beside the messages: the tools (unless turned off), the effort."""
        out: dict[str, Any] = {}
        if self.tool_mode != "none":
            out["tools"] = offered_tools(self.tools, None)
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        return out

    def check(self) -> None:
        self._check_common()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
        self._check_unsupported()
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if part.type != "text":
                    raise InvalidRequest(f"content parts of type {part.type!r} are not supported (only 'text')",
                                         param=f"messages[{i}].content[{j}].type")
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        _check_min_tokens(self.min_tokens, self.requested_max_tokens, name)


    def _check_unsupported(self) -> None:
        """A 400 naming the first documented OpenAI feature that is asked for and not available here."""
        for name in _INERT_IF_OFF:
            if getattr(self, name) not in (None, []):
                raise InvalidRequest(f"{name} is not supported", param=name)
        check_tools(self.tools, self.tool_choice)
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise InvalidRequest(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {self.reasoning_effort!r}",
                                 param="reasoning_effort")
        if self.tool_mode in ("required", "named") and self.response_format is not None \
                and self.response_format.type != "text":
            raise InvalidRequest("response_format cannot be combined with a required or named tool_choice (the "
                                 "answer is a tool call)", param="response_format")
        if self.function_call is not None and self.function_call not in ("none", "auto"):
            raise InvalidRequest("function_call is not supported (no function calling)", param="function_call")
        if self.store:
            raise InvalidRequest("store=true is not supported: pdserve keeps no completions", param="store")
        if self.service_tier not in (None, "auto", "default"):
            raise InvalidRequest(f"service_tier {self.service_tier!r} is not supported (only 'auto' or 'default')",
                                 param="service_tier")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise InvalidRequest("modalities other than 'text' are not supported", param="modalities")


def _check_min_tokens(min_tokens: int, max_tokens: int | None, max_name: str) -> None:
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({min_tokens}) must not exceed {max_name} ({max_tokens})",
                             param="min_tokens")


AnyRequest = CompletionRequest | ChatCompletionRequest
RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)

_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (CompletionRequest, ChatCompletionRequest)}


def decode_request(body: bytes, kind: type[RequestT]) -> RequestT:
    """Decode and check a request body; raise InvalidRequest (400) naming the parameter at fault."""
    request = decode_json(_DECODERS[kind], body)
    request.check()
    return request


def to_sampling_params(request: AnyRequest, max_tokens: int, choice: int = 0,
                       grammar: StructuredSpec | None = None) -> worker_pb2.SamplingParams:
    """The worker's SamplingParams for choice ``choice``; ``max_tokens`` is the router's final figure
    (context-checked). A completion's ``echo`` with logprobs asks for the prompt's logprobs too. ``grammar``:
    the router's own constraint (tool calls), in place of ``response_format``'s.

    Built as the contract's ``SamplingParams`` (the one set of rules the workers apply too) and
    converted by the one proto conversion; a combination it refuses is a 400 here.
    """
    echo_logprobs = isinstance(request, CompletionRequest) and request.echo and request.wants_logprobs
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k if request.top_k is not None and request.top_k > 0 else None,
            seed=request.choice_seed(choice),
            stop=request.stop_strings,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            # best_of ranks candidates by their tokens' logprobs.
            logprobs=request.wants_logprobs or request.num_candidates > request.n,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=tuple(request.logit_bias_pairs),
            min_p=request.min_p,
            top_logprobs=request.num_top_logprobs if request.wants_logprobs else 0,
            prompt_logprobs=request.num_top_logprobs if echo_logprobs else None,
            structured=grammar or (request.response_format.spec() if request.response_format is not None else None),
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return sampling_to_proto(params)
