"""A minimal HTTP/1.1 client for timing a server's first streamed event, not the client library's own work.

httpx parses headers, builds response objects and decodes lines in Python: on the 2-core build machine that is
~2 ms a request on top of what the server does, which a "router added latency" measurement would otherwise charge
to the router. This client keeps one keep-alive connection per concurrent request, writes a request prepared
once as bytes, and reads until the first ``data: {`` of the SSE stream (the time taken), then drains the
response to its chunked terminator so the connection is clean for the next request.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

_END_OF_CHUNKS = b"0\r\n\r\n"


class StreamTimer:
    """Connections to one server, each used by one request at a time; ``first_event`` times one request."""

    def __init__(self, url: str, path: str, body: bytes) -> None:
        parts = urlsplit(url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._request = (f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json\r\n"
                         f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def first_event(self) -> float:
        """Seconds from writing the request to reading the stream's first ``data: {`` event."""
        reader, writer = self._idle.pop() if self._idle else await asyncio.open_connection(self._host, self._port)
        start = time.perf_counter()
        writer.write(self._request)
        seen, took = b"", None
        while not seen.endswith(_END_OF_CHUNKS):
            data = await reader.read(1 << 16)
            if not data:
                raise RuntimeError(f"the server closed the connection: {seen[:300]!r}")
            seen += data
            if took is None and b"data: {" in seen:
                took = time.perf_counter() - start
        if not seen.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the server answered {seen[:300]!r}")
        if took is None:
            raise RuntimeError("the server's stream ended without an event")
        self._idle.append((reader, writer))
        return took

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        await asyncio.gather(*(writer.wait_closed() for _, writer in self._idle), return_exceptions=True)
        self._idle.clear()
