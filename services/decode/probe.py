"""The start-up probe: one real KV transfer from a prefill worker before the router pairs the two.

Compatibility hashes and TP/block-size rules (``kv.pair_support``) say a pair *should* work; only a
transfer says it does: the cluster token and TLS between the workers, the NIXL path between their
hosts, the ticket's signature, the KV digest. So on the router's ``Probe(prefill_address)`` the decode
worker runs one request's whole path on a short random prompt (a few blocks and a partial one, token
ids inside this engine's vocabulary, greedy, two tokens): it dials the prefill worker as the handshake
client does (cluster token, TLS), calls its ``Prefill``, then reserves, pulls and checks the digest
exactly as ``Generate`` does (``PullPolicy.start`` with the pull required: nothing is ever recomputed
here), and aborts the request, freeing its blocks. The READ's notification unpins the prefill
worker's blocks; if anything fails after ``Prefill`` answered, ``Release`` does.

Results are kept per (prefill engine id, epoch): a success for that epoch's whole life, a failure for
``FAILURE_TTL_S`` (routers retry failed pairs after a back-off, and a transient failure must be able
to clear), so several routers asking about one peer cost one transfer. Concurrent asks share one
transfer, which runs as its own task: a caller that times out leaves it to finish and fill the
cache, so a READ is never cancelled into blocks that were already freed. The pull counts in the
usual pull metrics (bytes, stages; failures as handshake, transfer, ticket or integrity failures),
and each probe transfer in ``pdserve_kv_probes_total{role, result}``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.common.grpc_auth import token_interceptors
from services.common.metrics import WorkerMetrics
from services.common.tls import TLSConfig, open_channel
from services.contract.sampling_params import SamplingParams
from services.contract.wire import sampling_to_proto
from services.decode.pull_policy import DecodeEngine, PullPolicy, PullRequired
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

#: Full blocks of the larger of the two block sizes in the probe prompt; half a block more makes the last partial.
PROBE_FULL_BLOCKS = 2
#: How long a failed probe's result answers repeated asks (shorter than any router's back-off).
FAILURE_TTL_S = 5.0
#: At most this long waiting for KV room for the probe (a busy decode worker fails it; the router retries).
PROBE_RESERVE_S = 5.0
#: Greedy and two tokens: the prefill worker hands out a ticket (its first token is not the last).
PROBE_PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class ProbeResult:
    """One probe's answer: ok, or why not; the prefill engine and epoch it is for."""

    ok: bool
    reason: str = ""
    engine_id: str = ""
    epoch: int = 0
    seconds: float = 0.0

    def to_proto(self) -> worker_pb2.ProbeResponse:
        return worker_pb2.ProbeResponse(ok=self.ok, reason=self.reason, prefill_engine_id=self.engine_id,
                                        prefill_epoch=self.epoch, seconds=self.seconds)


