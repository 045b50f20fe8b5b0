"""A request's prompts made ready for the workers: the chat template, the tokens, the vocabulary and context
checks, and for a long body its prefix keys, on a worker thread so the event loop goes on serving.

Tokenizing a 200 KB prompt took 160 ms on the loop, and 32 such requests at once held every other request (their
body reads, their first bytes) behind them for seconds. ``tokenizers``' batch encode releases the GIL and spreads
a long text over its cores (``services/text/long_text.py``), so off the loop the time is spent in parallel. A short
body is prepared in place: a thread hop costs more than its tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.router.chat_output import ChatFormats
from services.router.chat_plan import ChatPlan, chat_plan
from services.router.prefix_index import PromptKeys
from services.router.protocol import AnyRequest, ChatCompletionRequest
from services.router.tokenizing import check_text_features, prompt_token_ids, resolve_max_tokens
from services.text.tokenizer import Tokenizer

OFF_LOOP_BYTES = 16384  # bodies from this size are prepared on a worker thread


@dataclass(frozen=True)
class PromptSetting:
    """What preparing a prompt reads from the router: read on the event loop, so the thread touches no shared
    state (``key_specs``: the (block size, salt) pairs of the workers now available, ``pairing.py``)."""

    tokenizer: Tokenizer | None
    chat_formats: ChatFormats
    vocab_size: int | None
    max_model_len: int | None
    key_specs: frozenset[tuple[int, bytes]] = frozenset()


@dataclass(frozen=True)
class PreparedPrompts:
    plan: ChatPlan | None  # a chat request's (one prompt)
    token_ids: list[list[int]]
    max_tokens: list[int]  # per prompt
    keys: list[PromptKeys]  # per prompt, shared by its choices


def prepare(body: AnyRequest, setting: PromptSetting) -> PreparedPrompts:
    """Render, tokenize and check ``body``'s prompts (a 400 naming what is wrong), keyed for ``key_specs``."""
    check_text_features(body, setting.tokenizer)
    plan = chat_plan(body, setting.tokenizer, setting.chat_formats) if isinstance(body, ChatCompletionRequest) \
        else None
    prompts = [plan.prompt_token_ids] if plan is not None else \
        prompt_token_ids(body, setting.tokenizer, setting.vocab_size)
    if setting.vocab_size is not None:  # else the workers check it (a 400 from INVALID_ARGUMENT)
        body.check_vocab(setting.vocab_size)
    max_tokens = [resolve_max_tokens(body, len(ids), setting.max_model_len) for ids in prompts]
    keys = [PromptKeys(ids).warm(setting.key_specs) for ids in prompts]
    return PreparedPrompts(plan, prompts, max_tokens, keys)


async def prepare_off_loop(body: AnyRequest, setting: PromptSetting, body_bytes: int) -> PreparedPrompts:
    """:func:`prepare`, on a worker thread when the body is ``OFF_LOOP_BYTES`` or longer (keys warmed there)."""
    if body_bytes < OFF_LOOP_BYTES:
        return prepare(body, setting)
    return await asyncio.to_thread(prepare, body, setting)
