"""The engine's step loop on its own thread, with an asyncio API for the daemons.

``LLMEngine`` is single-threaded and a step takes milliseconds to tens of milliseconds, which must
not stall a gRPC event loop. So one thread owns the engine: it runs commands submitted from the
event loop between steps, steps while there is work, and hands each request's outputs back to
that request's asyncio queue. Nothing else ever touches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from services.contract.sampling_params import SamplingParams
from services.contract.structured import StructuredOutputError
from services.engine.kv_cache.events import KVCacheContents
from services.engine.kv_parts import PartWatch, PinnedPart
from services.engine.llm_engine import LLMEngine
from services.engine.offload import HostTierStats
from services.engine.output_processor import RequestOutput
from services.engine.request import Request
from services.engine.runner.rank_runtime import use_device
from services.engine.sched.scheduler_output import PrefixCacheStats
from services.engine.structured.backend import GrammarMatcher

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a failed step); the request cannot complete."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_held: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_held: int
    num_loading: int = 0  # requests loading their prefix from the host KV tier
    waiting_prefill_tokens: int = 0  # prompt tokens admitted but not computed yet
    prefill_tokens_per_s: float = 0.0  # measured over recent prefill steps (services/engine/load.py)
    prefix: PrefixCacheStats | None = None
    host_tier: HostTierStats | None = None  # None: no host tier


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._parts = PartWatch()  # prefills whose KV is handed out per chunk (engine thread only)
        self.stats = self._read_stats()
        # A finished host-tier copy wakes the engine thread to take it in.
        engine.external_kv.on_load_finished(lambda: self._commands.put(_wake_up))

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        self._thread = None

    @property
    def failure(self) -> BaseException | None:
        """Why the engine thread stopped on its own (a failed step); None while it runs or after ``stop``."""
        return self._dead

    # ---- calls onto the engine thread ----------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(run)
        return await future

    async def _grammar(self, params: SamplingParams, prefix: Sequence[int] = ()) -> GrammarMatcher | None:
        """The request's grammar matcher, made on the compiler's threads (not this loop, not the engine's)."""
        if params.structured is None:
            return None
        try:
            return await self.engine.grammars.matcher_async(params.structured, prefix)
        except StructuredOutputError as exc:
            raise ValueError(str(exc)) from None

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                          hold_kv_on_finish: bool = False, grammar_prefix: Sequence[int] = (),
                          kv_part_align: int = 0, kv_final_part_tokens: int = 0, kv_rounding: str = "") -> Request:
        """Queue a request; read its outputs with :meth:`outputs`. ValueError for bad input.

        ``grammar_prefix``: output tokens that are part of the prompt here (a first token sampled by the
        prefill worker, recomputed locally) and already part of the structured output's document.
        ``kv_part_align`` > 0 (prefill, KV sent per chunk): its prompt's computed blocks are pinned in parts
        ending on multiples of that many tokens, read with :meth:`outputs_with_parts`; with
        ``kv_final_part_tokens`` > 0 a prompt chunked over several steps ends with a chunk of at most that many
        tokens, so the part left after the first token (the one a reader waits for) is small. ``kv_rounding``:
        ``LLMEngine.add_request``'s.
        """
        grammar = await self._grammar(params, grammar_prefix)
        self._open_stream(request_id)

        def add(e: LLMEngine) -> Request:
            cap = (kv_final_part_tokens, kv_part_align) if kv_part_align and kv_final_part_tokens > 0 else None
            request = e.add_request(request_id, prompt_token_ids, params, hold_kv_on_finish=hold_kv_on_finish,
                                    grammar=grammar, final_chunk_cap=cap, kv_rounding=kv_rounding)
            if kv_part_align:
                self._parts.watch(request_id, kv_part_align, len(prompt_token_ids))
            return request

        try:
            return await self.call(add)
        except BaseException:
            self._streams.pop(request_id, None)
            raise

    async def add_request_with_external_kv(self, request_id: str, prompt_token_ids: Sequence[int],
                                           params: SamplingParams) -> Request | None:
        """Reserve blocks for KV that will be pulled; None when there is no room now."""
        grammar = await self._grammar(params)
        self._open_stream(request_id)
        try:
            request = await self.call(
                lambda e: e.add_request_with_external_kv(request_id, prompt_token_ids, params, grammar))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        if request is None:
            self._streams.pop(request_id, None)
        return request

    async def complete_external_kv(self, request_id: str, first_token_id: int,
                                   first_logprob: float | None = None) -> None:
        def complete(e: LLMEngine) -> None:
            out = e.complete_external_kv(request_id, first_token_id, first_logprob)
            # Queued from the engine thread, so it reaches the stream before any later step's output
            # (delivering after `call` returns would let the next step's token overtake it).
            self._loop.call_soon_threadsafe(self._deliver, out)

        await self.call(complete)

    def prepare_external_kv(self, request_id: str, num_pulled_tokens: int = 0) -> None:
        """``LLMEngine.prepare_external_kv`` on the engine thread, not awaited: the pull goes on meanwhile, and
        its completion, queued later, finds the work done."""

        def prepare() -> None:
            try:
                self.engine.prepare_external_kv(request_id, num_pulled_tokens)
            except Exception:  # noqa: BLE001 - an optimisation: the completion does the work itself
                log.exception("preparing request %s for its pulled KV failed", request_id)

        self._commands.put(prepare)

    async def fail_external_kv(self, request_id: str) -> None:
        await self.call(lambda e: e.fail_external_kv(request_id))

    async def abort(self, request_id: str) -> bool:
        found = await self.call(lambda e: e.abort_request(request_id))
        self._end_stream(request_id, "aborted")
        return found

    def _end_stream(self, request_id: str, why: str) -> None:
        """A request the engine dropped: its stream's reader gets CancelledError instead of waiting."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put_nowait(asyncio.CancelledError(f"request {request_id} {why}"))

    async def release_held_kv(self, request_id: str) -> bool:
        return await self.call(lambda e: e.release_held_kv(request_id))

    async def quarantine_external_kv(self, request_id: str) -> str:
        key = await self.call(lambda e: e.quarantine_external_kv(request_id))
        self._end_stream(request_id, "quarantined")
        return key

    async def release_quarantined_kv(self, key: str) -> bool:
        return await self.call(lambda e: e.release_quarantined_kv(key))

    async def kv_snapshot(self) -> tuple[int, list[KVCacheContents]]:
        """``LLMEngine.kv_snapshot`` on the engine thread: the keys cached now and the last event they reflect."""
        return await self.call(lambda e: e.kv_snapshot())

    def outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. Leaving early (cancellation, a client
        that went away) aborts the request on the engine, so nothing is left running or held."""
        return self._stream_items(request_id)

    def outputs_with_parts(self, request_id: str) -> AsyncIterator[RequestOutput | PinnedPart]:
        """:meth:`outputs` of a request added with ``kv_part_align``, with its ``PinnedPart``s in step order."""
        return self._stream_items(request_id)

    async def _stream_items(self, request_id: str) -> AsyncIterator:
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"no request {request_id!r} is streaming")
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, RequestOutput) and item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:
                with contextlib.suppress(EngineDeadError):
                    await asyncio.shield(self.call(lambda e: e.abort_request(request_id)))

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        use_device(self.engine.device)  # the current CUDA device is per thread: this one runs the steps
        stalled = False  # the last step scheduled nothing: only a command (or time) can change that
        try:
            while True:
                idle = stalled or not self._can_step()
                try:
                    command = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
                except queue.Empty:
                    command = _NO_COMMAND
                while command is not _NO_COMMAND:
                    if command is None:
                        return
                    command()
                    stalled = False
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = _NO_COMMAND
                if self._can_step():
                    for out in self.engine.step():
                        self._loop.call_soon_threadsafe(self._deliver, out)
                    if self._parts:
                        for part in self._parts.collect(self.engine):
                            self._loop.call_soon_threadsafe(self._deliver, part)
                    # Waiting requests that do not fit while nothing runs: blocks come back only through a
                    # command (a pull completing, held KV released, an abort), so wait for one, not spin.
                    stalled = not self.engine.last_step_ran
                self.engine.kv_events.seal()  # this iteration's KV events, numbered, to the publisher
                self.stats = self._read_stats()
        except BaseException as e:  # a failed step: fail every stream rather than hang them
            log.exception("engine thread stopped")
            self._dead = e
            self._loop.call_soon_threadsafe(self._fail_all, e)

    def _can_step(self) -> bool:
        """Whether a step has anything to run: a running or a waiting request.

        A request whose KV is being pulled cannot run until a command completes (or fails) its pull, so
        alone it leaves the thread idle, waiting for commands. Stepping it in a loop would hold the GIL
        and make every other thread of the daemon (the event loop, the NIXL agent's) wait for the
        interpreter's 5 ms switch interval at each hand-over: ~5 ms per thread hop of the very pull.
        """
        e = self.engine
        sched, tier = e.scheduler, e.host_tier
        return (sched.num_running > 0 or sched.num_waiting > 0 or e.has_step_in_flight
                or (tier is not None and tier.has_completions))

    def _read_stats(self) -> EngineStats:
        e = self.engine
        sched, pool = e.scheduler, e.kv_manager.pool(0)
        return EngineStats(
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_waiting_for_kv=sched.num_waiting_for_kv, num_held=sched.num_held,
            kv_blocks_total=pool.num_blocks, kv_blocks_free=pool.num_free_blocks,
            kv_blocks_held=sum(s.num_held for s in e.kv_manager.stats()),
            num_loading=sched.num_loading, waiting_prefill_tokens=sched.num_prefill_tokens_pending,
            prefill_tokens_per_s=e.prefill_rate.tokens_per_s, prefix=replace(sched.prefix_stats),
            host_tier=e.host_tier.stats() if e.host_tier is not None else None,
        )

    # ---- event-loop side -----------------------------------------------------------------------
    def _open_stream(self, request_id: str) -> None:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = asyncio.Queue()

    def _deliver(self, out: RequestOutput | PinnedPart) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError(f"engine stopped: {error}"))


_NO_COMMAND: Any = object()


def _wake_up() -> None:
    """A command that does nothing: it only ends the engine thread's wait for one."""


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
