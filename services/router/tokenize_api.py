"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes) with the router's own tokenizer.

``/tokenize`` takes a ``prompt`` (text) or chat ``messages`` (rendered with the chat template, as
``/v1/chat/completions`` does) and answers ``{"count", "max_model_len", "tokens"}``;
``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": text}``. Bad input is a 400.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from services.router.errors import InvalidRequest, decode_json
from services.router.protocol import ChatMessage, TokenId
from services.text.tokenizer import Tokenizer


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    # Only with ``messages``: end the rendered chat with the assistant's turn (as chat completions do).
    add_generation_prompt: bool = True
    # BOS where the model wants one; default: yes for a prompt, no for messages (the template writes its own).
    add_special_tokens: bool | None = None


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (TokenizeRequest, DetokenizeRequest)}


def decode_body(body: bytes, kind: type[TokenizeRequest] | type[DetokenizeRequest]):
    """The request, or a 400 naming the field at fault (bad JSON, bad UTF-8 and deep nesting included)."""
    return decode_json(_DECODERS[kind], body)


def tokenize(request: TokenizeRequest, tokenizer: Tokenizer | None, max_model_len: int | None) -> TokenizeResponse:
    if (request.prompt is None) == (request.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
    tokenizer = _require(tokenizer)
    if request.prompt is not None:
        add_special = True if request.add_special_tokens is None else request.add_special_tokens
        tokens = tokenizer.encode(request.prompt, add_special_tokens=add_special)
    else:
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        tokens = tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))
    return TokenizeResponse(len(tokens), max_model_len, tokens)


def detokenize(request: DetokenizeRequest, tokenizer: Tokenizer | None) -> DetokenizeResponse:
    tokenizer = _require(tokenizer)
    for i, token_id in enumerate(request.tokens):
        if token_id >= tokenizer.vocab_size or tokenizer.id_to_token(token_id) is None:
            raise InvalidRequest(f"token id {token_id} is not in the vocabulary [0, {tokenizer.vocab_size})",
                                 param=f"tokens[{i}]")
    return DetokenizeResponse(tokenizer.decode(request.tokens, skip_special_tokens=False))


def _require(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer")
    return tokenizer
