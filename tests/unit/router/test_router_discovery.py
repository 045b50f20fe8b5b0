"""Worker discovery: address parsing, DNS resolution, and the refresh / health state machine.

The probe and resolver are injected: these tests check the router's bookkeeping, not a worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

import pytest

from services.common.addresses import join_host_port, split_host_port
from services.router.discovery import Discovery, EndpointSource, resolve
from services.router.pairing import PairingPolicy, Role, WorkerIdentity


def _identity(role: Role, engine_id: str = "e") -> WorkerIdentity:
    return WorkerIdentity(engine_id=engine_id, role=role.value, compat_hash="h", max_model_len=512)


class ScriptedProbe:
    """Answers per address: an identity (up), an exception (down), or a hang (no answer)."""

    def __init__(self) -> None:
        self.up: dict[str, WorkerIdentity | None] = {}
        self.hang: set[str] = set()
        self.calls: list[str] = []

    async def __call__(self, role: Role, address: str) -> WorkerIdentity:
        self.calls.append(address)
        if address in self.hang:
            await asyncio.sleep(3600)
        identity = self.up.get(address)
        if identity is None:
            raise ConnectionRefusedError(f"{address} refused")
        return identity


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _states(policy: PairingPolicy) -> dict[str, bool]:
    return {w.address: w.available for w in policy.workers()}


@pytest.mark.parametrize(("entry", "expected"), [
    ("localhost:50051", ("localhost", 50051)),
    ("10.0.0.7:1", ("10.0.0.7", 1)),
    ("[::1]:8000", ("::1", 8000)),
    ("decode.pdserve.svc.cluster.local:9000", ("decode.pdserve.svc.cluster.local", 9000)),
])
def test_split_host_port(entry: str, expected: tuple[str, int]) -> None:
    assert split_host_port(entry) == expected


@pytest.mark.parametrize("entry", ["localhost", "host:", ":80", "host:0", "host:70000", "host:http", ""])
def test_split_host_port_rejects(entry: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        split_host_port(entry)


def test_bad_entries_are_rejected_when_configured() -> None:
    with pytest.raises(ValueError, match="nonsense"):
        EndpointSource(Role.DECODE, static=("nonsense",))


def test_join_host_port_brackets_ipv6() -> None:
    assert join_host_port("::1", 5) == "[::1]:5"
    assert join_host_port("127.0.0.1", 5) == "127.0.0.1:5"
    assert join_host_port("worker-0", 5) == "worker-0:5"


def test_resolve_localhost() -> None:
    addresses = asyncio.run(resolve("localhost:50051"))
    assert "127.0.0.1:50051" in addresses
    assert set(addresses) <= {"127.0.0.1:50051", "[::1]:50051"}
    assert addresses == sorted(set(addresses))


def test_resolve_unknown_name_raises() -> None:
    with pytest.raises(socket.gaierror):
        asyncio.run(resolve("no-such-host.invalid:1"))


def test_health_state_machine() -> None:
    async def scenario() -> None:
        policy, probe = PairingPolicy(), ScriptedProbe()
        sources = [EndpointSource(Role.PREFILL, static=("p:1",)), EndpointSource(Role.DECODE, static=("d:1", "d:2"))]
        discovery = Discovery(policy, sources, probe, health_timeout_s=0.05)

        await discovery.refresh()  # nobody answers yet
        assert _states(policy) == {"p:1": False, "d:1": False, "d:2": False}

        probe.up = {"p:1": _identity(Role.PREFILL), "d:1": _identity(Role.DECODE)}
        await discovery.refresh()
        assert _states(policy) == {"p:1": True, "d:1": True, "d:2": False}
        assert policy.has_healthy_pair() and policy.max_model_len() == 512

        probe.up.pop("d:1")  # goes down: taken out
        probe.hang.add("p:1")  # hangs: the timeout takes it out
        await discovery.refresh()
        assert _states(policy) == {"p:1": False, "d:1": False, "d:2": False}
        assert "within" in policy.get(Role.PREFILL, "p:1").last_error

        probe.up["d:1"] = _identity(Role.DECODE)  # answers again: put back
        probe.hang.clear()
        await discovery.refresh()
        assert _states(policy) == {"p:1": True, "d:1": True, "d:2": False}

    asyncio.run(scenario())


def test_a_worker_reporting_another_role_is_not_used() -> None:
    async def scenario() -> None:
        policy, probe = PairingPolicy(), ScriptedProbe()
        probe.up = {"x:1": _identity(Role.PREFILL)}
        discovery = Discovery(policy, [EndpointSource(Role.DECODE, static=("x:1",))], probe)
        await discovery.refresh()
        worker = policy.get(Role.DECODE, "x:1")
        assert not worker.available and "reports role 'prefill'" in worker.last_error

    asyncio.run(scenario())


def test_a_request_failure_marks_down_until_the_next_good_probe() -> None:
    async def scenario() -> None:
        policy, probe = PairingPolicy(), ScriptedProbe()
        probe.up = {"d:1": _identity(Role.DECODE)}
        discovery = Discovery(policy, [EndpointSource(Role.DECODE, static=("d:1",))], probe)
        await discovery.refresh()
        policy.mark_unhealthy(Role.DECODE, "d:1", "stream broke")
        assert not policy.has_healthy_decode()
        await discovery.refresh()
        assert policy.has_healthy_decode()

    asyncio.run(scenario())


def test_dns_entries_are_refreshed_and_failures_keep_the_last_answer() -> None:
    async def scenario() -> None:
        answers: dict[str, list[str] | Exception] = {"decode.svc:7": ["10.0.0.1:7", "10.0.0.2:7"]}
        closed: list[str] = []

        async def resolver(entry: str) -> list[str]:
            answer = answers[entry]
            if isinstance(answer, Exception):
                raise answer
            return answer

        async def on_removed(address: str) -> None:
            closed.append(address)

        policy, probe, clock = PairingPolicy(), ScriptedProbe(), FakeClock()
        discovery = Discovery(policy, [EndpointSource(Role.DECODE, static=("static:7",), dns=("decode.svc:7",))],
                              probe, dns_refresh_s=10, resolver=resolver, on_removed=on_removed, clock=clock)
        await discovery.refresh()
        assert sorted(_states(policy)) == ["10.0.0.1:7", "10.0.0.2:7", "static:7"]

        answers["decode.svc:7"] = ["10.0.0.2:7", "10.0.0.3:7"]  # a pod replaced
        clock.now = 5  # not due yet: the table stays
        await discovery.refresh()
        assert "10.0.0.1:7" in _states(policy)
        clock.now = 10
        await discovery.refresh()
        assert sorted(_states(policy)) == ["10.0.0.2:7", "10.0.0.3:7", "static:7"]
        assert closed == ["10.0.0.1:7"]

        answers["decode.svc:7"] = socket.gaierror("temporary failure")
        clock.now = 20
        await discovery.refresh()
        assert sorted(_states(policy)) == ["10.0.0.2:7", "10.0.0.3:7", "static:7"]

    asyncio.run(scenario())


def test_a_dropped_worker_keeps_its_channel_until_its_requests_are_done() -> None:
    """Scale-down: the pod leaves the DNS answers at once; the requests already on it must not be cut."""
    async def scenario() -> None:
        answers = {"decode.svc:7": ["10.0.0.1:7", "10.0.0.2:7"]}
        closed: list[str] = []

        async def resolver(entry: str) -> list[str]:
            return answers[entry]

        async def on_removed(address: str) -> None:
            closed.append(address)

        policy, probe, clock = PairingPolicy(), ScriptedProbe(), FakeClock()
        discovery = Discovery(policy, [EndpointSource(Role.DECODE, dns=("decode.svc:7",))], probe, dns_refresh_s=10,
                              resolver=resolver, on_removed=on_removed, clock=clock)
        for address in answers["decode.svc:7"]:
            probe.up[address] = _identity(Role.DECODE, address)
        await discovery.refresh()
        assignment = policy.acquire(10)
        leaving = assignment.decode
        answers["decode.svc:7"] = [a for a in answers["decode.svc:7"] if a != leaving]
        clock.now = 10
        await discovery.refresh()
        assert leaving not in _states(policy) and closed == []  # out of rotation, channel open
        clock.now = 12
        await discovery.refresh()
        assert closed == []
        policy.finish(assignment)
        clock.now = 14  # the next round, DNS not due: closed now
        await discovery.refresh()
        assert closed == [leaving]

    asyncio.run(scenario())


def test_an_address_listed_under_both_roles_keeps_its_channel() -> None:
    async def scenario() -> None:
        closed: list[str] = []

        async def on_removed(address: str) -> None:
            closed.append(address)

        sources = [EndpointSource(Role.PREFILL, dns=("both:1",)), EndpointSource(Role.DECODE, static=("10.0.0.9:1",))]
        answers = {"both:1": ["10.0.0.9:1"]}

        async def resolver(entry: str) -> list[str]:
            return answers[entry]

        discovery = Discovery(PairingPolicy(), sources, ScriptedProbe(), resolver=resolver, on_removed=on_removed)
        await discovery.refresh_endpoints()
        answers["both:1"] = []
        await discovery.refresh_endpoints()
        assert closed == []

    asyncio.run(scenario())


def test_run_loop_keeps_probing_and_stops_on_cancel() -> None:
    async def scenario() -> None:
        policy, probe = PairingPolicy(), ScriptedProbe()
        discovery = Discovery(policy, [EndpointSource(Role.DECODE, static=("d:1",))], probe, health_interval_s=0.01)
        task = asyncio.create_task(discovery.run())
        await asyncio.sleep(0.1)
        assert len(probe.calls) >= 3
        probe.up["d:1"] = _identity(Role.DECODE)
        await asyncio.sleep(0.05)
        assert policy.has_healthy_decode()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_unpairable_workers_are_logged_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        policy, probe = PairingPolicy(), ScriptedProbe()
        sources = [EndpointSource(Role.PREFILL, static=("p:1",)), EndpointSource(Role.DECODE, static=("d:1",))]
        discovery = Discovery(policy, sources, probe)
        probe.up = {"p:1": dataclasses.replace(_identity(Role.PREFILL), block_size=32),
                    "d:1": dataclasses.replace(_identity(Role.DECODE), block_size=48)}

        def unpairable() -> list[str]:
            return [r.getMessage() for r in caplog.records if "cannot pair" in r.getMessage()]

        with caplog.at_level(logging.INFO, logger="services.router.discovery"):
            await discovery.refresh()
            reason = "block sizes 32 (prefill) and 48 (decode) do not divide each other"
            assert unpairable() == [f"prefill worker p:1 cannot pair with any healthy worker: decode d:1: {reason}",
                                    f"decode worker d:1 cannot pair with any healthy worker: prefill p:1: {reason}"]
            assert all(r.levelno == logging.WARNING for r in caplog.records if "cannot pair" in r.getMessage())
            await discovery.refresh()
            assert len(unpairable()) == 2  # unchanged: not logged again

            probe.up["d:1"] = dataclasses.replace(_identity(Role.DECODE), block_size=16)
            await discovery.refresh()
            assert len(unpairable()) == 2 and "decode worker d:1 can pair again" in caplog.text
            assert policy.has_healthy_pair()

            probe.up["d:1"] = dataclasses.replace(_identity(Role.DECODE), block_size=48)
            await discovery.refresh()
            assert len(unpairable()) == 4  # unpairable again: logged again

            probe.up.pop("d:1")  # down: logged as down, never as "can pair again"
            await discovery.refresh()
            assert len(unpairable()) == 4 and caplog.text.count("can pair again") == 2

    asyncio.run(scenario())


def test_a_wildcard_listener_advertises_this_machines_address() -> None:
    """0.0.0.0 names no machine: a worker listening there advertises what its hostname resolves to (its
    container's or pod's IP); a concrete listen address is advertised as it is."""
    import socket

    from services.common.addresses import advertised_host

    assert advertised_host("10.1.2.3") == "10.1.2.3"
    for wildcard in ("0.0.0.0", "::"):
        assert advertised_host(wildcard) == socket.gethostbyname(socket.gethostname())


class RecordingSubscriptions:
    """Stands in for ``KVSubscriptions``: records what discovery asks it to subscribe to."""

    def __init__(self) -> None:
        self.synced: list[list[tuple[Role, str]]] = []
        self.closed = False

    def sync(self, workers) -> None:
        self.synced.append(sorted(workers))

    async def close(self) -> None:
        self.closed = True


def test_kv_event_subscriptions_follow_the_listed_workers_each_round() -> None:
    async def scenario() -> None:
        answers = {"decode.svc:7": ["10.0.0.1:7", "10.0.0.2:7"]}

        async def resolver(entry: str) -> list[str]:
            return answers[entry]

        subscriptions, clock = RecordingSubscriptions(), FakeClock()
        discovery = Discovery(PairingPolicy(), [EndpointSource(Role.PREFILL, static=("p:1",)),
                                                EndpointSource(Role.DECODE, dns=("decode.svc:7",))],
                              ScriptedProbe(), dns_refresh_s=10, resolver=resolver, clock=clock,
                              kv_subscriptions=subscriptions)
        await discovery.refresh()  # every listed worker, answering or not (the subscriber retries)
        assert subscriptions.synced[-1] == [(Role.DECODE, "10.0.0.1:7"), (Role.DECODE, "10.0.0.2:7"),
                                            (Role.PREFILL, "p:1")]
        answers["decode.svc:7"] = ["10.0.0.2:7"]
        clock.now = 10
        await discovery.refresh()  # a removed worker is unsubscribed in the same round
        assert subscriptions.synced[-1] == [(Role.DECODE, "10.0.0.2:7"), (Role.PREFILL, "p:1")]
        await discovery.close()
        assert subscriptions.closed

    asyncio.run(scenario())


def test_a_busy_worker_late_with_its_probe_stays_in_until_timeouts_in_a_row() -> None:
    """A worker with requests outstanding that answers no probe in time (busy with a long prefill) is taken out
    at the third timeout in a row, not the first; an answer in between starts the count again; a refused probe
    takes it out at once."""
    async def scenario() -> None:
        policy, probe = PairingPolicy(), ScriptedProbe()
        sources = [EndpointSource(Role.PREFILL, static=("p:1",)), EndpointSource(Role.DECODE, static=("d:1",))]
        discovery = Discovery(policy, sources, probe, health_timeout_s=0.05, busy_timeouts_down=3)
        probe.up = {"p:1": _identity(Role.PREFILL), "d:1": _identity(Role.DECODE)}
        await discovery.refresh()
        policy.get(Role.DECODE, "d:1").outstanding_requests = 2

        probe.hang.add("d:1")
        for _ in range(2):
            await discovery.refresh()
            assert _states(policy)["d:1"]
        probe.hang.clear()
        await discovery.refresh()  # answered: the count starts again
        probe.hang.add("d:1")
        for _ in range(2):
            await discovery.refresh()
            assert _states(policy)["d:1"]
        await discovery.refresh()
        assert not _states(policy)["d:1"] and "within" in policy.get(Role.DECODE, "d:1").last_error

        probe.hang.clear()
        await discovery.refresh()
        assert _states(policy)["d:1"]
        probe.up.pop("d:1")  # refused, not late: out at once, busy or not
        await discovery.refresh()
        assert not _states(policy)["d:1"]

    asyncio.run(scenario())
