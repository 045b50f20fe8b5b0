"""Prefix keys: the names the workers' prefix caches store KV under, computed the same way everywhere.

A full block's key is chained on the previous block's, so it names the whole prefix up to the
block's end. The engine's prefix caches (device blocks, host-tier spans) store KV under these keys
and report them in KV events; the router computes the same keys over its tokenized prompts to find,
per worker, how much of a prompt is already cached. Torch-free, so both sides share this one code.

The salt is the serving engine's compatibility hash (``cache_salt_for``): two engines only share
keys when their KV is interchangeable, and a router never matches one model's prompt against
another model's cache.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BLOCK_HASH_BYTES = 16
_HASH_PERSON = b"pdserve-kv-v1"


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one full block, chained on the previous block's hash so it names the whole prefix.

    Built from a fixed byte encoding (never Python's per-process ``hash()``) so that another
    process, e.g. a router routing by prefix, computes the same value::

        blake2b(digest_size=16, person=b"pdserve-kv-v1") over
            b"\\x00"                        if parent is None
            b"\\x01" + parent (16 bytes)    otherwise
          + len(extra) as uint32 LE + extra
          + each token id as uint32 LE
    """
    if parent is not None and len(parent) != BLOCK_HASH_BYTES:
        raise ValueError(f"parent hash must be {BLOCK_HASH_BYTES} bytes, got {len(parent)}")
    try:
        tokens = struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    h = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES, person=_HASH_PERSON)
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    h.update(tokens)
    return h.digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``; a trailing partial block has none.

    The same bytes as :func:`hash_block_tokens` block by block, packed once for the whole prompt and hashed
    from a prepared hasher: a router keys every prompt it routes (a 100K-token prompt: 6K blocks).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if not num_blocks:
        return []
    try:
        packed = memoryview(struct.pack(f"<{num_blocks * block_size}I", *token_ids[:num_blocks * block_size]))
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    base = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES, person=_HASH_PERSON)
    header = struct.pack("<I", len(extra)) + extra
    stride = 4 * block_size
    hashes: list[bytes] = []
    parent = b"\x00"
    for start in range(0, len(packed), stride):
        h = base.copy()
        h.update(parent)
        h.update(header)
        h.update(packed[start:start + stride])
        key = h.digest()
        hashes.append(key)
        parent = b"\x01" + key
    return hashes


def cache_salt_for(compat_hash: str) -> bytes:
    """The salt an engine with this compatibility hash (hex, ``kv.compat.compat_hash``) keys its caches with."""
    return compat_hash.encode("ascii")
