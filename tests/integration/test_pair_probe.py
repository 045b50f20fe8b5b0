"""A decode daemon's ``Probe`` against real prefill daemons: a real Prefill, handshake, NIXL READ, KV digest.

One prefill worker that a decode worker can pull from, one that wants a cluster token the decode worker
lacks, and a second decode worker with ``PDSERVE_FAULT_INJECT=kv_corrupt`` (every pull it makes fails
its digest check). A probe that works moves bytes and leaves nothing reserved or pinned on either side,
and is answered from the cache for the same prefill epoch; the failing ones say why, in words an
operator can act on, and leave nothing pinned either.
"""

from __future__ import annotations

import time

import grpc
import pytest

from services.common.grpc_auth import METADATA_KEY, bearer
from services.launch.spawn import Daemon, spawn_daemon, terminate_all, wait_all_ready
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import metric_total

TOKEN = "probe-s3cret"
# Prefill and decode differ in KV layout and block size: the probe reconciles both, as a request does.
PREFILL_ARGS = ("--kv-layout", "cross_layer", "--block-size", "4", "--num-kv-blocks", "128", "--kv-lease-s", "60")
DECODE_ARGS = ("--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "64")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("ckpt"))
    return str(directory)


@pytest.fixture(scope="module")
def workers(checkpoint: str):
    """(open prefill, locked prefill, decode, corrupting decode), started together, stopped after."""
    starting = []
    with pytest.MonkeyPatch.context() as patch:  # each daemon takes the environment as it is when spawned
        for name in ("PDSERVE_KV_AUTH_TOKEN", "PDSERVE_FAULT_INJECT"):
            patch.delenv(name, raising=False)
        starting.append(spawn_daemon("prefill", checkpoint, *PREFILL_ARGS))
        starting.append(spawn_daemon("prefill", checkpoint, *PREFILL_ARGS, "--kv-auth-token", TOKEN))
        starting.append(spawn_daemon("decode", checkpoint, *DECODE_ARGS))
        patch.setenv("PDSERVE_FAULT_INJECT", "kv_corrupt")
        starting.append(spawn_daemon("decode", checkpoint, *DECODE_ARGS))
    try:
        yield wait_all_ready(starting)
    finally:
        terminate_all([s.proc for s in starting])


def _probe(decode: Daemon, prefill_address: str) -> worker_pb2.ProbeResponse:
    with grpc.insecure_channel(decode.address) as channel:
        return worker_pb2_grpc.DecodeWorkerStub(channel).Probe(
            worker_pb2.ProbeRequest(prefill_address=prefill_address), timeout=120)


def _info(d: Daemon, token: str | None = None) -> worker_pb2.WorkerInfo:
    metadata = ((METADATA_KEY, bearer(token)),) if token else None
    with grpc.insecure_channel(d.address) as channel:
        stub = (worker_pb2_grpc.PrefillWorkerStub if d.role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)
        return stub.Info(worker_pb2.InfoRequest(), timeout=10, metadata=metadata)


def _settled(d: Daemon, token: str | None = None, timeout_s: float = 10.0) -> worker_pb2.WorkerInfo:
    """The worker's Info once nothing is pinned, running or waiting (or in time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = _info(d, token)
        if not (info.kv_blocks_pinned or info.num_running or info.num_waiting) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def test_a_probe_pulls_for_real_and_is_cached_for_the_epoch(workers) -> None:
    open_prefill, _, decode, _ = workers
    free_before = _info(decode).kv_blocks_free
    answer = _probe(decode, open_prefill.address)
    assert answer.ok, answer.reason
    assert (answer.prefill_engine_id, answer.prefill_epoch) == (open_prefill.engine_id, _info(open_prefill).epoch)
    assert answer.seconds > 0
    # A real pull: bytes read and digested, counted as a pull and as a probe; nothing recomputed or failed.
    assert metric_total(decode, "pdserve_kv_transfer_bytes_total") > 0
    assert metric_total(decode, "pdserve_kv_transfer_seconds_count") == 1
    assert metric_total(decode, "pdserve_kv_probes_total", 'result="ok"') == 1
    for name in ("pdserve_kv_handshake_failures_total", "pdserve_kv_transfer_failures_total",
                 "pdserve_local_recompute_fallbacks_total", "pdserve_kv_integrity_failures_total"):
        assert metric_total(decode, name) == 0, name
    # Nothing left behind: the READ's notification unpinned the prefill worker's blocks, the decode worker
    # dropped the probe's request (its blocks are free again, or held by its prefix cache, counted free).
    assert _settled(open_prefill).kv_blocks_pinned == 0
    after = _settled(decode)
    assert (after.num_running, after.num_waiting, after.kv_blocks_free) == (0, 0, free_before)
    assert metric_total(open_prefill, "pdserve_kv_lease_expiries_total") == 0

    again = _probe(decode, open_prefill.address)  # the same epoch: answered from the cache, no transfer
    assert again.ok and again.prefill_epoch == answer.prefill_epoch
    assert metric_total(decode, "pdserve_kv_transfer_seconds_count") == 1
    assert metric_total(decode, "pdserve_kv_probes_total", 'result="ok"') == 1


def test_a_decode_worker_without_the_cluster_token_fails_its_probe(workers) -> None:
    _, locked_prefill, decode, _ = workers
    answer = _probe(decode, locked_prefill.address)
    assert not answer.ok and "UNAUTHENTICATED" in answer.reason and "cluster token" in answer.reason
    assert _settled(locked_prefill, TOKEN).kv_blocks_pinned == 0  # never got as far as a Prefill


def test_corrupted_kv_fails_the_probe_on_its_digest_and_nothing_stays_pinned(workers) -> None:
    open_prefill, _, _, corrupting = workers
    answer = _probe(corrupting, open_prefill.address)
    assert not answer.ok and "does not match the ticket's digest" in answer.reason, answer.reason
    assert answer.prefill_engine_id == open_prefill.engine_id
    assert metric_total(corrupting, "pdserve_kv_integrity_failures_total", 'group="0"') == 1
    assert metric_total(corrupting, "pdserve_kv_probes_total", 'result="failed"') == 1
    assert metric_total(corrupting, "pdserve_local_recompute_fallbacks_total") == 0  # a probe never recomputes
    assert _settled(open_prefill).kv_blocks_pinned == 0 and _settled(corrupting).num_running == 0
