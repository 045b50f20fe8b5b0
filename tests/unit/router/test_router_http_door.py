"""The router's HTTP door (http_door.py) over real sockets on 127.0.0.1: slow clients are cut, idle ones
make room, and a response stream longer than every timeout is untouched."""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import uvicorn

from services.common.config_flags import config_from_args
from services.router.cli_args import add_router_parser
from services.router.http_door import DoorLimits, uvicorn_config

SHORT = DoorLimits(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_timeout_s=0.5)
STREAM_GAP_S = 0.7  # every gap between two chunks is longer than each timeout above
STREAM_CHUNKS = 4


async def _app(scope, receive, send) -> None:
    """``/echo``: the body's length; ``/stream``: chunks slower than every timeout; else ``ok``."""
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    if scope["path"] != "/stream":
        body = str(size).encode() if scope["path"] == "/echo" else b"ok"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for i in range(STREAM_CHUNKS):
        await asyncio.sleep(STREAM_GAP_S)
        await send({"type": "http.response.body", "body": b"chunk-%d;" % i, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@contextmanager
def _serving(limits: DoorLimits) -> Iterator[tuple[uvicorn.Server, int]]:
    """The app behind the router's door on a free port of 127.0.0.1, in a thread of its own."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn_config(_app, limits, lifespan="off", log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield server, sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _connect(port: int, timeout_s: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout_s)


def _read_until_closed(conn: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes (a socket timeout fails the test), and how long it took."""
    start, data = time.monotonic(), b""
    while chunk := conn.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def _read_response(conn: socket.socket) -> bytes:
    """One response with a content-length, read off a connection that stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = int(lengths[0])
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def test_half_sent_headers_are_answered_408_after_the_header_timeout() -> None:
    with _serving(SHORT) as (_, port), _connect(port) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        data, took = _read_until_closed(conn)
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b"request_timeout" in data and b"connection: close" in data.lower()
    assert 0.4 < took < 3.0


def test_a_connection_that_sends_nothing_is_closed_silently() -> None:
    with _serving(SHORT) as (_, port), _connect(port) as conn:
        data, took = _read_until_closed(conn)
    assert data == b"" and took < 3.0


def test_a_trickled_body_is_answered_408_after_the_body_timeout() -> None:
    with _serving(SHORT) as (_, port), _connect(port) as conn:
        conn.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n")
        start, data = time.monotonic(), b""
        conn.settimeout(0.2)
        for _ in range(40):  # a byte every 0.2 s: never idle for a whole timeout, never done either
            try:
                conn.sendall(b"x")
                chunk = conn.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # closed under us: what it sent is already in data
                break
            if not chunk:
                break
            data += chunk
        took = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b"body" in data
    assert took < 3.0


def test_a_keep_alive_connection_idle_after_its_response_is_closed() -> None:
    with _serving(SHORT) as (_, port), _connect(port) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_response(conn).endswith(b"\r\n\r\nok")
        data, took = _read_until_closed(conn)
    assert data == b"" and took < 3.0


def test_the_next_request_on_a_keep_alive_connection_gets_the_header_timeout_too() -> None:
    # Its first bytes stop the keep-alive timer: only the header timeout can end this one.
    with _serving(DoorLimits(header_timeout_s=0.5, keep_alive_timeout_s=30)) as (_, port), _connect(port) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_response(conn).endswith(b"\r\n\r\nok")
        conn.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        data, took = _read_until_closed(conn)
    assert data.startswith(b"HTTP/1.1 408 ") and took < 3.0


def test_idle_connections_beyond_the_limit_make_room_for_a_real_request() -> None:
    limits = DoorLimits(header_timeout_s=60, keep_alive_timeout_s=60, max_connections=16)  # no timeout helps
    with _serving(limits) as (server, port), ExitStack() as idle:
        for i in range(40):
            conn = idle.enter_context(_connect(port))
            if i % 2:
                conn.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # mid-headers, forever
        time.sleep(0.3)
        start = time.monotonic()
        with _connect(port, timeout_s=3) as real:
            real.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nhello")
            answer = _read_response(real)
        took = time.monotonic() - start
        time.sleep(0.2)
        open_now = len(server.server_state.connections)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\n5"), answer
    assert took < 2.0
    assert open_now <= limits.max_connections


def test_a_stream_longer_than_every_timeout_completes() -> None:
    with _serving(SHORT) as (_, port), _connect(port, timeout_s=10) as conn:
        conn.sendall(b"POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
        data, took = _read_until_closed(conn)
    assert data.startswith(b"HTTP/1.1 200 ")
    assert all(b"chunk-%d;" % i in data for i in range(STREAM_CHUNKS)), data
    assert data.endswith(b"0\r\n\r\n")  # the chunked body's proper end, not a cut
    assert took > STREAM_CHUNKS * STREAM_GAP_S * 0.9


def test_router_flags_give_the_door_limits() -> None:
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    args = parser.parse_args(["router", "--decode", "127.0.0.1:1", "--header-timeout-s", "3", "--body-timeout-s",
                              "7", "--keep-alive-timeout-s", "9", "--max-connections", "100"])
    assert config_from_args(DoorLimits, args) == DoorLimits(3.0, 7.0, 9.0, 100)
    defaults = config_from_args(DoorLimits, parser.parse_args(["router", "--decode", "127.0.0.1:1"]))
    assert defaults == DoorLimits()
