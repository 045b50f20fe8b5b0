"""Preparing prompts: a long body is tokenized and keyed on a worker thread, with the same result as in place."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from services.contract.prefix_keys import hash_request_blocks
from services.router.chat_output import resolve_formats
from services.router.errors import InvalidRequest
from services.router.prompt_prep import OFF_LOOP_BYTES, PromptSetting, prepare, prepare_off_loop
from services.router.protocol import ChatCompletionRequest, CompletionRequest, decode_request
from tests.unit._smollm2 import smollm2_tokenizer

SPECS = frozenset({(16, b"salt-a"), (64, b"salt-b")})


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def _setting(tokenizer, key_specs=SPECS, max_model_len=None) -> PromptSetting:
    return PromptSetting(tokenizer, resolve_formats(tokenizer), tokenizer.vocab_size, max_model_len, key_specs)


def _body(kind, size: int) -> bytes:
    words = " ".join(f"word{i % 97} text" for i in range(size // 10))
    if kind is CompletionRequest:
        return json.dumps({"prompt": words, "max_tokens": 4}).encode()
    return json.dumps({"messages": [{"role": "user", "content": words}], "max_tokens": 4}).encode()


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
def test_a_long_body_is_prepared_on_a_worker_thread(tokenizer, kind, monkeypatch):
    raw = _body(kind, 3 * OFF_LOOP_BYTES)
    threads: list[int] = []
    encode = tokenizer.encode

    def recording(*args, **kwargs):
        threads.append(threading.get_ident())
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)
    setting = _setting(tokenizer)
    off = asyncio.run(prepare_off_loop(decode_request(raw, kind), setting, len(raw)))
    loop_thread = threading.get_ident()
    assert threads and all(t != loop_thread for t in threads)
    here = prepare(decode_request(raw, kind), _setting(tokenizer, key_specs=frozenset()))
    assert off.token_ids == here.token_ids and len(off.token_ids[0]) > 5000
    assert off.max_tokens == here.max_tokens == [4]
    for block_size, salt in SPECS:  # warmed on the thread, equal to the keys made when routed
        assert off.keys[0]._keys[(block_size, salt)] == hash_request_blocks(off.token_ids[0], block_size, salt)
        assert here.keys[0].keys(block_size, salt) == off.keys[0]._keys[(block_size, salt)]


def test_a_short_body_is_prepared_in_place(tokenizer, monkeypatch):
    raw = _body(CompletionRequest, 200)
    threads: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: threads.append(threading.get_ident()) or encode(*a, **k))

    async def run():
        return await prepare_off_loop(decode_request(raw, CompletionRequest), _setting(tokenizer), len(raw)), \
            threading.get_ident()

    prepared, loop_thread = asyncio.run(run())
    assert threads == [loop_thread] and prepared.token_ids[0]


def test_errors_come_back_from_the_thread(tokenizer):
    raw = _body(CompletionRequest, 3 * OFF_LOOP_BYTES)
    with pytest.raises(InvalidRequest, match="context|max_tokens|tokens"):
        asyncio.run(prepare_off_loop(decode_request(raw, CompletionRequest), _setting(tokenizer, max_model_len=64),
                                     len(raw)))
