"""One request's trip through a (prefill, decode) pair, as a stream of text deltas.

    acquire pair ──► Prefill(prompt) ──► first token ──► client      (TTFT = prefill time)
                         │ ticket
                         ▼
                     Generate(ticket) ──► tokens 2..n ──► client
    direct by cost or threshold (pairing.py) / no prefill worker up / prefill worker failed:
                     Generate(no ticket) ──► tokens 1..n ──► client

``--enforce-disagg`` closes the lower path: no prefill partner is a 503, a failed prefill a 502, and
``Generate`` carries ``require_pull``, so a decode worker that cannot pull fails the call (a 502, or an
error event once the first token is out) instead of recomputing the prompt.

The route (``routes.py``) is known in part when the first token leaves (``direct``, ``fallback`` after a
failed prefill, else ``disaggregated``) and final when the stream ends: a decode worker that recomputed
a pulled prompt turns ``disaggregated`` into ``fallback``. It is logged and counted once, at the end.

``Dispatcher.stream`` admits a request (the in-flight bound, a pair, a strict router's refusal), runs it
(``request_run.py``: the prefill leg and the KV-parts relay, the decode leg with its migrations and
failovers, the clean-up) and accounts for it: timing metrics as its deltas leave, then the route, one log line
and the planner's traffic record when it ends.

Whatever ends the stream early (the client went away, a worker failed, the router found a stop
string first), the ``finally`` aborts the decode request and releases the prefill worker's pinned
blocks, shielded from the cancellation that got it there, and uncounts the pair's outstanding work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from services.router import overhead
from services.router.config import RouterConfig
from services.router.errors import DisaggregationUnavailable, NoHealthyWorkers, Overloaded
from services.router.failover import DecodeWatch
from services.router.generation import Delta, GenerationRequest, Outcome, Workers
from services.router.metrics import RouterMetrics
from services.router.pairing import Assignment, PairingPolicy, Role
from services.router.prefix_index import PromptKeys
from services.router.request_run import RequestRun
from services.router.routes import Route
from services.router.traffic import FinishedRequest, TrafficWindow
from services.router.workers import WorkerPool
from services.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Dispatcher:
    """Runs requests over the workers; one per app, holding the shared pool, table and metrics."""

    def __init__(self, config: RouterConfig, policy: PairingPolicy, pool: WorkerPool,
                 tokenizer: Tokenizer | None, metrics: RouterMetrics, traffic: TrafficWindow | None = None) -> None:
        """``traffic``: where each ended request is recorded for the P:D planner (``traffic.py``)."""
        self.config = config
        self.policy = policy
        self.pool = pool
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.traffic = traffic
        self.num_in_flight = 0
        self.watch = DecodeWatch(policy, config.decode_failover_grace_s)  # failover.py: streams by decode worker

    async def stream(self, request: GenerationRequest, outcome: Outcome,
                     affinity: Workers | None = None) -> AsyncIterator[Delta]:
        """The request's deltas. Raises a RouterError before the first delta, or between two.

        ``affinity``: the pair to use if both are still available (a sibling choice of the same
        prompt, whose blocks their prefix caches hold).
        """
        overhead.mark("prepare")
        limit = self.config.max_inflight_requests
        if limit is not None and self.num_in_flight >= limit:
            raise Overloaded(f"{self.num_in_flight} requests in flight (limit {limit})",
                             retry_after_s=self.config.retry_after_s)
        assignment = self.policy.acquire(len(request.prompt_token_ids),
                                         affinity and (affinity.prefill, affinity.decode),
                                         request.prompt_keys or PromptKeys(request.prompt_token_ids),
                                         time.monotonic())
        overhead.mark("pick_pair")
        if assignment is None:
            known = len(self.policy.workers(Role.DECODE))
            raise NoHealthyWorkers(f"no healthy decode worker ({known} known)",
                                   retry_after_s=self.config.retry_after_s)
        if assignment.prefill is None and self.config.enforce_disagg:
            self.policy.finish(assignment)
            refused = DisaggregationUnavailable(self._no_partner(), retry_after_s=self.config.retry_after_s)
            _log_request(request, assignment, outcome, f"error:{type(refused).__name__}")
            raise refused
        self._count_decisions(request, assignment)
        run = RequestRun(self, request, assignment, outcome)
        outcome.workers = Workers(assignment.prefill, assignment.decode)
        self.num_in_flight += 1
        self.metrics.in_flight.inc()
        ending = "cancelled"  # unless it finished or failed: the consumer stopped listening
        try:
            async with aclosing(_timed(run.deltas(), self.metrics, request.arrival_s, outcome)) as deltas:
                async for delta in deltas:
                    outcome.finish_reason = delta.finish_reason
                    yield delta
        except Exception as exc:
            ending = f"error:{type(exc).__name__}"
            raise
        finally:
            try:
                await run.clean_up()
            finally:
                self.policy.finish(assignment)
                self.num_in_flight -= 1
                self.metrics.in_flight.dec()
                if outcome.route:  # the final route, once per request that took one
                    self.metrics.routes.labels(outcome.route).inc()
                _log_request(request, assignment, outcome, outcome.finish_reason or ending)
                if self.traffic is not None:
                    self.traffic.record(_finished(assignment, outcome))

    def _count_decisions(self, request: GenerationRequest, assignment: Assignment) -> None:
        """Why these workers and this route: metric labels, and the scores in the debug log."""
        for role, reason in assignment.decisions:
            self.metrics.routing_decisions.labels(role, reason).inc()
        route = Route.DIRECT if assignment.prefill is None else Route.DISAGGREGATED
        if assignment.route_reason:
            self.metrics.route_decisions.labels(route.value, assignment.route_reason).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s routed %s (%s): prefill=%s decode=%s %s; %s", request.request_id, route.value,
                      assignment.route_reason, assignment.prefill, assignment.decode,
                      " ".join(f"{role}:{reason}" for role, reason in assignment.decisions), assignment.detail)

    def _no_partner(self) -> str:
        """Why a strict router refuses a request that got no prefill worker."""
        prefill = self.policy.workers(Role.PREFILL)
        if not any(w.available for w in prefill):
            what = f"no healthy prefill worker ({len(prefill)} known)"
        else:
            what = self.policy.no_pair_reason()  # names what /health says more about
        return f"{what}, and --enforce-disagg forbids prefilling the prompt on a decode worker"



def _log_request(request: GenerationRequest, assignment: Assignment, outcome: Outcome, ending: str) -> None:
    """One structured line per request; ``route=none`` when it took none (refused, or failed before)."""
    log.info("request id=%s end=%s route=%s prefill=%s decode=%s prompt_tokens=%d cached_tokens=%s "
             "completion_tokens=%d recomputed=%s e2e_ms=%.1f", request.request_id, ending, outcome.route or "none",
             assignment.prefill, assignment.decode, outcome.num_prompt_tokens, outcome.num_cached_tokens,
             outcome.num_generated_tokens, outcome.recomputed_locally,
             (time.monotonic() - request.arrival_s) * 1e3)


def _finished(assignment: Assignment, outcome: Outcome) -> FinishedRequest:
    """What the P:D planner's traffic window keeps of an ended request."""
    now = time.monotonic()
    decode_s = now - outcome.decode_start_s if outcome.decode_start_s is not None else 0.0
    return FinishedRequest(now, outcome.num_prompt_tokens, outcome.num_generated_tokens, assignment.decode, decode_s,
                           outcome.num_cached_tokens or 0, outcome.num_decode_gaps)


async def _timed(deltas: AsyncIterator[Delta], metrics: RouterMetrics, arrival_s: float,
                 outcome: Outcome) -> AsyncIterator[Delta]:
    """Observe TTFT, inter-token and end-to-end latency as deltas leave the flow."""
    last_token_s: float | None = None
    async with aclosing(deltas):
        async for delta in deltas:
            overhead.waited()
            now = time.monotonic()
            if delta.token_ids:
                if last_token_s is None:
                    metrics.ttft.labels(outcome.route).observe(now - arrival_s)
                else:
                    if outcome.decode_start_s is None:
                        outcome.decode_start_s = now  # after the pull: the decode worker's steps from here
                    else:
                        outcome.num_decode_gaps += len(delta.token_ids)
                    gap = (now - last_token_s) / len(delta.token_ids)
                    for _ in delta.token_ids:
                        metrics.inter_token.observe(gap)
                last_token_s = now
                metrics.generation_tokens.inc(len(delta.token_ids))
            if delta.finish_reason is not None:
                metrics.e2e.labels(outcome.route).observe(now - arrival_s)
                metrics.prompt_tokens.inc(outcome.num_prompt_tokens)
            yield delta
