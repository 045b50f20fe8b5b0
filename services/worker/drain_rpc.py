"""The ``Drain`` RPC, mixed into both worker servicers: what a preStop hook (``pdserve drain``) calls.

It starts the worker's drain, or joins the one under way (SIGTERM's, another caller's), and answers when it
ended; the drain itself is ``WorkerServer.drain`` (grpc_server.py) over the role's rules (role_switch.py).
"""

from __future__ import annotations

import grpc

from services.proto_gen.pdserve.v1 import worker_pb2
from services.worker.grpc_server import WorkerServer


class DrainRPCs:
    """``Drain`` for either servicer (mixed in before the generated base)."""

    server: WorkerServer
    default_drain_timeout_s: float = 30.0  # the worker's --drain-timeout-s (set where the servicer is attached)

    async def Drain(self, request: worker_pb2.DrainRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> worker_pb2.DrainResponse:
        """Answered once the worker is drained (or its bound ran out): a caller that gives up stops nothing."""
        outcome = await self.server.drain(self.default_drain_timeout_s)
        return worker_pb2.DrainResponse(role=outcome.role, seconds=outcome.seconds,
                                        num_migrated=outcome.num_migrated, num_left=outcome.num_left)
