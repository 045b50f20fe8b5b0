"""Block hashes: the names the prefix caches (device blocks, host-tier spans) store KV under.

A full block's hash is chained on the previous block's, so it names the whole prefix up to the
block's end. Each request's chain is computed once per block size and kept (``BlockHashChains``):
the device prefix cache's lookups and publishing and the host tier's stores and lookups all read
it, and only the blocks nobody has asked for yet are hashed.
"""

from __future__ import annotations

import weakref

from services.contract.prefix_keys import hash_block_tokens
from services.engine.request import Request


class BlockHashChains:
    """Every request's chained block hashes, per block size, each full block hashed once.

    One instance serves all prefix caches of an engine that share a salt: the device manager
    creates it and the host tier's span manager (spans are blocks of ``factor * block_size``
    tokens) reads the same one, so a request is hashed once however many caches look it up::

        request tokens 0..39, device block size 8, span 16
        chains[request] = {8: [h0 .. h4], 16: [s0, s1]}    extended as lookups and publishes ask

    Keyed by the request object, weakly: a chain lives exactly as long as its request, and two
    requests with one id (a retry) never share one. A cached hash stays valid for the request's
    life because the tokens of a full block never change once it has been hashed: the only token
    ever rewritten is the scheduler's trailing placeholder (-1), which cannot be hashed.
    """

    def __init__(self, cache_salt: bytes = b"") -> None:
        self.cache_salt = cache_salt
        self._chains: weakref.WeakKeyDictionary[Request, dict[int, list[bytes]]] = weakref.WeakKeyDictionary()

    def set_salt(self, cache_salt: bytes) -> None:
        """Hash with another salt from now on; every chain computed so far is dropped."""
        self.cache_salt = cache_salt
        self._chains = weakref.WeakKeyDictionary()

    def of(self, request: Request) -> RequestBlockHashes:
        """The request's chains, for one lookup or publish (reads its tokens once, when it must hash)."""
        chains = self._chains.get(request)
        if chains is None:
            chains = self._chains[request] = {}
        return RequestBlockHashes(request, chains, self.cache_salt + request.kv_salt)


class RequestBlockHashes:
    """One request's chains as a caller reads them: ``at(block_size, i)`` hashes only what is missing.

    A short-lived view (one call): it takes the request's tokens when it first needs them.
    """

    def __init__(self, request: Request, chains: dict[int, list[bytes]], cache_salt: bytes) -> None:
        self._request = request
        self._chains = chains
        self._salt = cache_salt
        self._tokens: list[int] | None = None

    def at(self, block_size: int, index: int) -> bytes:
        """Hash of block ``index`` of the request cut in ``block_size`` blocks (the block must be full)."""
        chain = self._chains.setdefault(block_size, [])
        if index < len(chain):
            return chain[index]
        if self._tokens is None:
            self._tokens = self._request.all_token_ids
        tokens = self._tokens
        if (index + 1) * block_size > len(tokens):
            raise ValueError(f"block {index} of request {self._request.request_id} (block size {block_size}) "
                             f"is not full: {len(tokens)} tokens")
        while len(chain) <= index:
            i = len(chain)
            chain.append(hash_block_tokens(chain[-1] if chain else None, tokens[i * block_size:(i + 1) * block_size],
                                           self._salt))
        return chain[index]
