"""The decode worker's pair probe against a scripted prefill worker (real gRPC) and a fake engine and puller.

What is tested is the probe's own logic: what it asks the prefill worker for, that a pulled probe is
dropped and a failed one released (nothing stays reserved or pinned), caching per prefill epoch (a
failure only briefly), concurrent asks sharing one transfer, a caller's timeout leaving the transfer to
finish, the cluster token on the dial, and the servicer without a prober. Real NIXL transfers between
real daemons are ``tests/integration/test_pair_probe.py``.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.grpc_auth import TokenAuthInterceptor
from services.common.metrics import WorkerMetrics
from services.decode.probe import FAILURE_TTL_S, PairProber, ProbeResult
from services.decode.pull_policy import PullPolicy
from services.kv.reader.errors import KVIntegrityError
from services.kv.spec.description import HandshakeError
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from tests.unit.decode.servicer import decode_stub
from tests.unit.decode.test_decode_pull_policy import FakeEngine, FakePuller

FIRST = 17
VOCAB = 50
TOKEN = "s3cret"


class ScriptedPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Answers Info (engine prefill@a at ``epoch``, blocks of 4) and Prefill with a ticket; records Release."""

    def __init__(self, epoch: int = 1, fail_prefill: bool = False) -> None:
        self.epoch = epoch
        self.fail_prefill = fail_prefill
        self.prefills: list[worker_pb2.PrefillRequest] = []
        self.released: list[str] = []

    async def Info(self, request, context):  # noqa: N802
        return worker_pb2.WorkerInfo(engine_id="prefill@a", role="prefill", epoch=self.epoch, block_size=4,
                                     max_model_len=64)

    async def Prefill(self, request, context):  # noqa: N802
        self.prefills.append(request)
        if self.fail_prefill:
            await context.abort(grpc.StatusCode.INTERNAL, "scripted failure")
        ticket = kv_pb2.TransferTicket(engine_id="prefill@a", epoch=self.epoch, request_id=request.request_id,
                                       num_tokens=len(request.prompt_token_ids), first_token_id=FIRST)
        ticket.groups.add(group_id=0, block_ids=list(range(6)))
        return worker_pb2.PrefillResponse(ticket=ticket, first_token_id=FIRST,
                                          num_prompt_tokens=len(request.prompt_token_ids))

    async def Release(self, request, context):  # noqa: N802
        self.released.append(request.request_id)
        return worker_pb2.ReleaseResponse(released=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _serve(servicer: ScriptedPrefill, token: str | None = None) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[TokenAuthInterceptor(token)] if token else None)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _prober(engine: FakeEngine, puller: FakePuller, token: str | None = None,
            clock: Clock | None = None) -> tuple[PairProber, WorkerMetrics]:
    metrics = WorkerMetrics("decode")
    policy = PullPolicy(engine, puller, metrics, reserve_timeout_s=0.5)
    return PairProber(engine, policy, metrics, block_size=8, tp_size=2, vocab_size=VOCAB, max_model_len=128,
                      auth_token=token, timeout_s=5.0, clock=clock or Clock()), metrics


def _probes(metrics: WorkerMetrics, result: str) -> float:
    value = metrics.registry.get_sample_value("pdserve_kv_probes_total", {"role": "decode", "result": result})
    assert value is not None
    return value


def test_a_probe_prefills_there_pulls_here_and_drops_the_request() -> None:
    async def scenario() -> None:
        prefill, engine, puller = ScriptedPrefill(), FakeEngine(), FakePuller()
        server, address = await _serve(prefill)
        try:
            prober, metrics = _prober(engine, puller)
            result = await prober.probe(address)
            assert (result.ok, result.reason, result.engine_id, result.epoch) == (True, "", "prefill@a", 1)
            (request,) = prefill.prefills
            rid = request.request_id
            assert rid.startswith("probe-") and (request.reader_tp_size, request.reader_block_size) == (2, 8)
            assert (request.params.max_tokens, request.params.temperature, request.params.ignore_eos) == (2, 0, True)
            # Two blocks of the larger block size (8) and half of one more; ids inside the vocabulary.
            assert len(request.prompt_token_ids) == 20 and all(0 <= t < VOCAB for t in request.prompt_token_ids)
            assert engine.reservations == [rid] and puller.pulls[0][0] == rid  # reserved and pulled as a request
            assert engine.aborted == [rid] and engine.added == []  # dropped, never recomputed
            assert prefill.released == []  # the READ's notification frees the prefill worker's blocks
            assert _probes(metrics, "ok") == 1 and _probes(metrics, "failed") == 0
            assert metrics.registry.get_sample_value("pdserve_kv_transfer_bytes_total", {"role": "decode"}) == 4096

            again = await prober.probe(address)  # the same epoch: the cached answer, no transfer
            assert again == result and len(prefill.prefills) == 1 and _probes(metrics, "ok") == 1
            prefill.epoch = 2  # the prefill worker restarted: probed again
            assert (await prober.probe(address)).epoch == 2 and len(prefill.prefills) == 2
        finally:
            await server.stop(0)

    asyncio.run(scenario())


