"""A ``DecodeServicer`` on a real grpc.aio server on 127.0.0.1, for tests that script its policy or prober."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import grpc

from services.common.metrics import WorkerMetrics
from services.decode.server import DecodeServicer
from services.proto_gen.pdserve.v1 import worker_pb2_grpc
from services.worker.grpc_server import InFlight


@asynccontextmanager
async def decode_stub(metrics: WorkerMetrics, policy=None,
                      prober=None) -> AsyncIterator[worker_pb2_grpc.DecodeWorkerStub]:
    """A stub talking to a servicer over ``policy`` (and ``prober``); no engine, no KV ranks."""
    servicer = DecodeServicer(SimpleNamespace(in_flight=InFlight()), None, policy, None, "decode-test", 0, metrics,
                              prober)
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield worker_pb2_grpc.DecodeWorkerStub(channel)
    finally:
        await server.stop(0)
