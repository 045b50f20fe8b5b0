"""The step loop: schedule -> run the model -> sample -> update -> detokenize and check stops.

``LLMEngine`` is synchronous and single-threaded; the daemons drive ``step()`` from their own
loop. Requests come in as token ids or text and leave as ``RequestOutput`` deltas.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.contract.outputs import TopLogprobs
from services.contract.sampling_params import SamplingParams
from services.contract.structured import StructuredOutputError
from services.engine.engine_config import EngineConfig
from services.engine.external_kv import ExternalKV, host_tier_for
from services.engine.kv_cache.events import KVCacheContents, KVEventLog
from services.engine.kv_cache.manager import KVCacheManager
from services.engine.load import PrefillRate, prompt_tokens_of
from services.engine.loading.source import ModelSource, resolve_model
from services.engine.output_processor import OutputProcessor, RequestOutput
from services.engine.request import Request
from services.engine.runner.rank_runtime import RankRuntime
from services.engine.runner.sampler import (
    GrammarMasks,
    PendingSample,
    TokenHistory,
    min_tokens_banned_ids,
    sample_async,
)
from services.engine.runner.step import DeviceTokens
from services.engine.sched.scheduler import Scheduler, SchedulerConfig
from services.engine.sched.scheduler_output import PLACEHOLDER_TOKEN, SchedulerOutput
from services.engine.structured.backend import GrammarMatcher
from services.engine.structured.bitmask import allocate_bitmask
from services.engine.structured.compiler import GrammarCompiler
from services.kv.spec import kv_quant
from services.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from services.engine.tp.group import TPGroup

@dataclass(frozen=True)
class _LaunchedStep:
    """A step whose model is launched; its sampled tokens may still be on the device."""

    output: SchedulerOutput
    rows: list[Request]  # the requests of the sampled rows, in row order
    pending: PendingSample | None  # None when no chunk samples
    graph: bool  # ran through the decode graphs: the next graph step can read its tokens on the device


def _needs_resolved_tokens(output: SchedulerOutput) -> bool:
    """Whether a chunk's request needs its newest token on the host first (penalties, a grammar)."""
    return any(c.request.sampling_params.needs_resolved_tokens for c in output.chunks)


def _history(request: Request) -> TokenHistory | None:
    """The tokens a penalised row's logits depend on (None for other rows); all resolved by now."""
    if not request.sampling_params.needs_history:
        return None
    if PLACEHOLDER_TOKEN in request.output_token_ids:
        raise RuntimeError(f"request {request.request_id}: penalties with an unresolved output token")
    return TokenHistory(request.prompt_token_ids, request.output_token_ids)


