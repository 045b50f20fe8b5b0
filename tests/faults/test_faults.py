"""Faults injected into real router, prefill and decode processes under load; nothing may be lost.

Each test prints (in the run's summary) requests sent, completed with the fault-free output, failed
cleanly, aborted by the client, lost (must be 0) and KV blocks left pinned or used (must be 0).
"""

from __future__ import annotations

import functools
import os
import random
import signal
import threading
import time

import grpc
import httpx
import pytest

from services.launch.spawn import spawn_daemon, wait_ready
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import PREFILL_ARGS, info, metric_total, stack
from tests.faults.harness import (
    FaultReport,
    abort_before_headers,
    prompts,
    record,
    references,
    run_load,
    run_request,
)

NUM_BLOCKS = 512  # the stack's --num-kv-blocks
MAX_TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return str(directory)


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


def _wait_paired(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/health", timeout=5).json().get("status") == "ok":
            return
        time.sleep(0.2)
    raise AssertionError("the router did not pair the workers again")


def test_prefill_killed_mid_stream_then_restarted_on_its_port(model: str) -> None:
    """In-flight requests finish on the decode worker (pulled already, or prefilled there); the worker comes
    back on the same port with a new epoch and fresh NIXL metadata, and pairs again."""
    with stack(model, 1, 1) as s:
        pool = prompts(8, seed=1)
        refs = references(s.url, pool, MAX_TOKENS)
        prefill = s.prefill[0]
        report = FaultReport("kill -9 prefill mid-stream, restart same port")
        run_load(report, _jobs(s.url, pool, refs, 24, _fire_once(threading.Event(), prefill.kill)), concurrency=8)
        assert prefill.proc.poll() is not None
        old_epoch_id = prefill.engine_id
        restarted = wait_ready(spawn_daemon("prefill", model, *PREFILL_ARGS, "--port", str(prefill.port)))
        try:
            assert restarted.port == prefill.port and restarted.engine_id == old_epoch_id
            _wait_paired(s.url)
            pulled = metric_total(s.decode[0], "pdserve_kv_transfer_bytes_total")
            run_load(report, _jobs(s.url, pool, refs, 8), concurrency=4)
            # Served disaggregated again: the decode worker pulled from the new process (re-handshaked).
            assert metric_total(s.decode[0], "pdserve_kv_transfer_bytes_total") > pulled
            record(report, [restarted, *s.decode], NUM_BLOCKS)
        finally:
            restarted.kill()


def test_decode_killed_mid_stream_under_load(model: str) -> None:
    """Requests on the killed worker end with an error event; the rest complete; the prefill worker frees
    the blocks the dead worker would have pulled."""
    with stack(model, 1, 2) as s:
        pool = prompts(8, seed=2)
        refs = references(s.url, pool, MAX_TOKENS)
        victim = s.decode[0]
        report = FaultReport("kill -9 decode mid-stream")
        run_load(report, _jobs(s.url, pool, refs, 24, _fire_once(threading.Event(), victim.kill)), concurrency=8)
        assert report.failed_cleanly > 0  # the victim was serving some
        run_load(report, _jobs(s.url, pool, refs, 8), concurrency=4)  # the survivor serves what comes next
        record(report, [*s.prefill, s.decode[1]], NUM_BLOCKS)


def test_stalled_decode_worker(model: str) -> None:
    """A frozen decode worker (SIGSTOP): requests end by the router's deadline with an error, never hang;
    once it thaws, the aborts it missed free everything."""
    with stack(model, 1, 1, "--request-timeout-s", "4") as s:
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
        record(report, [*s.prefill, decode], NUM_BLOCKS)


def test_lease_expiry_frees_blocks_nobody_pulls(model: str) -> None:
    """Prefills whose tickets are never used (their router died after the answer): the lease frees them."""
    with stack(model, 1, 1, prefill_args=(*PREFILL_ARGS, "--kv-lease-s", "1")) as s:
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
        record(report, [prefill, *s.decode], NUM_BLOCKS)
        assert metric_total(prefill, "pdserve_kv_lease_expiries_total") == 5


def test_thousand_requests_with_random_client_aborts(model: str) -> None:
    with stack(model, 1, 1) as s:
        pool = prompts(20, seed=5, low=6, high=24)
        refs = references(s.url, pool, 16)
        rng = random.Random(6)
        jobs = []
        for i in range(1000):
            prompt, ref, max_tokens = pool[i % 20], refs[i % 20], rng.randrange(4, 17)
            mode = rng.random()
            if mode < 0.2:
                jobs.append(functools.partial(abort_before_headers, s.url, prompt, max_tokens))
            elif mode < 0.5:
                jobs.append(functools.partial(run_request, s.url, prompt, max_tokens, ref[:max_tokens],
                                              abort_after=rng.randrange(0, 4)))
            else:
                jobs.append(functools.partial(run_request, s.url, prompt, max_tokens, ref[:max_tokens]))
        report = FaultReport("1000 requests, random client aborts")
        run_load(report, jobs, concurrency=32)
        assert report.completed > 400
        record(report, [*s.prefill, *s.decode], NUM_BLOCKS)
