"""The router's side of role switching: discovery moves a switched worker to its new role (a switchable worker
reporting another role than listed is adopted, any other is refused), pairing moves a migrated request to
another decode worker, and RoleSwitching refuses what it must and keeps the table in step. The worker's own
state machine is tests/unit/worker/test_role_switch.py; real daemons, tests/e2e/test_role_switch.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.proto_gen.pdserve.v1 import worker_pb2
from services.router.discovery import Discovery, EndpointSource
from services.router.pairing import PairingPolicy, Role, WorkerIdentity
from services.router.role_switch import RoleSwitching, SwitchFailed, SwitchRefused, UnknownWorker

BOTH = ("prefill", "decode")


def _identity(role: str, epoch: int = 1, roles: tuple[str, ...] = BOTH) -> WorkerIdentity:
    return WorkerIdentity(engine_id=f"worker-{epoch}", role=role, compat_hash="h", epoch=epoch, roles=roles)


class Workers:
    """Info per address (the health probe) and a scripted SwitchRole."""

    def __init__(self, **roles: str) -> None:
        self.identity = {address.replace("_", ":"): _identity(role) for address, role in roles.items()}
        self.fail: grpc.StatusCode | None = None
        self.switched: list[tuple[str, str, str]] = []

    async def info(self, role: Role, address: str) -> WorkerIdentity:
        return self.identity[address]

    async def switch_role(self, role: Role, address: str, new_role: Role, drain_timeout_s: float,
                          timeout_s: float) -> worker_pb2.SwitchRoleResponse:
        if self.fail is not None:
            raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted")
        self.switched.append((address, role.value, new_role.value))
        old = self.identity[address]
        self.identity[address] = _identity(new_role.value, old.epoch + 1, old.roles)
        return worker_pb2.SwitchRoleResponse(role=new_role.value, previous_role=role.value, epoch=old.epoch + 1,
                                             drain_seconds=0.5, seconds=0.6, num_migrated=2)


async def _table(workers: Workers, prefill: tuple[str, ...], decode: tuple[str, ...]
                 ) -> tuple[PairingPolicy, Discovery]:
    policy = PairingPolicy()
    discovery = Discovery(policy, [EndpointSource(Role.PREFILL, prefill), EndpointSource(Role.DECODE, decode)],
                          workers.info)
    await discovery.refresh()
    return policy, discovery


def _roles(policy: PairingPolicy) -> dict[str, tuple[str, bool]]:
    return {w.address: (w.role.value, w.available) for w in policy.workers()}


def test_a_switchable_worker_reporting_another_role_is_moved_an_ordinary_one_refused() -> None:
    async def run() -> None:
        workers = Workers(a_1="prefill", b_1="decode", c_1="decode")
        workers.identity["c:1"] = _identity("prefill", roles=())  # predates role switching
        policy, discovery = await _table(workers, ("a:1",), ("b:1", "c:1"))
        workers.identity["b:1"] = _identity("prefill", 2)  # switched under another router (or restarted)
        await discovery.check_health()
        assert _roles(policy) == {"a:1": ("prefill", True), "b:1": ("prefill", True), "c:1": ("decode", False)}
        assert "listed as decode" in policy.get(Role.DECODE, "c:1").last_error
        await discovery.refresh_endpoints()  # a listing refresh keeps the move
        assert policy.get(Role.PREFILL, "b:1") is not None and policy.get(Role.DECODE, "b:1") is None

    asyncio.run(run())


def test_move_decode_picks_another_available_decode_worker() -> None:
    async def run() -> None:
        workers = Workers(p_1="prefill", d_1="decode", d_2="decode")
        policy, _ = await _table(workers, ("p:1",), ("d:1", "d:2"))
        assignment = policy.acquire(10)
        first = assignment.decode
        moved = policy.move_decode(assignment)
        assert moved is not None and moved != first and assignment.decode == moved
        assert {w.address: w.outstanding_requests for w in policy.workers(Role.DECODE)} == {first: 0, moved: 1}
        policy.get(Role.DECODE, first).healthy = False
        assert policy.move_decode(assignment) is None and assignment.decode == moved  # nowhere else to go
        policy.finish(assignment)
        assert all(w.outstanding_requests == 0 for w in policy.workers())

    asyncio.run(run())


def test_switch_role_moves_the_worker_and_refuses_what_it_must() -> None:
    async def run() -> None:
        workers = Workers(p_1="prefill", p_2="prefill", d_1="decode")
        policy, discovery = await _table(workers, ("p:1", "p:2"), ("d:1",))
        switching = RoleSwitching(policy, workers, discovery)
        with pytest.raises(SwitchRefused, match="only available decode"):
            await switching.switch_role("d:1", Role.PREFILL)
        with pytest.raises(SwitchRefused, match="already serves"):
            await switching.switch_role("p:1", Role.PREFILL)
        with pytest.raises(UnknownWorker):
            switching.find("nowhere:1")
        outcome = await switching.switch_role("p:2", Role.DECODE)
        assert (outcome.previous_role, outcome.role, outcome.epoch, outcome.num_migrated) == ("prefill", "decode", 2, 2)
        assert _roles(policy) == {"p:1": ("prefill", True), "p:2": ("decode", True), "d:1": ("decode", True)}
        assert switching.find("worker-2").address == "p:2"  # by engine id too
        workers.fail = grpc.StatusCode.UNAVAILABLE  # the worker died mid-switch: health checks take over
        with pytest.raises(SwitchFailed):
            await switching.switch_role("p:2", Role.PREFILL)
        assert not policy.get(Role.DECODE, "p:2").switching

    asyncio.run(run())


def test_one_switch_at_a_time_and_no_new_work_while_switching() -> None:
    async def run() -> None:
        workers = Workers(p_1="prefill", p_2="prefill", d_1="decode")
        policy, discovery = await _table(workers, ("p:1", "p:2"), ("d:1",))
        gate = asyncio.Event()
        switch = workers.switch_role

        async def slow(*args):
            await gate.wait()
            return await switch(*args)

        workers.switch_role = slow
        switching = RoleSwitching(policy, workers, discovery)
        task = asyncio.create_task(switching.switch_role("p:2", Role.DECODE))
        await asyncio.sleep(0.01)
        assert not policy.get(Role.PREFILL, "p:2").available  # pairing chooses it for nothing new
        assert all(policy.acquire(10).prefill == "p:1" for _ in range(3))
        with pytest.raises(SwitchRefused, match="one at a time"):
            await switching.switch_role("p:1", Role.DECODE)
        gate.set()
        await task

    asyncio.run(run())
