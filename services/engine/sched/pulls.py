"""Requests whose prompt KV another worker computed and this one pulls (decode worker of a pair).

A pull reserves blocks for the prompt (WAITING_FOR_KV), the caller READs into them, and the request
then runs from its first token (``complete``) or is prefilled here after all (``fail``). A READ that
could not be cancelled keeps its blocks out of the pool (``quarantine``) until no late write can land.
The scheduler owns a ``Pulls`` and is its ``RequestBook``: every request, pulled or not, is admitted,
seated, run and retired by the scheduler's rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from services.engine.kv_cache.manager import KVCacheManager
from services.engine.request import Request, RequestStatus
from services.engine.sched.scheduler_output import check_sample

if TYPE_CHECKING:
    from services.engine.offload import HostKVTier


class RequestBook(Protocol):
    """What a pull needs of the scheduler that keeps the requests (``Scheduler``)."""

    def check_new(self, request: Request) -> None:
        """Raise ValueError for a request the scheduler would not take in."""

    def has_free_seat(self) -> bool:
        """Whether one more request fits under ``max_num_seqs``."""

    def register_pulled(self, request: Request, num_device_hit: int) -> None:
        """Make a reserved pull a live request, in arrival order, its prefix lookup counted."""

    def start_running(self, request: Request) -> None:
        """Put the request in the batch (RUNNING)."""

    def requeue(self, request: Request) -> None:
        """Queue the request to be computed here (WAITING), in arrival order."""

    def retire(self, request: Request) -> None:
        """Take the request out of every container; the next ``schedule`` reports it finished."""


class Pulls:
    """The requests WAITING_FOR_KV, by id, and the keys of quarantined pulls' blocks."""

    def __init__(self, book: RequestBook, kv: KVCacheManager, host_tier: HostKVTier | None) -> None:
        self._book = book
        self._kv = kv
        self._host_tier = host_tier
        self._waiting: dict[str, Request] = {}
        self._quarantined: set[str] = set()  # keys of blocks a late READ may still write (quarantine)
        self._num_quarantined = 0

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantined)

    def allocate(self, request: Request) -> list[list[int]] | None:
        """Reserve blocks for a prompt whose KV another worker computed; None if it cannot now.

        Blocks the local prefix cache already holds are reused; the caller fills the rest. Every
        table runs from token 0 (N = the prompt's tokens); in a sliding-window group the blocks
        before the window the transfer moves, ``first_needed_block(N)``, are never allocated: their
        entries are the placeholder (``KVCacheManager.placeholder_block_id``), never to be written::

            full group    [ local hit ...        | to fill ...                 ]
            sliding group [ P P P ... | hit ...  | to fill ...                 ]
                          0           first_needed_block(N)   (hit entries before it are P too)
                          fill from max(num_cached_tokens, window start) // block_size

        None (nothing changed) when the pool is short or every sequence seat is taken.
        """
        self._book.check_new(request)
        if not self._book.has_free_seat():
            return None
        computed, num_hit = self._kv.get_computed_blocks(request)
        if self._kv.allocate_slots(request, request.num_prompt_tokens - num_hit, computed, external_kv=True) is None:
            return None
        self._book.register_pulled(request, num_hit)
        self._waiting[request.request_id] = request
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_computed_tokens = request.num_cached_tokens = num_hit
        return [list(table) for table in request.block_ids]

    def prepare(self, request_id: str, num_pulled_tokens: int = 0) -> None:
        """Ahead of a reserved pull's completion: hash its prompt's blocks (``KVCacheManager.hash_full_blocks``)
        and publish the full blocks of the first ``num_pulled_tokens`` (pulled and checked: the parts so far),
        so later requests can hit them at once; a request no longer waiting for its KV is skipped."""
        request = self._waiting.get(request_id)
        if request is not None:
            self._kv.hash_full_blocks(request, request.num_prompt_tokens)
            if num_pulled_tokens:
                self._kv.cache_full_blocks(request, min(num_pulled_tokens, request.num_prompt_tokens))

    def complete(self, request_id: str, first_token_id: int, first_logprob: float | None = None) -> Request:
        """The pulled blocks are filled: the request runs, starting from its first token."""
        request = self._waiting_request(request_id)
        check_sample(request_id, (first_token_id, first_logprob))
        del self._waiting[request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        request.output_token_ids.append(first_token_id)
        if first_logprob is not None:
            request.output_logprobs.append(first_logprob)
        self._kv.cache_full_blocks(request, request.num_computed_tokens)
        if self._host_tier is not None:
            self._host_tier.note_computed(request)
            self._host_tier.flush()
        self._book.start_running(request)
        return request

    def fail(self, request_id: str) -> None:
        """The pull failed: free the blocks and queue the request to be prefilled here."""
        request = self._waiting_request(request_id)
        del self._waiting[request_id]
        self._kv.free(request)
        request.num_computed_tokens = request.num_cached_tokens = 0
        self._book.requeue(request)

    def quarantine(self, request_id: str) -> str:
        """A pull whose READ could not be cancelled: retire the request but keep its blocks out of the
        pool (a late READ may still write them) under the returned key, until ``release_quarantined``.
        The request id is free again at once (the prompt is prefilled under it)."""
        request = self._waiting_request(request_id)
        self._num_quarantined += 1
        key = f"{request_id}#quarantined-{self._num_quarantined}"
        self._book.retire(request)
        self._kv.hold(request, key=key)
        request.block_ids, request.state_slot = [], None
        request.status = RequestStatus.FINISHED_ABORTED
        self._quarantined.add(key)
        return key

    def release_quarantined(self, key: str) -> bool:
        """Return a quarantined pull's blocks to the pool; False if none are kept under ``key``."""
        if key not in self._quarantined:
            return False
        self._quarantined.discard(key)
        return self._kv.release(key)

    def drop(self, request_id: str) -> None:
        """Forget a pull whose request the scheduler retires (aborted, or quarantined)."""
        del self._waiting[request_id]

    def _waiting_request(self, request_id: str) -> Request:
        request = self._waiting.get(request_id)
        if request is None:
            raise ValueError(f"request {request_id!r} is not waiting for KV")
        return request
