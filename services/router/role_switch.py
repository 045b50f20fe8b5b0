"""The router's side of an in-place role switch: the hook the P:D planner awaits, and what the admin API calls.

    switch_role(address, new_role)
      ├─ refuse (nothing changes): another switch under way, unknown worker, already that role, not healthy,
      │  started without --role-switching, the last available worker of its role
      ├─ mark it switching: pairing chooses it for no new work of any role (its Info says draining too, so
      │  other routers stop as well once they look)
      ├─ SwitchRole on the worker: it drains (prefill: every ticket pulled, released or expired; decode: its
      │  requests finish, past the bound they are given back and request_run.py continues them elsewhere), then
      │  serves the other role under a new epoch
      └─ discovery lists it under the new role and checks health at once: the new role's entry is healthy,
         its pairs are probed for the new epoch and its KV events resubscribed, as after a restart

One switch at a time (a lock; a second caller is refused rather than queued). A worker that dies mid-switch
is handled like any dead worker: the RPC fails (this raises SwitchFailed) and the health checks take it out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Annotated

import grpc
import msgspec

from services.router.discovery import Discovery
from services.router.errors import RouterError, decode_json
from services.router.pairing import PairingPolicy, Role, WorkerState
from services.router.workers import WorkerPool

log = logging.getLogger(__name__)

#: How long the SwitchRole call may take: a prefill drain waits for its tickets' lease (--kv-lease-s, 30 s by
#: default), a decode drain for its bound plus the migrations.
SWITCH_RPC_TIMEOUT_S = 600.0
#: How long a switch waits for requests paired with the worker to send their Generate (their prefill's time).
UNSENT_WAIT_S = 30.0


class SwitchRefused(RouterError):
    """A role switch that cannot start now; nothing was changed."""

    status_code = 409
    error_type = "invalid_request_error"
    code = "role_switch_refused"


class UnknownWorker(RouterError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "worker_not_found"


class SwitchFailed(RouterError):
    """The worker's ``SwitchRole`` failed (it refused, died or timed out); health checks decide what it is now."""

    status_code = 502
    error_type = "server_error"
    code = "role_switch_failed"


class RoleSwitchRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /admin/workers/{id}/role``'s body."""

    role: Role
    # How long a decode worker's requests may finish before the rest migrate; 0: the worker's --drain-timeout-s.
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


_REQUEST_DECODER = msgspec.json.Decoder(RoleSwitchRequest)


def decode_switch_request(body: bytes) -> RoleSwitchRequest:
    """The body, or a 400 naming the field at fault."""
    return decode_json(_REQUEST_DECODER, body)


@dataclass(frozen=True)
class SwitchOutcome:
    address: str
    previous_role: str
    role: str
    epoch: int
    drain_s: float
    seconds: float  # the worker's own switch
    num_migrated: int

    def to_json(self) -> dict[str, object]:
        return {"address": self.address, "previous_role": self.previous_role, "role": self.role,
                "epoch": self.epoch, "drain_s": round(self.drain_s, 3), "seconds": round(self.seconds, 3),
                "num_migrated": self.num_migrated}


class RoleSwitching:
    """Switches workers' roles through the pool, one at a time, keeping pairing and discovery in step."""

    def __init__(self, policy: PairingPolicy, pool: WorkerPool, discovery: Discovery,
                 rpc_timeout_s: float = SWITCH_RPC_TIMEOUT_S) -> None:
        self.policy = policy
        self.pool = pool
        self.discovery = discovery
        self.rpc_timeout_s = rpc_timeout_s
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def find(self, worker_id: str) -> WorkerState:
        """The worker by address, else by engine id; UnknownWorker when none."""
        workers = self.policy.workers()
        found = next((w for w in workers if w.address == worker_id), None) or \
            next((w for w in workers if w.identity is not None and w.identity.engine_id == worker_id), None)
        if found is None:
            raise UnknownWorker(f"no worker {worker_id!r} (an address or engine id GET /admin/workers lists)")
        return found

    def check(self, worker: WorkerState, new_role: Role) -> None:
        """SwitchRefused when ``worker`` cannot switch to ``new_role`` now."""
        identity = worker.identity
        if worker.role == new_role:
            raise SwitchRefused(f"worker {worker.address} already serves the {new_role} role")
        if not worker.available or identity is None:
            raise SwitchRefused(f"worker {worker.address} is not available ({self.policy.worker_state(worker)})")
        if not identity.switchable:
            raise SwitchRefused(f"worker {worker.address} cannot switch roles (started without --role-switching)")
        if not any(w.available for w in self.policy.workers(worker.role) if w is not worker):
            raise SwitchRefused(f"worker {worker.address} is the only available {worker.role} worker")

    async def _wait_for_unsent(self, worker: WorkerState) -> None:
        """Wait (bounded) until every request this router already paired with ``worker`` as its decode worker
        has sent its Generate: one whose prefill was still running would otherwise reach the worker after its
        drain ended, in its new role, and fail after the client had its first token."""
        deadline = time.monotonic() + UNSENT_WAIT_S
        while worker.unsent_generates > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def switch_role(self, address: str, new_role: Role, drain_timeout_s: float = 0.0) -> SwitchOutcome:
        """Switch the worker at ``address`` (or with that engine id) to ``new_role``; see the module docstring.

        ``drain_timeout_s``: how long a decode worker's requests may finish before the rest migrate (0: the
        worker's own --drain-timeout-s).
        """
        new_role = Role(new_role)
        if self.busy:
            raise SwitchRefused("a role switch is under way (one at a time)")
        async with self._lock:
            worker = self.find(address)
            self.check(worker, new_role)
            old = worker.role
            worker.switching = True
            started = time.monotonic()
            log.info("role switch: %s worker %s -> %s", old, worker.address, new_role)
            try:
                await self._wait_for_unsent(worker)
                answer = await self.pool.switch_role(old, worker.address, new_role, drain_timeout_s,
                                                     self.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.warning("role switch of %s to %s failed: %s: %s", worker.address, new_role, exc.code().name,
                            exc.details())
                raise SwitchFailed(f"worker {worker.address} did not switch to {new_role}: {exc.code().name}: "
                                   f"{exc.details()}") from None
            finally:
                worker.switching = False
            self.discovery.move(worker.address, new_role)
            await self.discovery.check_health()
            log.info("role switch: worker %s serves %s now (epoch %d) after %.2fs (drain %.2fs, %d migrated)",
                     worker.address, new_role, answer.epoch, time.monotonic() - started, answer.drain_seconds,
                     answer.num_migrated)
            return SwitchOutcome(worker.address, answer.previous_role, answer.role, answer.epoch,
                                 answer.drain_seconds, answer.seconds, answer.num_migrated)
