"""Prefix keys (services/contract/prefix_keys.py): the pinned, chained, salted encoding the engine's
caches and the router share (no torch)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.contract.prefix_keys import cache_salt_for, hash_block_tokens, hash_request_blocks


def test_block_hash_is_chained_salted_and_sized():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h0) == 16 and h0 == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], b"salt") != h0
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h0
    assert hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h0, hash_block_tokens(h0, [5, 6, 7, 8])]
    assert hash_request_blocks([1, 2, 3], 4) == []


def test_block_hash_encoding_is_pinned():
    # Other processes (the router) recompute these; changing the encoding is a protocol change.
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0.hex() == "449bd3b074261d5bef39136d641c8f17"
    assert hash_block_tokens(h0, [5, 6, 7, 8], b"salt").hex() == "f4a95e14fbbcfb2499f1a8d5557191b2"


def test_block_hash_rejects_bad_input():
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(None, [-1])
    with pytest.raises(ValueError, match="parent"):
        hash_block_tokens(b"short", [1])
    with pytest.raises(ValueError, match="block_size"):
        hash_request_blocks([1], 0)


def test_block_hash_is_stable_across_processes():
    code = ("from services.contract.prefix_keys import hash_request_blocks;"
            "print(hash_request_blocks(list(range(64)), 16, b'x')[-1].hex())")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=os.getcwd())
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == hash_request_blocks(list(range(64)), 16, b"x")[-1].hex()


def test_cache_salt_is_the_compat_hash_and_changes_every_key():
    assert cache_salt_for("ab12") == b"ab12"
    assert hash_request_blocks(list(range(8)), 4, cache_salt_for("ab12")) != hash_request_blocks(list(range(8)), 4)
