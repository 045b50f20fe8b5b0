"""A request's KV parts on the decode side (``PullPolicy.start_parts``): which parts came, and their pulls in flight.

Parts are pulled as they arrive, several at once: over a slow link each READ pays its own ramp-up before its
data streams (UCX over TCP with host staging, H100, 32k-token prompts: 256 MiB parts pulled one after another
moved 0.23 GB/s, one 4 GiB pull 0.32 GB/s), and a prefill far ahead of the pulls leaves many parts waiting.
A part is posted while the ones before it still move, up to ``--kv-parts-in-flight``; on a fast link a part is
done before the next arrives, so the pulls stay one at a time. A failed part stops the posting of later ones
(seen when the next part comes or the parts end: a caller learns of the failure only after its input ended
anyway, decode/server.py), and the reservation is dropped only once every READ still in flight has ended (it
may be writing the blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.proto_gen.pdserve.v1 import kv_pb2


class PartPulls:
    """How far a request's part tickets came (``start_parts``): each must start where the one before ended and
    name this request and prompt; the last ends at the prompt's end and carries the first token."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.end = 0  # tokens covered by the parts so far
        self.last: kv_pb2.TransferTicket | None = None
        self.failure: str | None = None
        self.num_pulled = 0

    def accept(self, ticket: kv_pb2.TransferTicket, rid: str) -> str | None:
        """Take the next part; why it does not fit, if it does not (it is not pulled then)."""
        whole = max(ticket.num_prompt_tokens, ticket.num_tokens)
        problem = None
        if ticket.request_id != rid or whole != self.num_prompt_tokens:
            problem = f"a KV part of request {ticket.request_id!r} ({whole} tokens)"
        elif ticket.part_start_token != self.end or not self.end < ticket.num_tokens <= whole:
            problem = f"a KV part of tokens {ticket.part_start_token}..{ticket.num_tokens} after tokens 0..{self.end}"
        self.end = max(self.end, ticket.num_tokens)
        if ticket.num_tokens >= self.num_prompt_tokens:
            self.last = ticket
        return None if problem is None else f"{problem} does not continue the prompt's KV; refused"


@dataclass(frozen=True)
class FailedPart:
    """A part whose pull failed, and why."""

    ticket: kv_pb2.TransferTicket
    error: Exception


class PartsInFlight:
    """One request's part pulls running at once, at most ``limit``. Each pull is a coroutine that returns None,
    or the :class:`FailedPart` it ended with; the first failure is kept in ``failed``."""

    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 1)
        self.failed: list[FailedPart] = []
        self._tasks: set[asyncio.Task[FailedPart | None]] = set()

    async def add(self, pull: Callable[[], Awaitable[FailedPart | None]]) -> bool:
        """Start ``pull()`` once fewer than ``limit`` run (waiting for one to end first); False, and nothing
        started, when a pull has failed meanwhile."""
        self._reap()
        while not self.failed and len(self._tasks) >= self.limit:
            await self._wait(asyncio.FIRST_COMPLETED)
        if self.failed:
            return False
        self._tasks.add(asyncio.ensure_future(pull()))
        return True

    async def settle(self) -> list[FailedPart]:
        """Wait for every pull in flight to end; every failure so far, first first."""
        while self._tasks:
            await self._wait(asyncio.ALL_COMPLETED)
        return self.failed

    async def cancel(self) -> None:
        """Cancel what still runs and wait for it to end (its READ aborted, or landed)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def _reap(self) -> None:
        """Take in the pulls that ended since the last look."""
        self._collect({t for t in self._tasks if t.done()})

    async def _wait(self, when: str) -> None:
        done, _ = await asyncio.wait(self._tasks, return_when=when)
        self._collect(done)

    def _collect(self, done: set[asyncio.Task[FailedPart | None]]) -> None:
        self._tasks -= done
        for task in done:
            failure = task.result()
            if failure is not None:
                self.failed.append(failure)
