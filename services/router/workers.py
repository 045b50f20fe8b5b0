"""The router's only door to the workers: one pooled grpc.aio channel per worker address.

Every RPC the router makes goes through :class:`WorkerPool`, so the request flow and discovery
never build a channel or a stub, and the end-to-end tests exercise exactly these calls against
real worker processes. Channels are created on first use (inside the running event loop) and
closed when discovery drops the address or the app shuts down. Errors are the stubs' own
``grpc.aio.AioRpcError``; :mod:`services.router.errors` turns them into HTTP answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.common.grpc_auth import token_interceptors
from services.common.tls import TLSConfig, open_channel
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from services.router.pair_probes import ProbeOutcome
from services.router.pairing import Role, WorkerIdentity

# Keep idle connections to workers alive through NATs and proxies; notice dead peers quickly.
_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 << 20),
)


def identity_from_info(info: worker_pb2.WorkerInfo) -> WorkerIdentity:
    return WorkerIdentity(
        engine_id=info.engine_id,
        role=info.role,
        compat_hash=info.compat_hash,
        model_name=info.model_name,
        tp_size=info.tp_size or 1,
        block_size=info.block_size or None,
        max_model_len=info.max_model_len or None,
        draining=info.draining,
        epoch=info.epoch,
        compat_fields=dict(info.compat_fields),
        roles=tuple(info.roles),
        switching_to=info.switching_to,
    )


class WorkerPool:
    """Channels and stubs keyed by address, and one method per RPC the router makes."""

    def __init__(self, auth_token: str | None = None, tls: TLSConfig | None = None) -> None:
        """``auth_token``: the workers' cluster token, added to every call (``grpc_auth.token_interceptors``);
        ``tls``: dial the workers over mTLS with the router's certificate."""
        self._tls = tls
        self._interceptors = token_interceptors(auth_token) if auth_token else None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prefill_stubs: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}
        self._decode_stubs: dict[str, worker_pb2_grpc.DecodeWorkerStub] = {}

    @property
    def addresses(self) -> list[str]:
        """Addresses with an open channel."""
        return list(self._channels)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(address, self._tls, options=_CHANNEL_OPTIONS, interceptors=self._interceptors)
            self._channels[address] = channel
        return channel

    def _prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        stub = self._prefill_stubs.get(address)
        if stub is None:
            stub = self._prefill_stubs[address] = worker_pb2_grpc.PrefillWorkerStub(self._channel(address))
        return stub

    def _decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        stub = self._decode_stubs.get(address)
        if stub is None:
            stub = self._decode_stubs[address] = worker_pb2_grpc.DecodeWorkerStub(self._channel(address))
        return stub

    # ---- RPCs ------------------------------------------------------------------------------------

    async def info(self, role: Role, address: str, timeout_s: float) -> WorkerIdentity:
        """The worker's identity and limits; the health check."""
        stub = self._prefill(address) if role == Role.PREFILL else self._decode(address)
        return identity_from_info(await stub.Info(worker_pb2.InfoRequest(), timeout=timeout_s))

    async def prefill(self, address: str, request_id: str, prompt_token_ids: list[int],
                      params: worker_pb2.SamplingParams, reader_tp_size: int,
                      timeout_s: float, reader_block_size: int = 0,
                      reader_compat_hash: str = "") -> worker_pb2.PrefillResponse:
        """Prefill on ``address``; the reader's TP and block size shape the ticket (its notifications, its
        KV digest's unit), its compat hash whether the prefill worker converts its KV dtype for it."""
        request = worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                            params=params, reader_tp_size=reader_tp_size,
                                            reader_block_size=reader_block_size, reader_compat_hash=reader_compat_hash)
        return await self._prefill(address).Prefill(request, timeout=timeout_s)

    def prefill_stream(self, address: str, request_id: str, prompt_token_ids: list[int],
                       params: worker_pb2.SamplingParams, reader_tp_size: int, timeout_s: float,
                       reader_block_size: int = 0, reader_compat_hash: str = "") -> grpc.aio.UnaryStreamCall:
        """Prefill on ``address`` with the KV handed out per chunk: iterate the call for PrefillParts (part
        tickets, then the final answer); ``cancel()`` it to stop."""
        request = worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                            params=params, reader_tp_size=reader_tp_size,
                                            reader_block_size=reader_block_size, reader_compat_hash=reader_compat_hash)
        return self._prefill(address).PrefillStream(request, timeout=timeout_s)

    def generate_parts(self, address: str, request_id: str, prompt_token_ids: list[int],
                       params: worker_pb2.SamplingParams, parts: AsyncIterator[kv_pb2.TransferTicket],
                       timeout_s: float, require_pull: bool = False) -> grpc.aio.StreamStreamCall:
        """Start decoding a request whose KV comes in ``parts`` (sent as they come; ending them before the last
        part, the prefill having failed, makes the worker prefill the prompt itself); read the call for
        TokenChunks as from ``generate``, ``cancel()`` it to stop."""
        start = worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
                                           require_pull=require_pull)

        async def inputs() -> AsyncIterator[worker_pb2.GenerateInput]:
            yield worker_pb2.GenerateInput(start=start)
            async for ticket in parts:
                yield worker_pb2.GenerateInput(part=ticket)

        return self._decode(address).GenerateParts(inputs(), timeout=timeout_s)

    async def release(self, address: str, request_id: str, timeout_s: float) -> bool:
        """Free a request's pinned blocks on the prefill worker; False when it held none."""
        response = await self._prefill(address).Release(worker_pb2.ReleaseRequest(request_id=request_id),
                                                        timeout=timeout_s)
        return response.released

    def generate(self, address: str, request_id: str, prompt_token_ids: list[int],
                 params: worker_pb2.SamplingParams, ticket: kv_pb2.TransferTicket | None,
                 timeout_s: float, require_pull: bool = False, num_output_tokens: int = 0) -> grpc.aio.UnaryStreamCall:
        """Start decoding; iterate the call for TokenChunks, ``cancel()`` it to stop. ``require_pull``: the
        worker fails the call (FAILED_PRECONDITION) rather than recompute a prompt it could not pull.
        ``num_output_tokens``: the prompt ends with that many tokens of the request's output (a migration)."""
        request = worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                             params=params, ticket=ticket, require_pull=require_pull,
                                             num_output_tokens=num_output_tokens)
        return self._decode(address).Generate(request, timeout=timeout_s)

    async def probe(self, prefill: str, decode: str, timeout_s: float) -> ProbeOutcome:
        """Ask the decode worker to pull a probe ticket from the prefill worker. A decode worker without
        the RPC (older) counts as probed (``unprobed``); any other RPC failure is a failed probe."""
        try:
            answer = await self._decode(decode).Probe(worker_pb2.ProbeRequest(prefill_address=prefill),
                                                      timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return ProbeOutcome(True, unprobed=True)
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return ProbeOutcome(False, f"the decode worker's probe gave no answer within {timeout_s:g} s")
            return ProbeOutcome(False, f"the decode worker's Probe RPC failed: {e.code().name}: {e.details()}")
        return ProbeOutcome(answer.ok, answer.reason, answer.prefill_engine_id, answer.prefill_epoch, answer.seconds)

    async def switch_role(self, role: Role, address: str, new_role: Role, drain_timeout_s: float,
                          timeout_s: float) -> worker_pb2.SwitchRoleResponse:
        """Switch the worker (serving ``role`` now) to ``new_role``: it answers once drained and switched."""
        stub = self._prefill(address) if role == Role.PREFILL else self._decode(address)
        request = worker_pb2.SwitchRoleRequest(role=new_role.value, drain_timeout_s=drain_timeout_s)
        return await stub.SwitchRole(request, timeout=timeout_s)

    def kv_events(self, role: Role, address: str) -> grpc.aio.UnaryStreamCall:
        """Subscribe to the worker's KV events (no deadline: the stream lives until cancelled or broken);
        ``read()`` the call for KVEventBatches. UNIMPLEMENTED: a worker that predates it."""
        stub = self._prefill(address) if role == Role.PREFILL else self._decode(address)
        return stub.KVEvents(worker_pb2.KVEventsRequest())

    async def kv_snapshot(self, role: Role, address: str, timeout_s: float) -> worker_pb2.KVSnapshotResponse:
        """Every key the worker's prefix caches hold now, and the event number that reflects."""
        stub = self._prefill(address) if role == Role.PREFILL else self._decode(address)
        return await stub.KVSnapshot(worker_pb2.KVSnapshotRequest(), timeout=timeout_s)

    async def abort(self, role: Role, address: str, request_id: str, timeout_s: float) -> bool:
        stub = self._prefill(address) if role == Role.PREFILL else self._decode(address)
        response = await stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=timeout_s)
        return response.aborted

    # ---- lifetime --------------------------------------------------------------------------------

    async def close(self, address: str) -> None:
        """Close a worker's channel (discovery dropped it); calls in flight on it fail."""
        self._prefill_stubs.pop(address, None)
        self._decode_stubs.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close(grace=1.0)

    async def close_all(self) -> None:
        for address in list(self._channels):
            await self.close(address)
