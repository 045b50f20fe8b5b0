"""Faults injected into real router, prefill and decode processes under load; nothing may be lost.

Each test prints (in the run's summary) requests sent, completed with the fault-free output, failed
cleanly, aborted by the client (and how many of those a worker got mid-request, where measured), lost
(must be 0), KV blocks left pinned or used (must be 0) and the prefill workers' lease expiries.

Where no lease should fire, the prefill workers get a lease longer than the whole test
(``harness.LONG_LEASE_S``) and the expiries must stay 0: a ticket nobody released stays pinned and
fails the settle instead of being freed by the lease while the test waits.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import threading
import time

import grpc
import pytest

from services.launch.spawn import Daemon, spawn_daemon, wait_ready
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.stack import Stack, http_get, info, metric_total, stack
from tests.faults.harness import (
    SETTLE_S,
    FaultReport,
    abort_before_headers,
    prefill_args,
    prompts,
    record,
    references,
    router_metric_total,
    run_load,
    run_request,
)

NUM_BLOCKS = 512  # the stack's --num-kv-blocks
MAX_TOKENS = 32
# The lease where an expiry can be legitimate (a reader killed mid-READ): well past a pull's usual time,
# well inside the settle wait, so such a ticket is freed before the settle gives up.
SHORT_LEASE_S = 10.0
assert SHORT_LEASE_S < SETTLE_S / 2

pytestmark = pytest.mark.slow


def _fire_once(event: threading.Event, action) -> functools.partial:
    """An on-event callback that runs ``action`` once, the first time any request streams a token."""
    lock = threading.Lock()

    def on_event(_: int) -> None:
        with lock:
            if not event.is_set():
                event.set()
                action()

    return on_event


def _jobs(url: str, pool: list[list[int]], refs: list[list[int]], count: int, on_event=None) -> list:
    return [functools.partial(run_request, url, pool[i % len(pool)], MAX_TOKENS, refs[i % len(refs)], on_event)
            for i in range(count)]


def _routes(s: Stack) -> dict[str, float]:
    """The router's pdserve_router_routed_requests_total by route."""
    return {route: router_metric_total(s.router, "pdserve_router_routed_requests_total", f'route="{route}"')
            for route in ("disaggregated", "direct", "fallback")}


# The decode worker's successful pulls: bytes, and one transfer-duration observation per pull.
PULLS = ("pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_seconds_count")
# What the decode worker counts about failed pulls: none may move while a healthy prefill worker serves.
PULL_TROUBLE = ("pdserve_kv_handshake_failures_total", "pdserve_kv_transfer_failures_total",
                "pdserve_local_recompute_fallbacks_total")


def _counters(worker: Daemon, names: tuple[str, ...]) -> dict[str, float]:
    return {name: metric_total(worker, name) for name in names}


