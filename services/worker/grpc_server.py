"""What every worker daemon's gRPC server shares: health service, ready line, SIGTERM drain."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.grpc_auth import TokenAuthInterceptor
from services.common.tls import TLSConfig

log = logging.getLogger(__name__)


class InFlight:
    """Counts in-flight requests so a drain can wait for them; refuses new ones while draining."""

    def __init__(self) -> None:
        self.count = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    @contextlib.asynccontextmanager
    async def admit(self, context: grpc.aio.ServicerContext, who: str) -> AsyncIterator[None]:
        """Count one request for its whole life; UNAVAILABLE while draining."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{who} is draining")
        self.enter()
        try:
            yield
        finally:
            self.leave()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


class WorkerServer:
    """A grpc.aio server with grpc.health.v1 and a drain that SIGTERM triggers."""

    def __init__(self, service_names: list[str], auth_token: str | None = None, tls: TLSConfig | None = None) -> None:
        """``auth_token``: the cluster token every call but health and handshake must carry (grpc_auth.py);
        ``tls``: serve TLS only, to clients with a certificate the cluster CA signed (tls.py)."""
        self.tls = tls
        interceptors = [TokenAuthInterceptor(auth_token)] if auth_token else None
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)],
                                      interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = ["", *service_names]
        self.in_flight = InFlight()
        self.stopped = asyncio.Event()
        self.failure: str | None = None  # why the worker went down on its own (see fail)
        # Called just before the server stops (drain or failure): open streams end themselves (KV events).
        self.before_stop: list[Callable[[], None]] = []

    def bind(self, host: str, port: int) -> int:
        address = f"{host}:{port}"
        if self.tls is not None:
            bound = self.server.add_secure_port(address, self.tls.server_credentials())
        else:
            bound = self.server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        return bound

    async def start(self, ready: dict, drain_timeout_s: float) -> None:
        """Serve and print the ready line; nothing when the worker already failed (see ``fail``)."""
        if self.failure is not None:
            return
        await self.server.start()
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.drain(drain_timeout_s)))
        print(json.dumps({"ready": True, **ready}), flush=True)  # one line tests and `pdserve up` wait for

    async def drain(self, timeout_s: float, on_drained: Callable[[], None] | None = None) -> None:
        """Stop taking work (NOT_SERVING, UNAVAILABLE for new calls), finish in-flight, stop."""
        if self.in_flight.draining:
            return
        self.in_flight.draining = True
        started = time.monotonic()
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        finished = await self.in_flight.wait_idle(timeout_s)
        log.info("drained in %.1fs (%s)", time.monotonic() - started,
                 "all finished" if finished else f"{self.in_flight.count} cut off")
        if on_drained is not None:
            on_drained()
        self._before_stop()
        await self.server.stop(grace=1.0)
        self.stopped.set()

    async def fail(self, reason: str) -> None:
        """The worker cannot serve any more (e.g. a TP rank died): stop now, without a drain.

        Health goes NOT_SERVING at once so routers stop sending; in-flight calls are cut after a
        second (their engine is gone, so waiting longer would only hold clients); the daemon then
        exits non-zero.
        """
        if self.failure is not None:
            return
        self.failure = reason
        self.in_flight.draining = True
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._before_stop()
        await self.server.stop(grace=1.0)
        self.stopped.set()

    def _before_stop(self) -> None:
        for hook in self.before_stop:
            try:
                hook()
            except Exception:  # noqa: BLE001 - one hook's failure must not keep the server up
                log.exception("a stop hook failed")
