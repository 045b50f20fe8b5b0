"""The drain that stops a worker (the ``Drain`` RPC, SIGTERM): the role's drain as for a switch, bounded as a
whole; one drain per worker, joined by later callers; no switch once it started; the server refuses counted
calls only after the role's drain, and stops only on ``terminate``."""

from __future__ import annotations

import asyncio

import pytest
from grpc_health.v1 import health_pb2

from services.worker import role_switch
from services.worker.grpc_server import WorkerServer
from services.worker.role_switch import RoleSwitch, StopDrain, SwitchRefused
from tests.unit.worker.test_role_switch import FakeSide, switchable


class SlowEvictSide(FakeSide):
    """A decode side whose given-back streams never end (a call stuck in its pull)."""

    async def evict(self) -> int:
        self.evicted = self.work
        return self.evicted


def test_decode_stop_drain_waits_for_its_bound_then_migrates() -> None:
    async def run() -> None:
        switch = RoleSwitch("decode", 5)
        decode = FakeSide(True, outstanding=2)
        switch.add_side("decode", decode)
        task = asyncio.create_task(switch.drain_to_stop(0.1))
        await asyncio.sleep(0.03)
        # Before the bound: nothing given back, and a late request is still taken (a router that has not seen
        # the drain yet loses nothing).
        assert not task.done() and decode.evicted == 0 and switch.stopping
        assert switch.refusal("decode") is None
        result = await task
        assert (result.role, result.num_migrated, result.num_left) == ("decode", 2, 0) and decode.evicted == 2

    asyncio.run(run())


def test_decode_stop_drain_that_finishes_early_migrates_nothing() -> None:
    async def run() -> None:
        switch = RoleSwitch("decode", 5)
        decode = FakeSide(True, outstanding=1)
        switch.add_side("decode", decode)
        task = asyncio.create_task(switch.drain_to_stop(5.0))
        await asyncio.sleep(0.03)
        decode.work = 0  # the request finished
        result = await asyncio.wait_for(task, 1.0)
        assert (result.num_migrated, result.num_left) == (0, 0) and decode.evicted == 0

    asyncio.run(run())


def test_prefill_stop_drain_waits_for_tickets_and_refuses_prompts() -> None:
    async def run() -> None:
        switch = RoleSwitch("prefill", 5)
        prefill = FakeSide(False, outstanding=1)
        switch.add_side("prefill", prefill)
        task = asyncio.create_task(switch.drain_to_stop(5.0))
        await asyncio.sleep(0.05)
        assert not task.done() and prefill.evicted == 0  # a ticket out: nothing ends it early
        assert "draining to stop" in switch.refusal("prefill")
        prefill.work = 0  # pulled, released or expired
        result = await asyncio.wait_for(task, 1.0)
        assert (result.role, result.num_migrated, result.num_left) == ("prefill", 0, 0)

    asyncio.run(run())


def test_stop_drain_gives_up_at_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound a prefill drain leaves its tickets to the stop; a decode one whose given-back calls do not
    end in the grace leaves those (no error: the worker is going away)."""
    monkeypatch.setattr(role_switch, "STOP_EVICT_GRACE_S", 0.05)

    async def run() -> None:
        switch = RoleSwitch("prefill", 5)
        switch.add_side("prefill", FakeSide(False, outstanding=2))
        result = await asyncio.wait_for(switch.drain_to_stop(0.05), 1.0)
        assert (result.num_migrated, result.num_left) == (0, 2)
        switch = RoleSwitch("decode", 5)
        switch.add_side("decode", SlowEvictSide(True, outstanding=3))
        result = await asyncio.wait_for(switch.drain_to_stop(0.02), 1.0)
        assert (result.num_migrated, result.num_left) == (3, 3)

    asyncio.run(run())


def test_no_switch_starts_once_stopping() -> None:
    async def run() -> None:
        switch, _, _ = switchable("prefill")
        await switch.drain_to_stop(1.0)
        with pytest.raises(SwitchRefused, match="draining to stop"):
            switch.check("decode")

    asyncio.run(run())


def test_stop_drain_lets_a_switch_under_way_end_first() -> None:
    async def run() -> None:
        switch, prefill, decode = switchable("prefill", prefill=FakeSide(False, outstanding=1),
                                             decode=FakeSide(True, outstanding=0))
        switching = asyncio.create_task(switch.switch("decode", drain_timeout_s=1.0))
        await asyncio.sleep(0.02)
        stopping = asyncio.create_task(switch.drain_to_stop(5.0))
        await asyncio.sleep(0.05)
        assert not stopping.done()
        prefill.work = 0
        await switching
        result = await asyncio.wait_for(stopping, 1.0)
        assert result.role == "decode" and switch.role == "decode"

    asyncio.run(run())


def test_server_drain_is_one_drain_and_stops_only_on_terminate() -> None:
    async def run() -> None:
        server = WorkerServer(["pdserve.v1.DecodeWorker"], max_receive_bytes=1 << 20)
        server.bind("127.0.0.1", 0)
        await server.server.start()
        calls: list[float] = []
        release = asyncio.Event()

        async def role_drain(timeout_s: float):
            calls.append(timeout_s)
            assert not server.in_flight.draining  # counted calls are still taken while the role drains
            await release.wait()
            return StopDrain("decode", 4, 0)

        server.role_drain = role_drain
        first = asyncio.create_task(server.drain(7.0))
        await asyncio.sleep(0.02)
        assert server.draining
        status = await server.health.Check(health_pb2.HealthCheckRequest(service=""), None)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        second = asyncio.create_task(server.drain(99.0))  # e.g. SIGTERM during the Drain RPC's drain
        terminating = asyncio.create_task(server.terminate(99.0))
        await asyncio.sleep(0.02)
        assert not first.done() and not second.done() and not terminating.done()
        release.set()
        outcomes = await asyncio.gather(first, second)
        assert outcomes[0] == outcomes[1] and outcomes[0].num_migrated == 4 and outcomes[0].role == "decode"
        assert calls == [7.0]  # one role drain, with the first caller's bound
        assert server.in_flight.draining  # drained: counted calls are refused from now on
        await asyncio.wait_for(terminating, 5.0)
        assert server.stopped.is_set()

    asyncio.run(run())


def test_server_drained_by_the_rpc_keeps_running_until_terminate() -> None:
    async def run() -> None:
        server = WorkerServer([], max_receive_bytes=1 << 20)
        server.bind("127.0.0.1", 0)
        await server.server.start()
        server.in_flight.enter()  # a call without a role drain to wait for it: the old SIGTERM drain
        task = asyncio.create_task(server.drain(5.0))
        await asyncio.sleep(0.02)
        assert server.in_flight.draining and not task.done()
        server.in_flight.leave()
        outcome = await asyncio.wait_for(task, 1.0)
        assert outcome.num_left == 0 and not server.stopped.is_set()
        await server.terminate(5.0)  # the drain is done: it stops at once
        assert server.stopped.is_set()

    asyncio.run(run())
