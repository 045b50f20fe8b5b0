"""The router's planner task: every ``--planner-interval-s`` it reads the workers and the traffic, asks the
planner (``planner.py``), exports the decision as metrics, logs it when it changes and, with
``--role-planner``, acts on a SWITCH through the role-switch hook.

Advisory mode (the default): decisions are computed, logged and exported
(``pdserve_planner_desired_workers{role}`` for a Kubernetes HPA, which may exceed the workers there are now),
never acted on.

Acting mode (``--role-planner``): the workers are a fixed pool (``desired`` stays within it); a SWITCH is
handed to a :data:`RoleSwitcher`, awaited in a task of its own (one at a time; evaluations go on meanwhile
and say ``switch_in_progress``). The switcher is the router's in-place role switch (``role_switch.py``:
drain the worker for its old role, switch, re-handshake); where none is given, :func:`switch_unavailable`
stands in: it logs the request and raises :class:`SwitchUnavailable`, counted as ``result="unavailable"``.
A switcher that raises anything else is counted as ``failed``; one that returns, as ``ok``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from services.router.metrics import RouterMetrics
from services.router.pairing import PairingPolicy, Role
from services.router.planner import Decision, DecisionReason, Planner, Switch, WorkerView
from services.router.prefix_index import PrefixIndex
from services.router.traffic import TrafficStats, TrafficWindow

log = logging.getLogger(__name__)

#: The role-switch hook: ``await switch_role(address, new_role)`` returns once the worker serves ``new_role``
#: (or raises). Provided by the router's role switching; :func:`switch_unavailable` until then.
RoleSwitcher = Callable[[str, Role], Awaitable[None]]


class SwitchUnavailable(RuntimeError):
    """The router cannot switch workers' roles (no switcher was given to it)."""


async def switch_unavailable(address: str, role: Role) -> None:
    """The stand-in switcher: says what would have been done, and that it cannot be."""
    log.warning("planner: would switch %s to %s, but this router has no role switching: nothing done", address, role)
    raise SwitchUnavailable("no role switcher is installed")


def worker_views(policy: PairingPolicy, index: PrefixIndex | None) -> list[WorkerView]:
    """Every worker of the pairing table as the planner sees it (load from the prefix index's last report; on a
    decode worker, the requests whose Generate was sent, those still waiting for it are not decode work yet).
    With KV parts on, a request's ``GenerateParts`` goes out with its first part, so it counts as decoding while
    its prompt is still prefilling: its decode worker holds its seat and the whole prompt's blocks from then."""
    views = []
    for w in policy.workers():
        identity = w.identity
        load = index.load(w.address, identity.epoch) if index is not None and identity is not None else None
        decoding = w.outstanding_requests - w.unsent_generates if w.role == Role.DECODE else 0
        views.append(WorkerView(w.address, w.role, w.available, load, w.outstanding_requests,
                                identity.block_size if identity is not None else None, max(decoding, 0)))
    return views


class PlannerLoop:
    """Evaluates the planner periodically; holds the last decision for ``GET /admin/planner``."""

    def __init__(self, planner: Planner, policy: PairingPolicy, traffic: TrafficWindow, metrics: RouterMetrics,
                 *, index: PrefixIndex | None = None, interval_s: float = 10.0, acting: bool = False,
                 switcher: RoleSwitcher = switch_unavailable, busy: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``busy``: whether a role switch someone else started (``POST /admin/workers/{id}/role``) is under way;
        the planner starts none meanwhile."""
        self.planner = planner
        self.policy = policy
        self.traffic = traffic
        self.metrics = metrics
        self.index = index
        self.interval_s = interval_s
        self.acting = acting
        self.switcher = switcher
        self.busy = busy
        self.clock = clock
        self.last: Decision | None = None
        self.last_traffic: TrafficStats | None = None
        self._switch_task: asyncio.Task[None] | None = None

    @property
    def switching(self) -> bool:
        """A role switch is under way: the planner's own, or (``busy``) one started elsewhere."""
        own = self._switch_task is not None and not self._switch_task.done()
        return own or (self.busy is not None and self.busy())

    def evaluate(self) -> Decision:
        """One evaluation: decide, export, log a change (INFO, with the inputs)."""
        now = self.clock()
        self.last_traffic = traffic = self.traffic.stats(now)
        decision = self.planner.evaluate(worker_views(self.policy, self.index), traffic, now, self.switching,
                                         fixed_pool=self.acting)
        self.metrics.observe_planner(decision)
        if self._changed(decision):
            log.info("%s%s", decision.summary(), "" if self.acting or decision.switch is None else " (advisory)")
        self.last = decision
        return decision

    def _changed(self, decision: Decision) -> bool:
        last = self.last
        return last is None or (last.reason, last.target, last.desired, last.switch) != \
            (decision.reason, decision.target, decision.desired, decision.switch)

    def step(self) -> Decision:
        """Evaluate, and in acting mode start the decided switch."""
        decision = self.evaluate()
        if self.acting and decision.reason is DecisionReason.SWITCH and decision.switch is not None:
            self.planner.record_switch(decision.at_s)
            self._switch_task = asyncio.create_task(self._switch(decision.switch), name="pdserve-router-role-switch")
        return decision

    async def _switch(self, switch: Switch) -> None:
        log.info("planner: switching %s from %s to %s", switch.address, switch.from_role, switch.to_role)
        result = "ok"
        try:
            await self.switcher(switch.address, switch.to_role)
        except SwitchUnavailable:
            result = "unavailable"
        except Exception:  # noqa: BLE001 - a failed switch is logged and counted; the planner goes on
            result = "failed"
            log.exception("planner: switching %s to %s failed", switch.address, switch.to_role)
        self.metrics.planner_switches.labels(switch.to_role.value, result).inc()

    async def run(self) -> None:
        """Evaluate every ``interval_s`` until cancelled (then a switch in progress is cancelled too)."""
        self.traffic.start(self.clock())
        try:
            while True:
                try:
                    self.step()
                except Exception:  # noqa: BLE001 - one bad evaluation must not stop the planner
                    log.exception("planner: evaluation failed")
                await asyncio.sleep(self.interval_s)
        finally:
            if self._switch_task is not None:
                self._switch_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._switch_task
