"""KV sent per prefill chunk, as the router relays it: part tickets from PrefillStream into GenerateParts.

With ``kv_parts`` on (the default; ``--no-kv-parts`` turns it off) the router prefills with
``PrefillStream``. A prompt the prefill worker computes in one chunk gets only the final answer with a
whole ticket, and goes on as before (``Generate(ticket)``). A longer one gets a part ticket per finished
chunk first: at the first, the router opens ``GenerateParts`` on the decode worker, which reserves the
prompt's blocks and pulls each part as it is relayed, while the prefill worker computes the next chunk.
The final answer's ticket is the last part; the first token goes to the client as it arrives, and only
the last part's pull stands between it and the second token::

    PrefillStream ──► part 1 ──► part 2 ──► ... ──► final (first token, last part) ──► client
                        │          │                    │
                        ▼          ▼                    ▼
    GenerateParts(start) pull 1    pull 2       ...     pull last ──► tokens 2..n ──► client

If the prefill worker fails mid-stream, the relay ends without the last part and the decode worker
prefills the prompt itself (the fallback route); with ``--enforce-disagg`` the request fails (502) and
the decode call is cancelled. Either way the router's clean-up releases what each worker still holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.proto_gen.pdserve.v1 import kv_pb2


class PartRelay:
    """One request's part tickets on their way to its decode worker, in order; ``close`` ends them (after
    the last part, or early when the prefill failed). Putting never waits: a decode call that ended
    early simply stops reading."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[kv_pb2.TransferTicket | None] = asyncio.Queue()
        self.closed = False
        self.num_parts = 0

    def put(self, ticket: kv_pb2.TransferTicket) -> None:
        if self.closed:
            raise RuntimeError("a part ticket after the relay was closed")
        self.num_parts += 1
        self._queue.put_nowait(ticket)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[kv_pb2.TransferTicket]:
        while (ticket := await self._queue.get()) is not None:
            yield ticket