@pytest.mark.parametrize(("error", "words", "counter"), [
    (HandshakeError("handshake with x failed: PERMISSION_DENIED: handshake refused"), "handshake refused",
     "pdserve_kv_handshake_failures_total"),
    (KVIntegrityError("the KV pulled does not match the ticket's digest in KV group(s) [0]", [0]),
     "does not match the ticket's digest", "pdserve_kv_transfer_failures_total"),
], ids=["handshake", "digest"])
def test_a_failed_pull_is_the_answer_and_the_prefill_worker_releases_the_blocks(error, words, counter) -> None:
    async def scenario() -> None:
        prefill, engine, puller, clock = ScriptedPrefill(), FakeEngine(), FakePuller(error), Clock()
        server, address = await _serve(prefill)
        try:
            prober, metrics = _prober(engine, puller, clock=clock)
            result = await prober.probe(address)
            assert not result.ok and words in result.reason and result.engine_id == "prefill@a"
            (request,) = prefill.prefills
            assert prefill.released == [request.request_id]  # nothing stays pinned there
            assert engine.aborted == [request.request_id] and engine.added == [] and engine.completed == []
            assert _probes(metrics, "failed") == 1
            assert metrics.registry.get_sample_value(counter, {"role": "decode"}) == 1
            # A failure answers repeated asks only briefly: then the pair is really probed again.
            assert await prober.probe(address) == result and len(prefill.prefills) == 1
            clock.now = FAILURE_TTL_S
            puller.error = None
            assert (await prober.probe(address)).ok and len(prefill.prefills) == 2
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_a_failed_prefill_is_the_answer_and_nothing_is_reserved() -> None:
    async def scenario() -> None:
        prefill, engine = ScriptedPrefill(fail_prefill=True), FakeEngine()
        server, address = await _serve(prefill)
        try:
            prober, _ = _prober(engine, FakePuller())
            result = await prober.probe(address)
            assert not result.ok and result.reason == "the prefill worker's Prefill failed: INTERNAL: scripted failure"
            assert engine.reservations == []
        finally:
            await server.stop(0)
        gone = await prober.probe(address)  # nothing listens there any more
        assert not gone.ok and "did not answer Info: UNAVAILABLE" in gone.reason

    asyncio.run(scenario())


def test_the_probe_dials_with_the_cluster_token() -> None:
    async def scenario() -> None:
        server, address = await _serve(ScriptedPrefill(), token=TOKEN)
        try:
            without, _ = _prober(FakeEngine(), FakePuller())
            refused = await without.probe(address)
            assert not refused.ok and "UNAUTHENTICATED" in refused.reason
            with_token, _ = _prober(FakeEngine(), FakePuller(), token=TOKEN)
            assert (await with_token.probe(address)).ok
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_concurrent_asks_share_one_transfer_and_a_timeout_leaves_it_to_finish() -> None:
    async def scenario() -> None:
        prefill, engine, gate = ScriptedPrefill(), FakeEngine(), asyncio.Event()
        puller = FakePuller(gate=gate)
        server, address = await _serve(prefill)
        try:
            prober, _ = _prober(engine, puller)
            impatient = await prober.probe(address, timeout_s=0.3)  # the READ is still going
            assert not impatient.ok and "no probe result within 0.3 s" in impatient.reason
            waiting = [asyncio.create_task(prober.probe(address)) for _ in range(3)]
            await asyncio.sleep(0.1)
            gate.set()
            results = await asyncio.gather(*waiting)
            assert all(r.ok for r in results) and len(prefill.prefills) == 1 and len(puller.pulls) == 1
            assert engine.aborted == [prefill.prefills[0].request_id]
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_a_servicer_without_a_prober_answers_unimplemented_and_one_with_it_probes() -> None:
    class FixedProber:
        timeout_s = 5.0

        async def probe(self, address: str, timeout_s: float) -> ProbeResult:
            assert 0 < timeout_s <= 5.0  # within the caller's deadline
            return ProbeResult(False, f"scripted: {address}", "prefill@a", 3, 0.25)

    async def call(prober) -> worker_pb2.ProbeResponse | grpc.StatusCode:
        async with decode_stub(WorkerMetrics("decode"), prober=prober) as stub:
            try:
                return await stub.Probe(worker_pb2.ProbeRequest(prefill_address="p:1"), timeout=3)
            except grpc.aio.AioRpcError as e:
                return e.code()

    assert asyncio.run(call(None)) == grpc.StatusCode.UNIMPLEMENTED
    assert asyncio.run(call(FixedProber())) == worker_pb2.ProbeResponse(
        ok=False, reason="scripted: p:1", prefill_engine_id="prefill@a", prefill_epoch=3, seconds=0.25)
