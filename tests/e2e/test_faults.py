"""End to end under faults: a decode worker dies mid-stream, a client walks away mid-stream."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.stack import completion_tokens, info, stack

LONG = 400  # tokens: long enough to still be streaming when the fault is injected
# The test checkpoint has no tokenizer: ask for token ids in logprobs so every token is an event.
TOKEN_EVENTS = {"logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True, "temperature": 0,
                "stream": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return str(directory)


def _stream_lines(client: httpx.Client, url: str, body: dict):
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                yield line[6:]


def _wait(predicate, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_decode_worker_killed_mid_stream(model: str) -> None:
    with stack(model, 1, 2) as s, httpx.Client(timeout=120) as client:
        body = {"prompt": list(range(5, 40)), "max_tokens": LONG, **TOKEN_EVENTS}
        events = []
        for data in _stream_lines(client, s.url, body):
            events.append(data)
            if len(events) == 5:  # streaming: kill whichever decode worker is serving it
                busy = [d for d in s.decode if info(d).num_running > 0]
                assert len(busy) == 1
                busy[0].kill()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert "error" in error and error["error"]["message"], f"no error event at the end: {events[-3:]}"
        # New requests go to the surviving decode worker.
        survivor = next(d for d in s.decode if d.proc.poll() is None)
        for _ in range(3):
            assert len(completion_tokens(s.url, list(range(7, 30)), 6, stream=False)) == 6
        assert info(survivor).num_running == 0
        assert _wait(lambda: info(s.prefill[0]).kv_blocks_pinned == 0)


def test_client_disconnect_releases_everything_on_both_workers(model: str) -> None:
    with stack(model) as s, httpx.Client(timeout=120) as client:
        body = {"prompt": list(range(9, 60)), "max_tokens": LONG, **TOKEN_EVENTS}
        for received, _ in enumerate(_stream_lines(client, s.url, body), start=1):
            if received == 4:
                assert info(s.decode[0]).num_running == 1
                break  # leaving the with-block closes the connection mid-stream
        assert _wait(lambda: info(s.decode[0]).num_running == 0 and info(s.decode[0]).num_waiting == 0)
        assert _wait(lambda: info(s.prefill[0]).kv_blocks_pinned == 0)
        decode = info(s.decode[0])
        assert decode.kv_blocks_free == 512  # every block back (cached prefixes count as free)
