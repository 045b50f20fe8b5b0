"""A TCP proxy tests put between a router (or a decode worker) and a worker, to cut or blackhole that one link.

``cut`` resets every connection through it (the peers see a reset, as when a link or a middlebox drops them);
new connections are accepted and forwarded as before. ``blackhole`` stops forwarding in both directions
without closing anything: bytes wait, as on a link that drops every packet while TCP keeps retransmitting, so
the caller's streams hang until something on its side gives up; ``restore`` lets them through again.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class TCPProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<target_port>, a thread per direction per connection."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        self.num_cut = 0
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> int:
        """Reset every connection now (RST, not FIN); how many there were."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
        self.num_cut += len(sockets) // 2
        return len(sockets) // 2

    def blackhole(self) -> None:
        self._open.clear()

    def restore(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()  # the worker is down: the caller sees a refused connection, as without the proxy
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self._open.wait()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
