"""Role switching in place: one worker process serves either role, one switch at a time.

A worker started with ``--role-switching`` registers both roles' services; :class:`RoleSwitch` says which
one it serves now and runs a switch::

    serving(old) ──SwitchRole(new)──► draining(old → new) ──drained──► serving(new), new epoch
                                           │ cancelled (the caller gave up)
                                           └──────────────────────────► serving(old), same epoch

Draining: the old role's side (:class:`RoleSide`) says how much work it still has. A prefill worker waits
until every ticket it issued is pulled, released or expired (its lease bounds that), refusing new prompts
meanwhile. A decode worker keeps taking requests (a router that has not seen the switch yet loses nothing),
lets them finish for ``drain_timeout_s``, then gives what is left back (``evict``: each stream ends
``migrated`` and the router replays it elsewhere) and waits for those streams to end.

The switch itself is one synchronous step after the drain (check, then act): the role and a new epoch
change together, the new role's side starts its epoch (a new ticket key, a new KV identity epoch peers
re-handshake for), and the ``on_epoch`` hooks run (the KV event streams restart). Nothing of the engine
changes: the model, the KV pool and its NIXL registrations stay, so a worker meant to switch is started
with engine settings valid for both roles.

Stopping a worker drains it the same way (``drain_to_stop``, which the daemon's ``Drain`` RPC and SIGTERM run
through services/worker/grpc_server.py), for a worker of either kind: the role served now drains as above, no
switch starts any more, and the drain is bounded by ``drain_timeout_s`` as a whole (a prefill worker's tickets
are given up past it; a decode worker's requests are migrated at it, then get ``STOP_EVICT_GRACE_S`` to end).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from services.common.metrics import WorkerMetrics

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
#: How often a drain looks at the old role's outstanding work.
DRAIN_POLL_S = 0.01
#: After evicting, how long the given-back streams (and calls still starting: a pull waits up to
#: --kv-transfer-timeout-s) may take to end before the switch fails.
EVICT_GRACE_S = 60.0
#: The same when the worker is being stopped: the stop cuts what is left after it (a pod's grace period is
#: its drain bound plus a margin this fits in).
STOP_EVICT_GRACE_S = 5.0


class SwitchRefused(RuntimeError):
    """A switch that cannot start now (not switchable, same role, another switch under way): nothing changed."""


class RoleSide(Protocol):
    """What one role gives a switch: how busy it is, how to end its work early, how to start an epoch."""

    #: Whether the role takes new work while it drains (decode: yes, it migrates it; prefill: no).
    accepts_while_draining: bool

    def outstanding(self) -> int:
        """Work the drain waits for (in-flight calls, tickets not yet pulled, running requests)."""
        ...

    async def evict(self) -> int:
        """Past the drain bound: give the remaining work back (decode: migrate); how many requests."""
        ...

    def start_epoch(self, epoch: int) -> None:
        """This role is served from now on, under ``epoch``."""
        ...

    def resume(self) -> None:
        """A switch away from this role did not happen (failed, cancelled): serve on as before."""
        ...


@dataclass(frozen=True)
class SwitchResult:
    previous_role: str
    role: str
    epoch: int
    drain_s: float
    seconds: float
    num_migrated: int


@dataclass(frozen=True)
class StopDrain:
    """How the role's drain of a worker being stopped ended."""

    role: str
    num_migrated: int
    num_left: int  # outstanding work given up at the bound (0: drained)


