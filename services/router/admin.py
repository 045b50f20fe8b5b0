"""The operator API under ``/admin``: what the router knows of each worker, and the P:D planner's last decision.

    GET /admin/workers    every worker: address, its id on /metrics, engine id, role, state, epoch, its engine's
                          last reported load, the router's own counts on it, the decode rate measured on it,
                          KV index state
    GET /admin/planner    the planner's last decision with the inputs it came from (planner.py)

Who may call it: the same ``Authorization: Bearer <--api-key>`` as ``/v1/*`` (``http_guards.ApiKeyAuth``
checks it before any route runs; ``/admin`` is not an open path). A router without an API key keeps
the admin API closed (403, :class:`AdminDisabled`) unless ``--admin-without-api-key`` says it runs where
nobody else can reach it: the API names every worker and, with role switching, changes them.

Routes that act on workers (``POST /admin/workers/{id}/role``) go in :func:`add_admin_routes` too, each
starting with :func:`require_admin`.
"""

from __future__ import annotations

import time
from typing import Protocol

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.router.config import RouterConfig
from services.router.errors import RouterError
from services.router.http_guards import read_body
from services.router.pairing import PairingPolicy, WorkerState
from services.router.planner_loop import PlannerLoop
from services.router.prefix_index import Load, PrefixIndex
from services.router.role_switch import RoleSwitching, decode_switch_request
from services.router.traffic import TrafficStats
from services.router.worker_labels import WorkerLabels

ADMIN_PATHS = ("/admin/workers", "/admin/planner")


class AdminRuntime(Protocol):
    """What the admin routes read of the app's runtime (``runtime.RouterRuntime``)."""

    config: RouterConfig
    policy: PairingPolicy
    index: PrefixIndex | None
    planner: PlannerLoop
    worker_labels: WorkerLabels


class AdminDisabled(RouterError):
    """No ``--api-key`` is set, so the admin API is closed (``--admin-without-api-key`` opens it)."""

    status_code = 403
    error_type = "permission_error"
    code = "admin_disabled"


def require_admin(request: Request) -> AdminRuntime:
    """The runtime, if the admin API is open to this caller (the API key middleware already checked the
    key when one is set); AdminDisabled otherwise."""
    rt: AdminRuntime = request.app.state.runtime
    if rt.config.api_key is None and not rt.config.admin_without_api_key:
        raise AdminDisabled("the admin API needs the router's API key: start the router with --api-key (or "
                            "$PDSERVE_API_KEY); --admin-without-api-key opens it without one")
    return rt


def add_admin_routes(app: FastAPI) -> None:
    """The ``/admin`` routes (behind the API key; closed without one unless ``--admin-without-api-key``)."""

    @app.get("/admin/workers")
    async def admin_workers(request: Request) -> Response:
        rt = require_admin(request)
        traffic = rt.planner.last_traffic
        workers = [worker_entry(rt.policy, w, rt.index, traffic, rt.worker_labels) for w in rt.policy.workers()]
        return _json({"workers": workers, "role_planner": rt.config.role_planner})

    @app.get("/admin/planner")
    async def admin_planner(request: Request) -> Response:
        rt = require_admin(request)
        loop, config = rt.planner, rt.config
        decision = loop.last
        body: dict[str, object] = {
            "mode": "acting" if loop.acting else "advisory",
            "interval_s": loop.interval_s,
            "switch_in_progress": loop.switching,
            "config": {"slo_ttft_ms": config.planner_slo_ttft_ms, "slo_itl_ms": config.planner_slo_itl_ms,
                       "window_s": config.planner_window_s,
                       "hysteresis_evaluations": config.planner_hysteresis_evaluations,
                       "margin_workers": config.planner_margin_workers, "min_dwell_s": config.planner_min_dwell_s},
            "decision": None,
        }
        if decision is not None:
            body["decision"] = {**decision.to_json(), "age_s": round(max(loop.clock() - decision.at_s, 0.0), 3)}
        return _json(body)

    @app.post("/admin/workers/{worker_id}/role")
    async def admin_switch_role(worker_id: str, request: Request) -> Response:
        """Switch a worker (by address or engine id) to another role in place: answers once it serves it
        (role_switch.py); 409 when it cannot start now, 502 when the worker's switch failed."""
        rt = require_admin(request)
        body = decode_switch_request(await read_body(request, rt.config.max_request_bytes))
        switching: RoleSwitching = request.app.state.runtime.switching
        outcome = await switching.switch_role(switching.find(worker_id).address, body.role, body.drain_timeout_s)
        return _json(outcome.to_json())


def worker_entry(policy: PairingPolicy, worker: WorkerState, index: PrefixIndex | None,
                 traffic: TrafficStats | None, labels: WorkerLabels) -> dict[str, object]:
    """One worker on ``GET /admin/workers``; ``worker`` is its id on /metrics (``labels``)."""
    identity = worker.identity
    epoch = identity.epoch if identity is not None else None
    load = index.load(worker.address, epoch) if index is not None and epoch is not None else None
    entry: dict[str, object] = {
        "address": worker.address,
        "worker": labels(worker.address),
        "engine_id": identity.engine_id if identity is not None else None,
        "role": worker.role.value,
        "state": policy.worker_state(worker),
        "healthy": worker.healthy,
        "draining": bool(identity and identity.draining),
        "epoch": epoch,
        "last_error": worker.last_error,
        "load": _load(load),
        "router": {"outstanding_requests": worker.outstanding_requests,
                   "outstanding_prompt_tokens": worker.outstanding_tokens,
                   "queued_prefill_tokens": worker.queued_prefill_tokens},
        "decode": None,
        "kv_index": None,
    }
    sample = traffic.decode.get(worker.address) if traffic is not None else None
    if sample is not None:
        entry["decode"] = sample.to_json()
    if index is not None:
        last = index.last_batch_s(worker.address)
        entry["kv_index"] = {"state": index.state(worker.address).value,
                             "last_batch_age_s": round(time.monotonic() - last, 3) if last is not None else None}
    return entry


def _load(load: Load | None) -> dict[str, object] | None:
    if load is None:
        return None
    return {"num_running": load.num_running, "num_waiting": load.num_waiting,
            "waiting_prefill_tokens": load.waiting_prefill_tokens, "kv_blocks_free": load.kv_blocks_free,
            "kv_blocks_total": load.kv_blocks_total, "prefill_tokens_per_s": round(load.prefill_tokens_per_s, 1)}


def _json(payload: object) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")
