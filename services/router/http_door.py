"""The router's HTTP door: how long a client may take to send a request, and how many connections stay open.

uvicorn bounds a keep-alive connection's idleness (``timeout_keep_alive``) but not the time a client takes to
send a request's headers or its body: a connection that sends half its headers, or trickles a body, holds its
socket forever. Its ``limit_concurrency`` counts idle connections too, so idle ones holding every slot get real
requests answered 503. The router therefore serves through :class:`GuardedH11`, uvicorn's own h11 protocol
with three guards that follow h11's state of the client's side:

* ``--header-timeout-s``: from the connection's start (or, on a keep-alive connection, the next request's first
  byte) until the request's headers are complete;
* ``--body-timeout-s``: from the headers until the body's last byte;
* ``--max-connections``: a connection beyond the limit closes the connection that has waited longest without a
  request in flight (idle between requests, or still sending headers), or itself when every other one is busy,
  so idle sockets never starve a real request and never exhaust the process's file descriptors.

A request late with its headers or body is answered 408 (OpenAI's error body, ``Connection: close``) when some
of it arrived and no response started, then closed; a connection that sent nothing is closed silently, as an
idle keep-alive one is. No guard runs while the response is being sent (h11 says the client is done then), so a
stream of many minutes is bounded only by ``--request-timeout-s``.

This is a protocol-level guard, not an ASGI middleware, because the app is only called once the headers are
complete: a stall before that is invisible to it. It relies on uvicorn's ``H11Protocol`` hooks
(``connection_made``, ``data_received``, ``handle_events``, ``connection_lost``) and h11's ``their_state``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.common.config_flags import flag, positive_float, positive_int

log = logging.getLogger(__name__)
_FD_HEADROOM = 256  # descriptors beyond the client connections: worker channels, files, the listening socket


@dataclass(frozen=True)
class DoorLimits:
    """The HTTP door's bounds; none of them applies while a response is being sent."""

    header_timeout_s: float = flag(10.0, "close a connection whose request headers are not complete this many "
                                         "seconds after it opened (or after the request's first byte on a "
                                         "keep-alive connection; default 10)", parse=positive_float)
    body_timeout_s: float = flag(60.0, "answer 408 and close when a request's body is not complete this many "
                                       "seconds after its headers (default 60)", parse=positive_float)
    keep_alive_timeout_s: float = flag(5.0, "close a keep-alive connection idle this long between requests "
                                            "(default 5)", parse=positive_float)
    max_connections: int = flag(2048, "most open client connections; beyond it the longest-idle one (no request "
                                      "in flight) is closed (default 2048)", parse=positive_int)


def _timeout_response(what: str, after_s: float) -> bytes:
    """A raw 408: h11 can send no response before it has read a request's headers."""
    body = json.dumps({"error": {"message": f"the request's {what} did not arrive within {after_s:g} s",
                                 "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the header and body timeouts and the connection limit of :class:`DoorLimits`."""

    def __init__(self, *args: Any, limits: DoorLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._timer: asyncio.TimerHandle | None = None
        self._timing = ""  # "headers" or "body": what the timer waits for
        self._waiting_since: float | None = None  # monotonic, while no request is in flight

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._waiting_since = time.monotonic()
        self._arm("headers", self.limits.header_timeout_s)
        if len(self.connections) > self.limits.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._waiting_since = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._timing and self.conn.their_state is h11.IDLE:
            self._arm("headers", self.limits.header_timeout_s)  # a keep-alive connection's next request begins
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._follow()

    def _follow(self) -> None:
        """Move the timer with the client's side: headers until h11 has the request, the body until its end."""
        state = self.conn.their_state
        if state is h11.IDLE:  # between requests: uvicorn's keep-alive timer, or ours once bytes come
            if self._timing == "body":
                self._disarm()
            if self._waiting_since is None:
                self._waiting_since = time.monotonic()
            return
        self._waiting_since = None
        if state is h11.SEND_BODY:
            if self._timing != "body":
                self._arm("body", self.limits.body_timeout_s)
        elif self._timing:
            self._disarm()

    def _arm(self, what: str, after_s: float) -> None:
        self._disarm()
        self._timing = what
        self._timer = self.loop.call_later(after_s, self._expired, what, after_s)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timing = None, ""

    def _expired(self, what: str, after_s: float) -> None:
        self._timer, self._timing = None, ""
        if self.transport.is_closing():
            return
        if what == "headers":
            answer = bool(self.conn.trailing_data[0])  # part of a request came: say why it is cut
        else:
            answer = self.cycle is not None and not self.cycle.response_started
        log.debug("closing a connection from %s: its request's %s took over %g s", self.client, what, after_s)
        if answer:
            self.transport.write(_timeout_response(what, after_s))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() returns http.disconnect; its sends are dropped
            self.cycle.message_event.set()
        self.transport.close()

    def _make_room(self) -> None:
        """Over the limit: close the connection waiting longest with no request in flight (else this one)."""
        idle = [c for c in self.connections if isinstance(c, GuardedH11) and c is not self
                and c._waiting_since is not None and not c.transport.is_closing()]
        victim = min(idle, key=lambda c: c._waiting_since or 0.0) if idle else self
        log.debug("%d connections (limit %d): closing %s", len(self.connections), self.limits.max_connections,
                  "an idle one" if idle else "the new one")
        victim._disarm()
        victim.transport.close()


def room_for_connections(max_connections: int) -> None:
    """Raise the soft open-files limit to fit ``max_connections`` (as far as the hard limit allows): past it,
    accept() fails and asyncio stops accepting for a second at a time, which is the starvation the limit avoids."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + _FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            log.warning("--max-connections %d needs %d open files; the limit is %d", max_connections, wanted, new)


def uvicorn_config(app: Any, limits: DoorLimits, **options: Any) -> uvicorn.Config:
    """uvicorn's config serving ``app`` through :class:`GuardedH11` (``options``: host, port, log level...)."""
    return uvicorn.Config(app, http=partial(GuardedH11, limits=limits),  # type: ignore[arg-type]
                          timeout_keep_alive=limits.keep_alive_timeout_s, **options)  # type: ignore[arg-type]
