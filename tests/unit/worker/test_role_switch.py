"""The worker's role switch as a state machine: refusals, drains (prefill waits, decode evicts past its bound),
the one-step swap of role and epoch, and a cancelled switch leaving the worker as it was."""

from __future__ import annotations

import asyncio

import pytest

from services.common.metrics import WorkerMetrics
from services.worker.role_switch import RoleSwitch, SwitchRefused


class FakeSide:
    def __init__(self, accepts: bool, outstanding: int = 0) -> None:
        self.accepts_while_draining = accepts
        self.work = outstanding
        self.evicted = 0
        self.epochs: list[int] = []
        self.resumed = 0

    def outstanding(self) -> int:
        return self.work

    async def evict(self) -> int:
        self.evicted, self.work = self.work, 0  # every stream ends migrated at once
        return self.evicted

    def start_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def resume(self) -> None:
        self.resumed += 1


def switchable(role: str = "prefill", prefill: FakeSide | None = None, decode: FakeSide | None = None
               ) -> tuple[RoleSwitch, FakeSide, FakeSide]:
    switch = RoleSwitch(role, 100, ("prefill", "decode"), WorkerMetrics(role))
    prefill, decode = prefill or FakeSide(False), decode or FakeSide(True)
    switch.add_side("prefill", prefill)
    switch.add_side("decode", decode)
    return switch, prefill, decode


def count(switch: RoleSwitch, old: str, new: str, result: str) -> float:
    return switch.metrics.role_switches.labels(old, new, result)._value.get()


def test_refusals_change_nothing() -> None:
    single = RoleSwitch("decode", 7)
    with pytest.raises(SwitchRefused, match="--role-switching"):
        single.check("prefill")
    switch, _, _ = switchable()
    with pytest.raises(SwitchRefused, match="already serves"):
        switch.check("prefill")
    with pytest.raises(ValueError):
        switch.check("router")
    assert (switch.role, switch.epoch, switch.switching_to) == ("prefill", 100, None)


def test_prefill_to_decode_waits_for_tickets_then_swaps_role_and_epoch() -> None:
    async def run() -> None:
        switch, prefill, decode = switchable("prefill", prefill=FakeSide(False, outstanding=2))
        epochs: list[int] = []
        switch.on_epoch.append(epochs.append)
        task = asyncio.create_task(switch.switch("decode", drain_timeout_s=0.0))
        await asyncio.sleep(0.05)
        # Draining: still prefill, new prompts refused, Info would say switching_to=decode; no eviction (the
        # lease bounds a prefill drain, not drain_timeout_s).
        assert not task.done() and switch.role == "prefill" and switch.switching_to == "decode"
        assert switch.refusal("prefill") is not None and prefill.evicted == 0
        prefill.work = 0  # every ticket pulled, released or expired
        result = await task
        assert (result.previous_role, result.role, result.num_migrated) == ("prefill", "decode", 0)
        assert switch.role == "decode" and switch.switching_to is None and switch.epoch == result.epoch > 100
        assert decode.epochs == [result.epoch] and epochs == [result.epoch]
        assert switch.refusal("decode") is None and "serves the decode role" in switch.refusal("prefill")
        assert count(switch, "prefill", "decode", "ok") == 1

    asyncio.run(run())


def test_decode_drain_accepts_work_then_migrates_past_its_bound() -> None:
    async def run() -> None:
        switch, prefill, decode = switchable("decode", decode=FakeSide(True, outstanding=3))
        task = asyncio.create_task(switch.switch("prefill", drain_timeout_s=0.05))
        await asyncio.sleep(0.01)
        assert switch.refusal("decode") is None  # a late request is taken (and migrated), never refused
        with pytest.raises(SwitchRefused, match="under way"):
            switch.check("prefill")
        result = await task
        assert result.num_migrated == 3 and decode.evicted == 3 and switch.role == "prefill"
        assert prefill.epochs == [result.epoch]

    asyncio.run(run())


def test_a_cancelled_switch_keeps_the_old_role_and_epoch() -> None:
    async def run() -> None:
        switch, prefill, _ = switchable("prefill", prefill=FakeSide(False, outstanding=1))
        task = asyncio.create_task(switch.switch("decode", drain_timeout_s=1.0))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (switch.role, switch.epoch, switch.switching_to) == ("prefill", 100, None)
        assert switch.refusal("prefill") is None and prefill.resumed == 1
        assert count(switch, "prefill", "decode", "cancelled") == 1

    asyncio.run(run())
