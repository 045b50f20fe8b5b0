"""KV that does not come from this engine's own prefill: the three lifecycles, behind one component.

================  ==========================================  =========================================
lifecycle         hooks (``ExternalKV``)                      scheduler side
================  ==========================================  =========================================
pull (decode)     ``reserve_pull`` -> caller READs the blocks  WAITING_FOR_KV in ``Scheduler.pulls``
                  -> ``pull_arrived`` or ``pull_failed``       until ``complete`` (runs) or ``fail``
                                                               (prefills here)
host-tier load    ``host_tier`` (made by ``host_tier_for``),   LOADING_KV while the copy runs; the next
                  ``on_load_finished`` wakes the engine        ``schedule`` takes it in (or computes)
hold for a pull   ``add_request(hold_kv_on_finish=True)``,     finished, blocks held until
(prefill)         then ``release_held`` once it was pulled     ``release_held``
================  ==========================================  =========================================

``LLMEngine`` keeps the step loop and delegates these to the component; the scheduler keeps the
requests (see its state table). The host-tier load is only half behind this component: it builds the
tier and wires its wake-up, but the scheduler still calls the tier itself (lookup, load, poll, store,
pin), each call guarded by ``host_tier is not None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from services.contract.outputs import TopLogprobs
from services.engine.engine_config import EngineConfig
from services.engine.kv_cache.buffers import KVCache
from services.engine.kv_cache.manager import KVCacheManager
from services.engine.offload import HostKVTier, num_spans_for
from services.engine.output_processor import OutputProcessor, RequestOutput
from services.engine.request import Request
from services.engine.sched.scheduler import Scheduler
from services.engine.structured.backend import GrammarMatcher
from services.kv.spec.layout import KVLayoutSpec

log = logging.getLogger(__name__)


def host_tier_for(config: EngineConfig, layout: KVLayoutSpec, kv_cache: KVCache, kv_manager: KVCacheManager,
                  device: torch.device) -> HostKVTier | None:
    """The host KV tier of ``kv_offload_bytes`` (spans of ``kv_offload_block_factor`` blocks), if asked for."""
    if not config.kv_offload_bytes:
        return None
    factor = config.kv_offload_block_factor
    per_block = sum(layout.block_bytes(g.group_id) for g in layout.groups)
    num_spans = num_spans_for(per_block, factor, config.kv_offload_bytes)
    if num_spans < 1:
        raise ValueError(f"a host KV tier of {config.kv_offload_bytes} bytes holds no span of {factor} "
                         f"blocks ({per_block * factor} bytes)")
    tier = HostKVTier(kv_cache, kv_manager, num_spans, factor)
    log.info("host KV tier: %d spans of %d blocks (%.2f GiB%s)", num_spans, factor, tier.num_bytes / 2**30,
             ", pinned" if device.type == "cuda" else "")
    return tier


class ExternalKV:
    """The engine's side of KV pulled in, loaded from the host tier, or held for a pull.

    ``wait_for_step_in_flight``: blocks until the launched step has finished on the device (a
    reservation may get a stopped request's blocks, which that step may still write).
    """

    def __init__(self, scheduler: Scheduler, outputs: OutputProcessor, host_tier: HostKVTier | None,
                 wait_for_step_in_flight: Callable[[], None]) -> None:
        self.scheduler = scheduler
        self.outputs = outputs
        self.host_tier = host_tier
        self._wait_for_step_in_flight = wait_for_step_in_flight

    # ---- a pull (decode worker) ------------------------------------------------------------------
    def reserve_pull(self, request: Request, grammar: GrammarMatcher | None) -> Request | None:
        """Blocks for a checked new request whose KV is pulled in; None (nothing changed) when there
        is no room now."""
        if self.scheduler.pulls.allocate(request) is None:
            return None
        self._wait_for_step_in_flight()  # the blocks may have been a stopped request's: a READ fills them next
        self.outputs.add(request, grammar)
        return request

    def prepare_pull(self, request_id: str, num_pulled_tokens: int = 0) -> None:
        """While the KV is on the way: hash the prompt's blocks and publish those already pulled, so that
        ``pull_arrived`` only files the rest."""
        self.scheduler.pulls.prepare(request_id, num_pulled_tokens)

    def pull_arrived(self, request_id: str, first_token_id: int, first_logprob: float | None) -> RequestOutput:
        """The blocks are filled: the request joins the batch with its first token (checked against
        its grammar before anything changes: StructuredOutputError, a ValueError)."""
        if request_id in self.outputs:
            grammar = self.outputs.state(request_id).grammar
            if grammar is not None:
                grammar.accept(first_token_id)
        request = self.scheduler.pulls.complete(request_id, first_token_id, first_logprob)
        if request.sampling_params.top_logprobs:
            self.outputs.record_top_logprobs(request_id, TopLogprobs((), ()))  # the prefill worker reported them
        return self.outputs.output(request)

    def pull_failed(self, request_id: str) -> None:
        """The KV never arrived: the request is prefilled here instead (it is not lost)."""
        self.scheduler.pulls.fail(request_id)

    def quarantine_pull(self, request_id: str) -> str:
        """The READ timed out and could not be cancelled: retire the request, keep its blocks out of the
        pool under the returned key (``release_quarantined`` frees them once no late write can land)."""
        key = self.scheduler.pulls.quarantine(request_id)
        self.outputs.discard(request_id)
        return key

    def release_quarantined(self, key: str) -> bool:
        return self.scheduler.pulls.release_quarantined(key)

    # ---- held for a pull (prefill worker) ----------------------------------------------------------
    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished ``hold_kv_on_finish`` request kept for a pull."""
        return self.scheduler.release_held(request_id)

    # ---- the host tier -----------------------------------------------------------------------------
    def on_load_finished(self, wakeup: Callable[[], None]) -> None:
        """``wakeup()`` runs (on the tier's copier thread) when a host-tier load finishes, so an idle
        engine thread steps to take it in."""
        if self.host_tier is not None:
            self.host_tier.set_wakeup(wakeup)

    def close(self) -> None:
        """Stop the host tier's copier."""
        if self.host_tier is not None:
            self.host_tier.close()