class RoleSwitch:
    """The role a worker serves now, its epoch, and the switch between roles (one at a time)."""

    def __init__(self, role: str, epoch: int, roles: tuple[str, ...] = (), metrics: WorkerMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``roles``: what the worker can serve (default: only ``role``, so it never switches)."""
        roles = roles or (role,)
        if role not in roles or any(r not in ROLES for r in roles):
            raise ValueError(f"role {role!r} and roles {roles} must be among {ROLES}")
        self.role = role
        self.epoch = epoch
        self.roles = roles
        self.switching_to: str | None = None
        self.stopping = False  # draining (or drained) to stop: no switch starts, Info says draining
        self.metrics = metrics
        self._clock = clock
        self._sides: dict[str, RoleSide] = {}
        self.on_epoch: list[Callable[[int], None]] = []  # run after each switch, with the new epoch

    @property
    def switchable(self) -> bool:
        return len(self.roles) > 1

    def add_side(self, role: str, side: RoleSide) -> None:
        self._sides[role] = side

    def refusal(self, role: str) -> str | None:
        """Why a new call of ``role`` is refused now (None: serve it)."""
        if role != self.role:
            return f"this worker serves the {self.role} role now"
        side = self._sides.get(role)
        if self.switching_to is not None and (side is None or not side.accepts_while_draining):
            return f"this worker is switching from the {role} role to {self.switching_to}"
        if self.stopping and (side is None or not side.accepts_while_draining):
            return f"this {role} worker is draining to stop"
        return None

    def check(self, new_role: str) -> None:
        """Raise if a switch to ``new_role`` cannot start now: ValueError (not a role), SwitchRefused."""
        if new_role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {new_role!r}")
        if self.stopping:
            raise SwitchRefused("this worker is draining to stop")
        if not self.switchable:
            raise SwitchRefused(f"this worker serves only the {self.role} role (start it with --role-switching)")
        if new_role not in self.roles or new_role not in self._sides:
            raise SwitchRefused(f"this worker cannot serve the {new_role} role")
        if self.switching_to is not None:
            raise SwitchRefused(f"a switch from {self.role} to {self.switching_to} is under way")
        if new_role == self.role:
            raise SwitchRefused(f"this worker already serves the {new_role} role")

    async def switch(self, new_role: str, drain_timeout_s: float) -> SwitchResult:
        """Drain the current role, then serve ``new_role`` under a new epoch; see the module docstring."""
        self.check(new_role)
        old, side = self.role, self._sides[self.role]
        started = self._clock()
        self.switching_to = new_role
        log.info("role switch %s -> %s: draining (%d outstanding)", old, new_role, side.outstanding())
        result = "failed"
        try:
            num_migrated = await self._drain(side, drain_timeout_s)
            drain_s = self._clock() - started
            epoch = self._take_role(new_role)
            result = "ok"
        except asyncio.CancelledError:
            result = "cancelled"
            raise
        finally:
            self.switching_to = None
            if result != "ok":
                side.resume()  # e.g. decode streams stop being given back
            self._count(old, new_role, result, started)
        seconds = self._clock() - started
        if self.metrics is not None:
            self.metrics.role_drain_seconds.labels(old).observe(drain_s)
        log.info("role switch %s -> %s: done in %.2fs (drain %.2fs, %d migrated), epoch %d", old, new_role, seconds,
                 drain_s, num_migrated, epoch)
        return SwitchResult(old, new_role, epoch, drain_s, seconds, num_migrated)

    async def drain_to_stop(self, drain_timeout_s: float) -> StopDrain:
        """The drain of a worker being stopped: the role served now drains as for a switch, within
        ``drain_timeout_s`` as a whole; no switch starts from now on. A switch under way ends first (within the
        bound; past it the role served then is drained as it is)."""
        self.stopping = True
        deadline = self._clock() + drain_timeout_s
        while self.switching_to is not None and self._clock() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        role = self.role
        side = self._sides.get(role)
        if side is None:
            return StopDrain(role, 0, 0)
        log.info("draining the %s role to stop (%d outstanding, bound %.1fs)", role, side.outstanding(),
                 drain_timeout_s)
        num_migrated = await self._drain(side, max(deadline - self._clock(), 0.0), stopping=True)
        left = side.outstanding()
        if left:
            log.warning("stopping with %d outstanding %s work (past the drain bound of %.1fs)", left, role,
                        drain_timeout_s)
        return StopDrain(role, num_migrated, left)

    async def _drain(self, side: RoleSide, drain_timeout_s: float, stopping: bool = False) -> int:
        """Wait for the side's work to end; past ``drain_timeout_s``, evict what is left (a side that accepts
        work while draining; the other kind has its own bound, the prefill lease) and wait for that.

        ``stopping`` (the worker is being stopped): the bound holds for both kinds, and what has not ended
        ``STOP_EVICT_GRACE_S`` after the eviction is left to the stop (no error)."""
        deadline = self._clock() + drain_timeout_s
        while side.outstanding() > 0 and (not (side.accepts_while_draining or stopping)
                                          or self._clock() < deadline):
            await asyncio.sleep(DRAIN_POLL_S)
        if side.outstanding() == 0 or not side.accepts_while_draining:
            return 0
        num_migrated = await side.evict()
        grace = self._clock() + (STOP_EVICT_GRACE_S if stopping else EVICT_GRACE_S)
        while side.outstanding() > 0:
            if self._clock() > grace:
                if stopping:
                    break
                raise TimeoutError(f"{side.outstanding()} requests still running {EVICT_GRACE_S:g}s after they "
                                   "were given back")
            await asyncio.sleep(DRAIN_POLL_S)
        return num_migrated

    def _take_role(self, new_role: str) -> int:
        """The switch proper, in one step: role and epoch change together, then the new side and hooks start."""
        self.epoch = max(time.time_ns(), self.epoch + 1)
        self.role = new_role
        self._sides[new_role].start_epoch(self.epoch)
        for hook in self.on_epoch:
            hook(self.epoch)
        return self.epoch

    def _count(self, old: str, new: str, result: str, started: float) -> None:
        if self.metrics is None:
            return
        self.metrics.role_switches.labels(old, new, result).inc()
        if result == "ok":
            self.metrics.role_switch_seconds.labels(old, new).observe(self._clock() - started)
