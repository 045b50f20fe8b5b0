"""What every worker daemon's gRPC server shares: health service, ready line, the drain that stops it.

A worker is stopped by draining it first: ``drain`` (the ``Drain`` RPC a preStop hook calls, or SIGTERM) sets
health NOT_SERVING, runs the role's own drain (``role_drain``: services/worker/role_switch.py, the same rules as
a role switch's: prefill tickets are pulled, released or expired; decode requests finish, or past the bound are
migrated), then refuses every counted call. There is one drain per worker: a second call, or SIGTERM during it,
waits for the same one. Only SIGTERM (``terminate``) stops the server afterwards, so a worker drained by the RPC
stays up, NOT_SERVING, until its supervisor (the kubelet, ``pdserve up``) stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.grpc_auth import TokenAuthInterceptor
from services.common.tls import TLSConfig
from services.worker.role_switch import StopDrain

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


@dataclass(frozen=True)
class DrainOutcome:
    """How a worker's drain ended: the ``Drain`` RPC's answer."""

    role: str  # the role drained ("" for a server without a role drain)
    seconds: float
    num_migrated: int  # decode requests given back past the bound
    num_left: int  # work still outstanding when the drain gave up: the stop cuts it (0: drained)


class WorkerServer:
    """A grpc.aio server with grpc.health.v1, and the drain that stops it (the ``Drain`` RPC, SIGTERM)."""

    def __init__(self, service_names: list[str], auth_token: str | None = None, tls: TLSConfig | None = None, *,
                 max_receive_bytes: int) -> None:
        """``auth_token``: the cluster token every call but health and handshake must carry (grpc_auth.py);
        ``tls``: serve TLS only, to clients with a certificate the cluster CA signed (tls.py);
        ``max_receive_bytes``: the largest message the worker can legitimately get (receive_limit.py), beyond
        which grpc core answers RESOURCE_EXHAUSTED without handing the message to Python."""
        self.tls = tls
        interceptors = [TokenAuthInterceptor(auth_token)] if auth_token else None
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_receive_bytes)],
                                      interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = ["", *service_names]
        self.in_flight = InFlight()
        self.stopped = asyncio.Event()
        self.failure: str | None = None  # why the worker went down on its own (see fail)
        # Called just before the server stops (drain or failure): open streams end themselves (KV events).
        self.before_stop: list[Callable[[], None]] = []
        # The role's drain, given the bound (daemon.serve sets RoleSwitch.drain_to_stop); without one a drain
        # refuses new calls at once and waits for the counted ones.
        self.role_drain: Callable[[float], Awaitable[StopDrain]] | None = None
        self._drain: asyncio.Future[DrainOutcome] | None = None  # the one drain, once started
        self._stopping = False

    @property
    def draining(self) -> bool:
        """A drain started (the ``Drain`` RPC or SIGTERM); it stays so once drained."""
        return self._drain is not None

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
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.terminate(drain_timeout_s)))
        print(json.dumps({"ready": True, **ready}), flush=True)  # one line tests and `pdserve up` wait for

    async def drain(self, timeout_s: float) -> DrainOutcome:
        """Drain the worker for stopping it, within ``timeout_s`` (its --drain-timeout-s); a drain under way
        (another ``Drain`` call's, SIGTERM's) is waited for, never started twice. The server keeps running."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._run_drain(timeout_s))
        return await asyncio.shield(self._drain)  # a caller that gives up leaves the drain running

    async def terminate(self, timeout_s: float) -> None:
        """SIGTERM/SIGINT: drain (or wait for the drain under way; none when already drained), then stop."""
        try:
            await self.drain(timeout_s)
        finally:
            await self._stop()

    async def _run_drain(self, timeout_s: float) -> DrainOutcome:
        """NOT_SERVING, the role's drain, then refuse every counted call and wait for those still in flight."""
        started = time.monotonic()
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        role, num_migrated, num_left = "", 0, 0
        if self.role_drain is not None:
            result = await self.role_drain(timeout_s)
            role, num_migrated, num_left = result.role, result.num_migrated, result.num_left
        self.in_flight.draining = True  # from now on new Prefill/Generate/Probe calls get UNAVAILABLE
        if num_left == 0:
            await self.in_flight.wait_idle(max(timeout_s - (time.monotonic() - started), 0.0))
        num_left = max(num_left, self.in_flight.count)
        outcome = DrainOutcome(role, time.monotonic() - started, num_migrated, num_left)
        log.info("drained %s in %.1fs: %d migrated, %s", role or "the worker", outcome.seconds, num_migrated,
                 "nothing left" if num_left == 0 else f"{num_left} left to cut at the stop")
        return outcome

    async def _stop(self) -> None:
        """Stop the server once (in-flight calls get a second), then set ``stopped``."""
        if self._stopping:
            await self.stopped.wait()
            return
        self._stopping = True
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
        await self._stop()

    def _before_stop(self) -> None:
        for hook in self.before_stop:
            try:
                hook()
            except Exception:  # noqa: BLE001 - one hook's failure must not keep the server up
                log.exception("a stop hook failed")