class LLMEngine:
    """One engine: the step loop over this rank's runtime, the scheduler and the outputs.

    Components: ``runtime`` (model, KV cache, runner: ``RankRuntime``, built the same way on every
    TP rank), ``scheduler`` (which requests run, and their blocks), ``outputs`` (states, stop
    checks, ``RequestOutput``), ``external_kv`` (KV pulled in, loaded from the host tier, or held
    for a pull). The step loop (``step``) is what this class keeps for itself.
    """

    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 tp_group: TPGroup | None = None) -> None:
        """``tp_group``: the follower ranks (1..tp-1) of a tensor-parallel engine; this is rank 0.

        Every rank loads its shard; the ranks agree on one KV block count (the smallest any rank's
        memory allows), and each step is sent to the followers before this rank runs it.
        """
        if (tp_group is None) != (config.parallel.tp_size == 1):
            raise ValueError(f"tp_size {config.parallel.tp_size} needs a TP group of its follower ranks")
        self.config = config
        self.tp_group = tp_group
        self.source = source or resolve_model(config.model)
        self.model_config = self.source.config
        self.runtime = RankRuntime(config, self.source, tp_group.agree_num_blocks if tp_group else None)
        rt = self.runtime
        self.device, self.dtype, self.model = rt.device, rt.dtype, rt.model
        self.kv_layout, self.num_kv_blocks, self.kv_cache = rt.kv_layout, rt.num_kv_blocks, rt.kv_cache
        self.max_model_len = rt.max_model_len
        self.runner = rt.runner if tp_group is None else tp_group.leader_runner(rt.runner)
        self.tokenizer: Tokenizer | None = self.source.load_tokenizer()
        self.eos_token_ids = self._eos_ids()
        # Pool ids are 0 .. num_kv_blocks - 1 in every group. A sliding-window table's entry for a
        # block freed out of the window is the placeholder num_kv_blocks: the scratch block.
        self.kv_events = KVEventLog()  # off until a subscriber turns it on (services/worker/kv_events.py)
        self.kv_manager = KVCacheManager(
            self.kv_layout.groups, [self.num_kv_blocks] * len(self.kv_layout.groups),
            enable_prefix_caching=config.enable_prefix_caching, events=self.kv_events,
            num_state_slots=rt.state_pool.num_slots if rt.state_pool is not None else 0,
        )
        if rt.state_pool is not None and config.kv_offload_bytes:
            raise ValueError("the host KV tier cannot serve a model with state layers (Mamba2): a hit would need "
                             "the request's state, which is not stored; run it without kv_offload_bytes")
        self.host_tier = host_tier_for(config, self.kv_layout, self.kv_cache, self.kv_manager, self.device)
        self._scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.kv_manager,
            self.host_tier,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len, self.device,
                                       self._scheduler.finish_request)
        self.external_kv = ExternalKV(self._scheduler, self.outputs, self.host_tier, self.wait_for_step_in_flight)
        self._grammars: GrammarCompiler | None = None
        self._generate_ids = itertools.count()
        self.last_step_ran = False  # whether the last step() scheduled any work
        self._in_flight: _LaunchedStep | None = None  # a decode step launched, not yet resolved
        self.async_scheduling = config.async_scheduling  # may be switched off at run time (benchmarks: A/B)
        self.prefill_rate = PrefillRate()

    # ---- set-up --------------------------------------------------------------------------------
    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return frozenset(ids)

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:
        """Swap the scheduler (tests and benchmarks: another block manager); the components follow."""
        self._scheduler = scheduler
        self.outputs.finish_request = scheduler.finish_request
        self.external_kv.scheduler = scheduler

    @property
    def group_kv_heads(self) -> dict[int, int]:
        """Model-total KV heads of each KV-cache group (the layout holds this rank's share)."""
        return {g.group_id: self.model_config.layers[g.layer_ids[0]].num_kv_heads for g in self.kv_layout.groups}

    def set_cache_salt(self, cache_salt: bytes) -> None:
        """Key the prefix caches (device and host tier) with ``cache_salt``, before any request: a worker
        passes ``cache_salt_for`` its compatibility hash, so a router computes the same keys."""
        if self.has_unfinished_requests() or self.scheduler.num_held:
            raise ValueError("the cache salt can only be set before any request")
        self.kv_manager.set_cache_salt(cache_salt)
        if self.host_tier is not None:
            self.host_tier.spans.set_cache_salt(cache_salt)

    def kv_snapshot(self) -> tuple[int, list[KVCacheContents]]:
        """Every key the prefix caches hold, per (group, tier), and the number of the last KV event it
        reflects. Call on the engine's thread: events recorded so far are sealed first, so the snapshot
        covers exactly the events numbered up to the returned one."""
        self.kv_events.seal()
        contents = self.kv_manager.contents()
        if self.host_tier is not None:
            contents += self.host_tier.spans.contents()
        return self.kv_events.last_seq, contents

    def close(self) -> None:
        """Stop the follower ranks of a TP engine and the host tier's copier."""
        if self.tp_group is not None:
            self.tp_group.close()
        self.external_kv.close()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        hold_kv_on_finish: bool = False,
        grammar: GrammarMatcher | None = None,
        final_chunk_cap: tuple[int, int] | None = None,
        kv_rounding: str = "",
    ) -> Request:
        """Queue a request. Raises ValueError (and changes nothing) for bad input.

        ``grammar``: the request's matcher when ``params.structured`` is set, made beforehand off this
        thread (``GrammarCompiler.matcher_async``); made here when not given. ``hold_kv_on_finish``
        (prefill worker): keep the blocks after it finishes until ``release_held_kv``. ``final_chunk_cap``
        (prefill worker sending KV per chunk): ``Request.final_chunk_cap``. ``kv_rounding`` (prefill worker for
        an FP8-KV reader): the FP8 KV dtype its K/V are rounded through (``attention.kv_rounding``); "" on an FP8
        cache, which holds them so already.
        """
        request, grammar = self._new_request(request_id, prompt, params, grammar, hold_kv_on_finish)
        request.final_chunk_cap = final_chunk_cap
        request.kv_rounding = self._kv_rounding(kv_rounding)
        self.scheduler.add_request(request)
        self.outputs.add(request, grammar)
        return request

    def _kv_rounding(self, dtype: str) -> str:
        """``dtype`` as a request's ``kv_rounding`` here: ValueError unless "" or an FP8 KV dtype; "" when this
        engine's cache is FP8 itself."""
        if dtype and not kv_quant.is_quantized(dtype):
            raise ValueError(f"KV rounding {dtype!r}: only an FP8 KV dtype ({sorted(kv_quant.QUANTIZED_DTYPES)})")
        return "" if kv_quant.is_quantized(self.kv_layout.dtype) else dtype

    def _new_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None,
                     grammar: GrammarMatcher | None, hold_kv_on_finish: bool = False,
                     ) -> tuple[Request, GrammarMatcher | None]:
        """A checked new request and its grammar; ValueError (nothing changed) for bad input."""
        params = params or SamplingParams()
        token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids, params)
        if request_id in self.outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        grammar = self._grammar_for(params, grammar)
        return Request(request_id, token_ids, params, hold_kv_on_finish=hold_kv_on_finish), grammar

    @property
    def grammars(self) -> GrammarCompiler:
        """Matchers for structured output (made on first use); ValueError when the model has no tokenizer."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer, and this model has none")
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._grammars

    def _grammar_for(self, params: SamplingParams, grammar: GrammarMatcher | None) -> GrammarMatcher | None:
        if params.structured is None:
            return None
        if grammar is not None:
            return grammar
        try:
            return self.grammars.matcher(params.structured)
        except StructuredOutputError as exc:
            raise ValueError(str(exc)) from None

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        # Built-ins over the whole list first (a 32k-token prompt: 1.7 ms against 2.6 ms for a per-token check,
        # on the engine thread); the per-token check only names the offenders.
        if set(map(type, token_ids)) != {int} or min(token_ids) < 0 or max(token_ids) >= vocab:
            bad = [t for t in token_ids if type(t) is not int or not 0 <= t < vocab]
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but the context length is {self.max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )
        params.validate()
        params.check_vocab(vocab)

    # ---- KV computed elsewhere (disaggregation): see external_kv ------------------------------------
    def add_request_with_external_kv(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
        grammar: GrammarMatcher | None = None,
    ) -> Request | None:
        """Decode side: reserve blocks for a prompt whose KV another worker computed.

        Returns the request, whose ``block_ids[g]`` the caller fills from block
        ``request.num_cached_tokens // block_size`` on (earlier blocks came from the local prefix
        cache), then calls :meth:`complete_external_kv`; or None when there is no room now. In a
        sliding-window group the entries before ``first_needed_block(num_prompt_tokens)`` are the
        placeholder (the scratch block, see kv_cache.manager): not blocks, never to be filled; the
        transfer starts at ``window_start_token`` (services/kv/spec/topology.py), past them. A model with state
        layers: the caller also fills ``request.state_slot`` of the state pool with the owner's state after
        the whole prompt.
        """
        request, grammar = self._new_request(request_id, prompt, params, grammar)
        return self.external_kv.reserve_pull(request, grammar)

    def complete_external_kv(
        self, request_id: str, first_token_id: int, first_logprob: float | None = None
    ) -> RequestOutput:
        """The blocks are filled: the request joins the batch, its first token already known."""
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise ValueError(f"first token id {first_token_id} is outside the vocabulary")
        return self.external_kv.pull_arrived(request_id, first_token_id, first_logprob)

    def prepare_external_kv(self, request_id: str, num_pulled_tokens: int = 0) -> None:
        """Between reserving and completing: the work ``complete_external_kv`` would otherwise do on the way to
        the request's first step. Hashes the prompt's blocks for the prefix cache and publishes the full blocks
        of the first ``num_pulled_tokens`` tokens (KV sent per chunk: the parts pulled and checked so far).
        Optional; a request no longer reserved is skipped."""
        self.external_kv.prepare_pull(request_id, num_pulled_tokens)

    def fail_external_kv(self, request_id: str) -> None:
        """The KV never arrived: prefill the prompt here instead (the request is not lost)."""
        self.external_kv.pull_failed(request_id)

    def release_held_kv(self, request_id: str) -> bool:
        """Prefill side: free the blocks a finished ``hold_kv_on_finish`` request kept for a pull, and the
        blocks its part tickets pinned (``pin_kv_part``)."""
        return self.external_kv.release_held(request_id)

    def pin_kv_part(self, request_id: str, start: int, end: int, num_prompt_tokens: int) -> list[list[int]] | None:
        """Prefill side, KV sent per chunk: pin a running request's computed blocks of tokens ``start .. end``
        for a part ticket (``kv_parts.py``); its tables to ``end``, or None when it is not running with them."""
        return self.scheduler.pin_computed(request_id, start, end, num_prompt_tokens)

    def wait_for_kv_writes(self) -> None:
        """Block until every step launched so far has written its KV on the device (a reader may read it next)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def quarantine_external_kv(self, request_id: str) -> str:
        """Decode side: retire a request whose READ may still write its blocks; they stay out of the pool
        under the returned key until ``release_quarantined_kv``."""
        return self.external_kv.quarantine_pull(request_id)

    def release_quarantined_kv(self, key: str) -> bool:
        return self.external_kv.release_quarantined(key)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if it is unknown."""
        found = self.scheduler.abort_request(request_id)
        self.outputs.discard(request_id)
        return found

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns a delta for every request that produced a token or finished.

        Decode steps through the CUDA graphs are pipelined (``EngineConfig.async_scheduling``): the
        next step is scheduled and launched before this one's tokens reach the host, its input
        tokens copied from this step's on the device, so the GPU never waits for the host's
        bookkeeping between them. Each call then returns the previous decode step's outputs::

            call k:   schedule N+1 | launch N+1 (tokens of N on the device) | wait for N's tokens,
                      stop checks, outputs of N | count N+1 as computed (placeholder tokens)

        A request that stopped at N has its chunk of N+1 computed for nothing and dropped. Any step
        the graphs cannot run (a prefill chunk) waits for N's tokens first, as without pipelining, and
        so does a step with a row whose penalties need its whole output, or whose grammar must take N's
        token before it can mask N+1 (``needs_resolved_tokens``): N's token is only on the device until then.
        """
        started = time.perf_counter()
        prev, self._in_flight = self._in_flight, None
        output = self.scheduler.schedule()
        launched = None
        if (output.chunks and prev is not None and prev.graph and self.runner.runs_as_graph(output.chunks)
                and not _needs_resolved_tokens(output)):
            launched = self._launch(output, prev)
        outputs = self._resolve(prev) if prev is not None else []
        if launched is None and output.chunks:
            output = self.scheduler.drop_stale_chunks(output)  # requests that stopped at prev
            if output.chunks:
                launched = self._launch(output, None)
        self.last_step_ran = launched is not None or prev is not None
        if launched is None:
            return outputs
        self.scheduler.advance(launched.output)
        if launched.graph and self.async_scheduling:
            self._in_flight = launched
            return outputs
        outputs += self._resolve(launched)
        # A prefill chunk never runs as a graph: its step ends here, its tokens on the host.
        self.prefill_rate.observe(prompt_tokens_of(launched.output), time.perf_counter() - started)
        return outputs

    @property
    def has_step_in_flight(self) -> bool:
        """A launched decode step whose outputs the next ``step`` returns."""
        return self._in_flight is not None

    def wait_for_step_in_flight(self) -> None:
        """Block until the step in flight has finished on the device.

        Blocks freed at a step's stop checks may still be written by the step launched before them
        (the stopped request's extra token): a writer outside the compute stream (a NIXL READ into
        blocks reserved for a pull) must wait for it. Copies on the device's streams need not.
        """
        step = self._in_flight
        if step is not None and step.pending is not None and step.pending.ready is not None:
            step.pending.ready.synchronize()

    def _launch(self, output: SchedulerOutput, prev: _LaunchedStep | None) -> _LaunchedStep:
        """Run the model on a scheduled step and start sampling; nothing waits for the device.

        ``prev``: the step before, not yet resolved; chunks whose token is its placeholder read
        the token from its sampled tensor on the device.
        """
        graph = self.runner.runs_as_graph(output.chunks)
        if prev is None:
            logits = self.runner.execute(output.chunks)
        else:
            source = {id(r): i for i, r in enumerate(prev.rows)}
            rows = [i for i, c in enumerate(output.chunks) if c.token_ids[0] == PLACEHOLDER_TOKEN]
            tokens = DeviceTokens(prev.pending.token_ids, rows, [source[id(output.chunks[i].request)] for i in rows]) \
                if rows else None
            logits = self.runner.execute(output.chunks, tokens)
        for i, chunk_logits in logits.all_logits.items():
            self.outputs.record_logits(output.chunks[i], chunk_logits)
        rows = [output.chunks[i].request for i in logits.sample_rows]
        pending = None
        if rows:
            # The model runs on the device meanwhile: the grammars' masks are made on the host now.
            pending = sample_async(
                logits.sample_logits,
                [r.sampling_params for r in rows],
                [self.outputs.state(r.request_id).generator for r in rows],
                [min_tokens_banned_ids(r.sampling_params, r.num_output_tokens, self.eos_token_ids) for r in rows],
                [_history(r) for r in rows],
                self._grammar_masks(rows, logits.sample_logits.shape[1]),
            )
        return _LaunchedStep(output, rows, pending, graph)

    def _grammar_masks(self, rows: list[Request], vocab_size: int) -> GrammarMasks | None:
        """Packed masks of the rows with a grammar (their newest tokens are resolved: no pipelining)."""
        with_grammar = [i for i, r in enumerate(rows) if self.outputs.state(r.request_id).grammar is not None]
        if not with_grammar:
            return None
        bitmask = allocate_bitmask(len(with_grammar), vocab_size)
        for j, i in enumerate(with_grammar):
            self.outputs.state(rows[i].request_id).grammar.fill_bitmask(bitmask, j)
        return GrammarMasks(bitmask, with_grammar)

    def _resolve(self, step: _LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched (and advanced) step's tokens, put them in place, check stops."""
        sampled: dict[str, tuple[int, float | None]] = {}
        top: dict[str, TopLogprobs] = {}
        if step.pending is not None:
            result = step.pending.result()
            for j, r in enumerate(step.rows):
                sampled[r.request_id] = (result.token_ids[j], result.logprobs[j] if result.logprobs else None)
                if r.sampling_params.top_logprobs:
                    top[r.request_id] = result.top_logprobs[j].head(r.sampling_params.top_logprobs)
        updated = self.scheduler.resolve(step.output, sampled)
        self.outputs.accept_grammar_tokens(updated)
        for r in updated:
            if r.request_id in top:
                self.outputs.record_top_logprobs(r.request_id, top[r.request_id])
        return [self.outputs.output(r) for r in updated]

    # ---- convenience ---------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts together to completion (offline use and tests). Outputs in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{next(self._generate_ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while any(rid not in final for rid in ids):
            if not self.has_unfinished_requests():
                raise RuntimeError("engine went idle before every request finished")
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]
