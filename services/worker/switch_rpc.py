"""The ``SwitchRole`` RPC, and the gate every role-bound RPC passes: mixed into both worker servicers."""

from __future__ import annotations

import grpc

from services.contract.wire import ROLE_REFUSED_KEY
from services.proto_gen.pdserve.v1 import worker_pb2
from services.worker.role_switch import RoleSwitch, SwitchRefused


class SwitchRoleRPCs:
    """``SwitchRole`` for either servicer (mixed in before the generated base), and :meth:`admit_role`."""

    switch: RoleSwitch
    default_drain_timeout_s: float = 30.0  # the worker's --drain-timeout-s, for a request that names none

    async def admit_role(self, role: str, context: grpc.aio.ServicerContext) -> None:
        """Refuse (UNAVAILABLE, marked ``ROLE_REFUSED_KEY``: a router routes elsewhere) a call of a role this
        worker does not serve now, or one a switch's drain no longer takes."""
        why = self.switch.refusal(role)
        if why is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, why, trailing_metadata=((ROLE_REFUSED_KEY, role),))

    async def SwitchRole(self, request: worker_pb2.SwitchRoleRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> worker_pb2.SwitchRoleResponse:
        drain_timeout_s = request.drain_timeout_s if request.drain_timeout_s > 0 else self.default_drain_timeout_s
        try:
            result = await self.switch.switch(request.role, drain_timeout_s)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SwitchRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except TimeoutError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the drain did not end: {e}")
        return worker_pb2.SwitchRoleResponse(role=result.role, previous_role=result.previous_role,
                                             epoch=result.epoch, drain_seconds=result.drain_s,
                                             seconds=result.seconds, num_migrated=result.num_migrated)
