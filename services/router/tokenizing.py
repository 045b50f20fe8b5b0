"""The router's tokenizer and model name, read from the same ``--model`` argument the workers get.

``services.text.model_ref`` reads the argument exactly as the workers' loader does, without
importing torch or model code the router never uses.
"""

from __future__ import annotations

from services.router.errors import ContextLengthExceeded, InvalidRequest
from services.router.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    AnyRequest,
    ChatCompletionRequest,
    CompletionRequest,
)
from services.text.model_ref import load_tokenizer as load_model_tokenizer
from services.text.model_ref import model_display_name, parse_model
from services.text.tokenizer import Tokenizer

# Chat without max_tokens and no known context length: ask for "everything", the worker stops at its limit.
UNTIL_CONTEXT_ENDS = 2**31 - 1


def model_name(model: str | None, served_model_name: str | None = None) -> str:
    """The id ``/v1/models`` lists: ``--served-model-name``, else the name the workers' loader gives."""
    return served_model_name or model_display_name(model)


def load_tokenizer(model: str | None) -> Tokenizer | None:
    """The tokenizer of a model argument, or None when the model has none (an HF dir without one).

    Raise FileNotFoundError / ValueError naming the problem when the argument is unusable.
    """
    return load_model_tokenizer(parse_model(model))


def prompt_token_ids(request: AnyRequest, tokenizer: Tokenizer | None, vocab_size: int | None = None
                     ) -> list[list[int]]:
    """Tokenize once, per prompt: texts, token ids (checked against ``vocab_size`` when known), or chat
    messages (one prompt)."""
    if isinstance(request, CompletionRequest):
        return [_completion_prompt(prompt, tokenizer, vocab_size) for prompt in request.prompts]
    tokenizer = _require(tokenizer, "messages")
    try:
        text = tokenizer.apply_chat_template(request.template_messages(),
                                             add_generation_prompt=request.add_generation_prompt)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="messages") from None
    # The template writes its own BOS where it wants one.
    return [tokenizer.encode(text, add_special_tokens=False)]


def _completion_prompt(prompt: str | list[int], tokenizer: Tokenizer | None, vocab_size: int | None) -> list[int]:
    if isinstance(prompt, str):
        return _require(tokenizer, "prompt").encode(prompt)
    if vocab_size is not None and max(prompt) >= vocab_size:
        raise InvalidRequest(f"prompt token id {max(prompt)} is outside the vocabulary [0, {vocab_size})",
                             param="prompt")
    return list(prompt)


def echo_texts(request: CompletionRequest, token_ids: list[list[int]], tokenizer: Tokenizer | None) -> list[str]:
    """Each prompt as ``echo`` writes it back: the text as sent, or the token ids decoded."""
    return [p if isinstance(p, str) else _require(tokenizer, "echo").decode(ids, skip_special_tokens=False)
            for p, ids in zip(request.prompts, token_ids, strict=True)]


def check_text_features(request: AnyRequest, tokenizer: Tokenizer | None) -> None:
    """Stop strings and echo need text; without a tokenizer the router has none."""
    if tokenizer is None and request.stop_strings:
        raise InvalidRequest("stop strings need a tokenizer, and this model has none", param="stop")
    if tokenizer is None and isinstance(request, CompletionRequest) and request.echo:
        raise InvalidRequest("echo needs a tokenizer, and this model has none", param="echo")


def _require(tokenizer: Tokenizer | None, param: str) -> Tokenizer:
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer: send the prompt as a list of token ids", param=param)
    return tokenizer


def resolve_max_tokens(request: AnyRequest, num_prompt_tokens: int, max_model_len: int | None) -> int:
    """The number of tokens to ask the workers for, or a 400 in OpenAI's context-length wording.

    Chat defaults to the rest of the context, completions to 16 (capped to the context). Without a
    known ``max_model_len`` nothing can be checked here; the workers stop at their own limit.
    """
    chat = isinstance(request, ChatCompletionRequest)
    param = "messages" if chat else "prompt"
    requested = request.requested_max_tokens
    if max_model_len is None:
        if requested is not None:
            return requested
        return UNTIL_CONTEXT_ENDS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your {param} resulted "
            f"in {num_prompt_tokens} tokens. Please reduce the length of the {param}.", param=param)
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    if requested > room:
        new_name = chat and request.max_completion_tokens is not None
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {param}, {requested} in the "
            f"completion). Please reduce the length of the {param} or completion.",
            param="max_completion_tokens" if new_name else "max_tokens")
    return requested
