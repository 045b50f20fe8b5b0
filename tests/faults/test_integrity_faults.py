"""Faults against the integrity of disaggregated serving: corrupted KV and strict disaggregation.

- ``PDSERVE_FAULT_INJECT=kv_corrupt`` (the decode worker flips bits in every pulled block after its
  READ): with the KV digest on, every answer still equals the fault-free one (each pull fails its
  check and the prompt is recomputed, counted); with ``--no-kv-digest`` on both workers the same
  corruption reaches the answers, which shows the first case really had something to catch.
- ``--enforce-disagg`` with the prefill worker killed: requests fail cleanly (502 or an error event,
  then 503 once the router saw it die) and the decode worker recomputes nothing.
- A pair whose start-up probe fails (its decode worker corrupts every pull, the probe's too) is never
  used: the load is served by the healthy pair, with the fault-free answers.

Rows go into the fault suite's table (tests/faults/conftest.py).
"""

from __future__ import annotations

import functools
import threading

import pytest

from services.launch.spawn import spawn_daemon, start_router, terminate_all, wait_all_ready
from tests.checkpoints import colocated_tokens
from tests.e2e.stack import DECODE_ARGS, metric_total, stack
from tests.faults.harness import (
    REPORTS,
    FaultReport,
    prefill_args,
    prompts,
    record,
    router_metric_total,
    run_load,
    run_request,
    settle,
)

NUM_BLOCKS = 512  # the stack's --num-kv-blocks
MAX_TOKENS = 16

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(model: str) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and their fault-free answers (one engine, colocated: what disaggregated serving must equal)."""
    prompt_pool = prompts(6, seed=21, low=20, high=40)
    return prompt_pool, [colocated_tokens(model, p, MAX_TOKENS) for p in prompt_pool]


def _jobs(url: str, pool, count: int, on_event=None) -> list:
    prompt_pool, refs = pool
    return [functools.partial(run_request, url, prompt_pool[i % len(prompt_pool)], MAX_TOKENS,
                              refs[i % len(refs)], on_event) for i in range(count)]


def test_corrupted_kv_is_caught_by_the_digest_and_recomputed(model: str, pool, monkeypatch) -> None:
    # The workers inherit it; the decode worker acts, sparing its first pull (the pair's start-up probe, which
    # would otherwise keep the pair from ever being used: that case is the probe-failure row).
    monkeypatch.setenv("PDSERVE_FAULT_INJECT", "kv_corrupt:1")
    with stack(model, 1, 1, prefill_args=prefill_args()) as s:
        decode = s.decode[0]
        report = FaultReport("kv_corrupt, digest on (every pull caught)")
        run_load(report, _jobs(s.url, pool, 12), concurrency=4)
        assert report.completed == report.sent, report  # every answer equals the fault-free one
        # Each request's pull failed its digest (one KV group: one failure each) and was recomputed; none was
        # served from the corrupted blocks, and they were dropped (nothing left used or pinned, see record).
        assert metric_total(decode, "pdserve_kv_integrity_failures_total", 'group="0"') == report.sent
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == report.sent
        assert router_metric_total(s.router, "pdserve_router_routed_requests_total", 'route="fallback"') == \
            report.sent  # and the router says so
        record(report, [*s.prefill, *s.decode], NUM_BLOCKS)


def test_without_the_digest_the_same_corruption_reaches_the_answers(model: str, pool, monkeypatch) -> None:
    """The sensitivity check: the injection is strong enough to change outputs, so the row above passing
    means the digest caught it, not that nothing happened."""
    monkeypatch.setenv("PDSERVE_FAULT_INJECT", "kv_corrupt")
    off = ("--no-kv-digest",)
    with stack(model, 1, 1, prefill_args=(*prefill_args(), *off), decode_args=(*DECODE_ARGS, *off)) as s:
        decode = s.decode[0]
        report = FaultReport("kv_corrupt, --no-kv-digest (wrong answers expected)")
        run_load(report, _jobs(s.url, pool, 6), concurrency=3)
        # Served from the corrupted KV: pulled, nothing recomputed, no check failed, and the answers differ.
        assert metric_total(decode, "pdserve_kv_transfer_bytes_total") > 0
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0
        assert metric_total(decode, "pdserve_kv_integrity_failures_total") == 0
        assert report.lost > report.sent // 2, ("the injected corruption left most answers unchanged", report)
        report.blocks_pinned, requests_left = settle([*s.prefill, *s.decode], NUM_BLOCKS)
        REPORTS.append(report)
        assert report.blocks_pinned == 0 and requests_left == 0, report


def test_enforce_disagg_with_the_prefill_worker_killed(model: str, pool) -> None:
    """Strict: requests in flight when the prefill worker dies complete (already pulled) or fail cleanly;
    once the router has seen it die, every request is a clean 503; the decode worker recomputes nothing."""
    with stack(model, 1, 1, "--enforce-disagg", prefill_args=prefill_args()) as s:
        prefill, decode = s.prefill[0], s.decode[0]
        report = FaultReport("--enforce-disagg, kill -9 prefill mid-stream")
        killed = threading.Event()

        def kill_once(_: int) -> None:
            if not killed.is_set():
                killed.set()
                prefill.kill()

        run_load(report, _jobs(s.url, pool, 12, kill_once), concurrency=4)
        assert prefill.proc.poll() is not None
        assert report.failed_cleanly > 0 and report.completed + report.failed_cleanly == report.sent, report
        run_load(report, _jobs(s.url, pool, 6), concurrency=3)  # the router knows by now: no partner
        assert report.lost == 0 and report.failed_cleanly >= 6, report
        refused = router_metric_total(s.router, "pdserve_router_requests_total", 'status="503"')
        assert refused >= 6, refused
        assert metric_total(decode, "pdserve_local_recompute_fallbacks_total") == 0  # never prefilled here
        record(report, [*s.prefill, *s.decode], NUM_BLOCKS, killed=[prefill])


def test_a_pair_that_fails_its_probe_is_never_used(model: str, pool, monkeypatch) -> None:
    with monkeypatch.context() as env:  # each daemon takes the environment it is spawned with
        env.delenv("PDSERVE_FAULT_INJECT", raising=False)
        starting = [spawn_daemon("prefill", model, *prefill_args()), spawn_daemon("decode", model, *DECODE_ARGS)]
        env.setenv("PDSERVE_FAULT_INJECT", "kv_corrupt")  # every pull fails its digest, the probe's first
        starting.append(spawn_daemon("decode", model, *DECODE_ARGS))
    routers = []
    try:
        prefill, healthy, corrupting = workers = wait_all_ready(starting)
        router = start_router(model, [prefill.address], [healthy.address, corrupting.address])
        routers.append(router.proc)
        report = FaultReport("pair probe fails (decode corrupts every pull)")
        run_load(report, _jobs(router.url, pool, 12), concurrency=4)
        assert report.completed == report.sent, report
        # The failing pair took no request; its probe's failure was a digest mismatch, counted.
        assert metric_total(corrupting, "pdserve_requests_total", 'outcome="finished"') == 0
        assert metric_total(corrupting, "pdserve_kv_integrity_failures_total") > 0
        assert metric_total(healthy, "pdserve_requests_total", 'outcome="finished"') == report.sent
        assert router_metric_total(router, "pdserve_router_pairs", 'state="failed"') == 1
        record(report, workers, NUM_BLOCKS)
    finally:
        terminate_all(routers)
        terminate_all([s.proc for s in starting])
