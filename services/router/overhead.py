"""The router's own time per generation request, stage by stage: ``pdserve_router_overhead_seconds{stage}``.

``router_added_latency`` stops at the first worker RPC; this follows the request to its first byte out. One
:class:`StageClock` per request, started by :class:`TimeStages` when the app is called (the headers are in),
is reached through a context variable, which the tasks the request starts inherit (its choices, the wait for
the first token, the SSE body): a stage boundary is one call, :func:`mark`, where the stage ends.

==========  ==========================================================================================
stage       from the previous boundary until
==========  ==========================================================================================
body_read   the body is read (``http_guards.read_body``)
decode      its JSON is decoded and checked (``app``)
tokenize    the chat template, the tokens, the vocabulary and context checks are done (``app``)
prepare     sampling params, the answer and the choices are built, the flow admitted (``flow.Dispatcher``)
pick_pair   the (prefill, decode) pair is chosen (``flow.Dispatcher``)
relay       from the last delta out of the flow before the first byte (the first token when streamed, the
            last one otherwise: :func:`waited`) until that first byte is handed to the server: detokenizing,
            the OpenAI chunk or body, SSE framing, headers
==========  ==========================================================================================

Between ``pick_pair`` and that delta the time is the workers' and their RPCs', not counted. A stage counts
once per request (with several choices, the first to get there); a request is observed when it answered 200.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

from prometheus_client import Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STAGES = ("body_read", "decode", "tokenize", "prepare", "pick_pair", "relay")
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class StageClock:
    """Each stage's seconds, measured from the previous boundary."""

    def __init__(self, start_s: float) -> None:
        self.last_s = start_s
        self.seconds: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        if stage in self.seconds:
            return  # a later choice passing a boundary the first one already passed
        now = time.monotonic()
        self.seconds[stage] = now - self.last_s
        self.last_s = now

    def waited(self) -> None:
        """The time since the last boundary was the workers': the next stage starts now."""
        if "relay" not in self.seconds:
            self.last_s = time.monotonic()


_clock: ContextVar[StageClock | None] = ContextVar("pdserve_router_stage_clock", default=None)


def mark(stage: str) -> None:
    """End ``stage`` of the current request now (nothing outside a timed request)."""
    clock = _clock.get()
    if clock is not None:
        clock.mark(stage)


def waited() -> None:
    """A delta left the flow: what came before it since the last boundary was the workers' time."""
    clock = _clock.get()
    if clock is not None:
        clock.waited()


class TimeStages:
    """Pure ASGI middleware (outermost, so ``relay`` ends at the server): a clock per generation request, its
    stages observed in ``histogram`` when the response was a 200."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        clock = StageClock(time.monotonic())
        status = 0

        async def send_timed(message: Message) -> None:
            nonlocal status
            await send(message)
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and message.get("body"):
                clock.mark("relay")

        token = _clock.set(clock)
        try:
            await self.app(scope, receive, send_timed)
        finally:
            _clock.reset(token)
        if status == 200:
            for stage, seconds in clock.seconds.items():
                self.histogram.labels(stage).observe(seconds)