def probe_prompt(rng: random.Random, vocab_size: int, block_size: int, max_len: int) -> list[int]:
    """``PROBE_FULL_BLOCKS`` blocks and half of one more of random ids in ``[0, vocab_size)``; shorter
    when the context (``max_len``, already less the tokens to generate) is."""
    length = max(1, min(PROBE_FULL_BLOCKS * block_size + max(block_size // 2, 1), max_len))
    return [rng.randrange(vocab_size) for _ in range(length)]


class PairProber:
    """Runs and remembers probe transfers from prefill workers into this decode engine."""

    def __init__(self, engine: DecodeEngine, policy: PullPolicy, metrics: WorkerMetrics, *, block_size: int,
                 tp_size: int, vocab_size: int, max_model_len: int, auth_token: str | None = None,
                 tls: TLSConfig | None = None, timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``policy``: a pull policy over the engine and the puller requests use (its peer cache is the
        one the probe fills), with a short reserve timeout; ``timeout_s`` bounds each RPC of a probe."""
        self.engine = engine
        self.policy = policy
        self.metrics = metrics
        self.block_size = block_size
        self.tp_size = tp_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.timeout_s = timeout_s
        self._tls = tls
        self._interceptors = token_interceptors(auth_token) if auth_token else None
        self._clock = clock
        self._rng = random.Random()
        self._ok: dict[tuple[str, int], ProbeResult] = {}
        self._failed: dict[tuple[str, int], tuple[ProbeResult, float]] = {}
        self._running: dict[tuple[str, int], asyncio.Task[ProbeResult]] = {}

    async def probe(self, address: str, timeout_s: float | None = None) -> ProbeResult:
        """The probe result for the prefill worker at ``address`` now: cached for its current epoch, or
        from a transfer (shared with concurrent asks); a failure when nothing answered in ``timeout_s``."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                peer = await self._info(address, timeout_s)
                if isinstance(peer, ProbeResult):
                    return peer
                key = (peer.engine_id, peer.epoch)
                cached = self._cached(key)
                if cached is not None:
                    return cached
                task = self._running.get(key)
                if task is None:
                    task = self._running[key] = asyncio.create_task(self._transfer(address, peer),
                                                                    name=f"pdserve-kv-probe-{address}")
                    task.add_done_callback(lambda done: self._remember(key, done))
                return await asyncio.shield(task)
        except TimeoutError:
            return ProbeResult(False, f"no probe result within {timeout_s:g} s (the transfer goes on; ask again)",
                               seconds=time.perf_counter() - started)

    def _cached(self, key: tuple[str, int]) -> ProbeResult | None:
        if key in self._ok:
            return self._ok[key]
        failed = self._failed.get(key)
        if failed is not None and self._clock() < failed[1] + FAILURE_TTL_S:
            return failed[0]
        return None

    def _remember(self, key: tuple[str, int], task: asyncio.Task[ProbeResult]) -> None:
        self._running.pop(key, None)
        if task.cancelled() or task.exception() is not None:
            return
        result = task.result()
        for cache in (self._ok, self._failed):  # one epoch per engine: the one probed last
            for old in [k for k in cache if k[0] == key[0]]:
                del cache[old]
        if result.ok:
            self._ok[key] = result
        else:
            self._failed[key] = (result, self._clock())

    def _dial(self, address: str) -> grpc.aio.Channel:
        """A channel to the prefill worker as the handshake client opens one: TLS and the cluster token."""
        return open_channel(address, self._tls, interceptors=self._interceptors)

    async def _info(self, address: str, timeout_s: float) -> worker_pb2.WorkerInfo | ProbeResult:
        """The prefill worker's identity (its engine id and epoch key the cache), or a failed result."""
        async with self._dial(address) as channel:
            try:
                info = await worker_pb2_grpc.PrefillWorkerStub(channel).Info(worker_pb2.InfoRequest(),
                                                                             timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                return self._count(ProbeResult(False, f"the prefill worker at {address} did not answer Info: "
                                                      f"{e.code().name}: {e.details()}"))
        if info.role != "prefill":
            return self._count(ProbeResult(False, f"{address} is a {info.role or 'unknown'} worker, not a prefill "
                                                  "worker", info.engine_id, info.epoch))
        return info

    async def _transfer(self, address: str, peer: worker_pb2.WorkerInfo) -> ProbeResult:
        """Prefill a probe prompt there, pull it here (reserve, handshake, READ, digest), drop it."""
        started = time.perf_counter()
        rid = f"probe-{uuid.uuid4().hex}"
        block = max(self.block_size, peer.block_size or 1)
        limit = min(self.max_model_len, peer.max_model_len or self.max_model_len) - PROBE_PARAMS.max_tokens - 1
        prompt = probe_prompt(self._rng, self.vocab_size, block, limit)

        def result(ok: bool, reason: str = "") -> ProbeResult:
            return self._count(ProbeResult(ok, reason, peer.engine_id, peer.epoch, time.perf_counter() - started))

        async with self._dial(address) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            request = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                                params=sampling_to_proto(PROBE_PARAMS), reader_tp_size=self.tp_size,
                                                reader_block_size=self.block_size,
                                                # a prefill worker whose KV dtype converts for this one stages for it
                                                reader_compat_hash=getattr(getattr(self.policy.puller, "compat", None),
                                                                           "hash", ""))
            try:
                answer = await stub.Prefill(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                return result(False, f"the prefill worker's Prefill failed: {e.code().name}: {e.details()}")
            if not answer.HasField("ticket"):
                return result(False, "the prefill worker answered the probe prompt without a ticket")
            ticket = answer.ticket
            if (ticket.engine_id, ticket.epoch) != (peer.engine_id, peer.epoch):
                await self._release(stub, rid)
                return result(False, f"the prefill worker changed from {peer.engine_id} epoch {peer.epoch} to "
                                     f"{ticket.engine_id} epoch {ticket.epoch} during the probe")
            try:
                await self.policy.start(rid, prompt, PROBE_PARAMS, ticket, require_pull=True)
            except PullRequired as e:  # the reservation is gone; the blocks there may still be pinned
                await self._release(stub, rid)
                return result(False, e.reason)
            except Exception as e:  # noqa: BLE001 - any failure of the path is the probe's answer
                await self._release(stub, rid)
                return result(False, f"{type(e).__name__}: {e}")
            except BaseException:
                await asyncio.shield(self._release(stub, rid))
                raise
        await self.engine.abort(rid)  # pulled and checked: the probe decodes nothing
        return result(True)

    async def _release(self, stub: worker_pb2_grpc.PrefillWorkerStub, rid: str) -> None:
        """Free the probe's pinned blocks on the prefill worker (a failed probe leaves nothing held)."""
        try:
            await stub.Release(worker_pb2.ReleaseRequest(request_id=rid), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            log.warning("probe %s: Release on the prefill worker failed (%s: %s); its lease frees the blocks",
                        rid, e.code().name, e.details())

    def _count(self, result: ProbeResult) -> ProbeResult:
        self.metrics.kv_probes.labels("decode", "ok" if result.ok else "failed").inc()
        if result.ok:
            log.info("KV probe of prefill engine %s (epoch %d): ok in %.3f s", result.engine_id, result.epoch,
                     result.seconds)
        else:
            log.warning("KV probe of prefill engine %s (epoch %d) failed: %s", result.engine_id or "?",
                        result.epoch, result.reason)
        return result