def _wait_paired(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if http_get(f"{url}/health", timeout=5).json().get("status") == "ok":
            return
        time.sleep(0.2)
    raise AssertionError("the router did not pair the workers again")


def test_prefill_killed_mid_stream_then_restarted_on_its_port(model: str) -> None:
    """In-flight requests finish on the decode worker (pulled already, or prefilled there); the worker comes
    back on the same port with a new epoch and fresh NIXL metadata, and pairs again."""
    with stack(model, 1, 1, prefill_args=prefill_args()) as s:
        pool = prompts(8, seed=1)
        refs = references(s.url, pool, MAX_TOKENS)
        prefill, decode = s.prefill[0], s.decode[0]
        old_epoch = info(prefill).epoch
        routes, recomputes = _routes(s), metric_total(decode, "pdserve_local_recompute_fallbacks_total")
        report = FaultReport("kill -9 prefill mid-stream, restart same port")
        run_load(report, _jobs(s.url, pool, refs, 24, _fire_once(threading.Event(), prefill.kill)), concurrency=8)
        assert prefill.proc.poll() is not None
        assert report.completed == report.sent, report  # every in-flight request finished on the decode worker
        # ...through the fallback: a request whose Prefill RPC the dead worker failed went to the decode worker
        # without a ticket (route "fallback"); one whose ticket could no longer be pulled was prefilled there (a
        # local recompute). Which of the two a kill hits depends on timing, so at least one of them must move.
        fallbacks = _routes(s)["fallback"] - routes["fallback"]
        recomputed = metric_total(decode, "pdserve_local_recompute_fallbacks_total") - recomputes
        assert fallbacks + recomputed > 0, "the prefill worker died mid-stream, yet no request fell back"
        restarted = wait_ready(spawn_daemon("prefill", model, *prefill_args(), "--port", str(prefill.port)))
        try:
            # Same port and engine id, new epoch (the key under which the decode worker caches its metadata).
            assert restarted.port == prefill.port and restarted.engine_id == prefill.engine_id
            new_epoch = info(restarted).epoch
            assert new_epoch != old_epoch, f"the restarted prefill worker kept epoch {old_epoch}"
            _wait_paired(s.url)
            pulls, trouble, routes = _counters(decode, PULLS), _counters(decode, PULL_TROUBLE), _routes(s)
            run_load(report, _jobs(s.url, pool, refs, 8), concurrency=4)
            # Served disaggregated again, by the new epoch: every request took a ticket from the restarted worker
            # (the old process is gone) and the decode worker pulled each (handshaking with the new epoch), with
            # no handshake or transfer failure and no local recompute on the way: nothing stale was tried.
            routes_after, pulls_after = _routes(s), _counters(decode, PULLS)
            assert routes_after["disaggregated"] - routes["disaggregated"] == 8, (routes, routes_after)
            # (at least: a router's pair probe, one real transfer per new epoch, counts as a pull too)
            assert pulls_after["pdserve_kv_transfer_seconds_count"] - pulls["pdserve_kv_transfer_seconds_count"] >= 8
            assert pulls_after["pdserve_kv_transfer_bytes_total"] > pulls["pdserve_kv_transfer_bytes_total"]
            assert _counters(decode, PULL_TROUBLE) == trouble
            # The restarted worker's leases: every ticket it handed out was pulled, so none may expire (the
            # killed worker's tickets died with it; there is no surviving prefill worker to hold them).
            record(report, [*s.prefill, restarted, *s.decode], NUM_BLOCKS, killed=[prefill])
        finally:
            restarted.kill()


def test_decode_killed_mid_stream_under_load(model: str) -> None:
    """Requests on the killed worker fail over to the other decode worker and complete with the fault-free
    tokens (the router replays prompt plus output so far there); the prefill worker frees the blocks the dead
    worker would have pulled."""
    # A ticket whose reader was killed mid-READ never gets its notification; the router releases it when the
    # reader's stream fails, but the lease freeing it is legitimate here (that is what the lease is for).
    # So this stack's lease is shorter than the settle wait, and what must hold instead of "no expiry" is
    # that only such tickets expired: at most one per request the dead worker failed. A missing release of
    # the tickets the surviving worker pulled would expire every one of those, far past that bound.
    with stack(model, 1, 2, prefill_args=prefill_args(SHORT_LEASE_S)) as s:
        pool = prompts(8, seed=2)
        refs = references(s.url, pool, MAX_TOKENS)
        victim = s.decode[0]
        failovers = router_metric_total(s.router, "pdserve_router_decode_failovers_total")
        report = FaultReport("kill -9 decode mid-stream")
        run_load(report, _jobs(s.url, pool, refs, 24, _fire_once(threading.Event(), victim.kill)), concurrency=8)
        moved = router_metric_total(s.router, "pdserve_router_decode_failovers_total") - failovers
        assert report.completed == report.sent, report  # the victim's requests went on at the survivor
        assert moved > 0, "the victim was serving requests, yet none failed over"
        run_load(report, _jobs(s.url, pool, refs, 8), concurrency=4)  # the survivor serves what comes next
        record(report, [*s.prefill, *s.decode], NUM_BLOCKS, killed=[victim], max_lease_expiries=int(moved))


def test_stalled_decode_worker(model: str) -> None:
    """A frozen decode worker (SIGSTOP): requests end by the router's deadline with an error, never hang;
    once it thaws, the aborts it missed free everything."""
    with stack(model, 1, 1, "--request-timeout-s", "4", prefill_args=prefill_args()) as s:
        pool = prompts(4, seed=3)
        refs = references(s.url, pool, MAX_TOKENS)
        decode = s.decode[0]
        report = FaultReport("decode worker stalled (SIGSTOP) past the deadline")

        def stall() -> None:
            os.kill(decode.proc.pid, signal.SIGSTOP)

        started = time.monotonic()
        run_load(report, _jobs(s.url, pool, refs, 8, _fire_once(threading.Event(), stall)), concurrency=8)
        assert time.monotonic() - started < 30  # nothing waited for the frozen worker past the deadline
        assert report.failed_cleanly > 0
        os.kill(decode.proc.pid, signal.SIGCONT)
        _wait_paired(s.url)
        run_load(report, _jobs(s.url, pool, refs, 4), concurrency=4)
        # The router released every ticket the frozen worker would have pulled (its requests were cut at the
        # deadline): with a lease longer than the test, nothing may have been left to it.
        record(report, [*s.prefill, decode], NUM_BLOCKS)


def test_lease_expiry_frees_blocks_nobody_pulls(model: str) -> None:
    """Prefills whose tickets are never used (their router died after the answer): the lease frees them."""
    # 3 s: short, yet past the second before a lease's end in which decode workers refuse a ticket (the router's
    # pair probe, which must pull, runs under this lease too).
    with stack(model, 1, 1, prefill_args=prefill_args(3)) as s:
        prefill = s.prefill[0]
        report = FaultReport("lease expiry (tickets never pulled)")
        with grpc.insecure_channel(prefill.address) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            params = worker_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            for i, prompt in enumerate(prompts(5, seed=4)):
                answer = stub.Prefill(worker_pb2.PrefillRequest(request_id=f"orphan-{i}", prompt_token_ids=prompt,
                                                                params=params, reader_tp_size=1), timeout=30)
                report.add("completed" if answer.HasField("ticket") else "lost")
        assert info(prefill).kv_blocks_pinned > 0
        record(report, [prefill, *s.decode], NUM_BLOCKS, max_lease_expiries=5)
        assert report.lease_expiries == 5


def _decode_streams_cut(decode: Daemon) -> int:
    """Generate streams the decode worker began (its first token out: TTFT observed) and never finished:
    requests it was still generating when their abort reached it (with no fault injected, nothing else
    cuts a stream; read it once the worker settled)."""
    return int(metric_total(decode, "pdserve_time_to_first_token_seconds_count")
               - metric_total(decode, "pdserve_requests_total", 'outcome="finished"'))


ABORT_REQUESTS = 1000
ABORT_MIN_TOKENS, ABORT_MAX_TOKENS = 32, 64


def test_thousand_requests_with_random_client_aborts(model: str) -> None:
    """1000 requests, half of them aborted by their client: 5% hang up before any answer, 5% right after the
    first token, 40% mid-stream (after 2 to 11 events); every output is 32 to 64 tokens long, so those land
    while the decode worker is still generating, and it must free everything they held.

    How many aborts reached a worker mid-request is measured on the decode worker: streams it began but
    never finished. That undercounts: a hang-up before the headers or right after the first token is caught
    by the router while the prefill runs or before the pull is done (pdserve_router_client_disconnects_total
    counts it; no worker metric does), which is why those two are the smaller shares. The streams the decode
    worker saw cut must still be a clear majority (two in three) of all client aborts; with outputs of at
    most 16 tokens most aborts came after the request had finished on the workers.
    """
    with stack(model, 1, 1, prefill_args=prefill_args()) as s:
        pool = prompts(20, seed=5, low=6, high=24)
        refs = references(s.url, pool, ABORT_MAX_TOKENS)
        decode = s.decode[0]
        cut = _decode_streams_cut(decode)
        disconnects = router_metric_total(s.router, "pdserve_router_client_disconnects_total")
        rng = random.Random(6)
        jobs = []
        for i in range(ABORT_REQUESTS):
            prompt, ref = pool[i % 20], refs[i % 20]
            max_tokens = rng.randrange(ABORT_MIN_TOKENS, ABORT_MAX_TOKENS + 1)
            mode = rng.random()
            if mode < 0.05:
                jobs.append(functools.partial(abort_before_headers, s.url, prompt, max_tokens))
            elif mode < 0.5:
                abort_after = 0 if mode < 0.1 else rng.randrange(2, 12)  # 0: with the headers and first token
                jobs.append(functools.partial(run_request, s.url, prompt, max_tokens, ref[:max_tokens],
                                              abort_after=abort_after))
            else:
                jobs.append(functools.partial(run_request, s.url, prompt, max_tokens, ref[:max_tokens]))
        report = FaultReport(f"{ABORT_REQUESTS} requests, random client aborts")
        run_load(report, jobs, concurrency=32)
        record(report, [*s.prefill, *s.decode], NUM_BLOCKS)
        report.aborts_at_worker = _decode_streams_cut(decode) - cut
        assert report.completed > 400 and report.failed_cleanly == 0, report
        noticed = router_metric_total(s.router, "pdserve_router_client_disconnects_total") - disconnects
        assert report.aborts_at_worker >= 2 / 3 * report.aborted_by_client, \
            (f"only {report.aborts_at_worker} of {report.aborted_by_client} client aborts cut a decode stream "
             f"(the router noticed {noticed:g})", report)
