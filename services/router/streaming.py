"""Server-sent events, and noticing a client that went away, for both kinds of response.

Starlette cancels a streaming body when the client disconnects only on some ASGI servers (spec
< 2.4); :class:`SSEResponse` always listens, and closes its body iterator in every case, so the
request flow's clean-up (Abort, Release) runs as soon as the client is gone. Non-streaming
requests and the wait for a stream's first token use :func:`run_until_disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class SSEResponse(StreamingResponse):
    """``text/event-stream`` that stops and closes its body as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[T | None, bool]:
    """Await ``work`` unless the client disconnects first: (result, disconnected).

    On a disconnect ``work`` is cancelled and awaited (its clean-up runs); its errors propagate.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        # Wait for the work's own clean-up (it shields what must finish).
        await asyncio.wait({task})
    if task.cancelled():
        return None, True
    return task.result(), False
