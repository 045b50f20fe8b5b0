"""The router's own view of its traffic over a sliding window: what the P:D planner weighs the workers against.

Each request that ends is recorded once (``Dispatcher.stream``'s ``finally``): its prompt and output
lengths, how much of the prompt a prefix cache held, the decode worker that generated it and how long
that worker took from the second token it streamed to its last, with the gaps in between. Over the last
``window_s`` this gives the arrival rate and mean lengths (the load on each role), and per decode worker the
tokens it delivered per second, its mean inter-token gap and, by Little's law, the mean number of sequences it
ran at once (their decode seconds over the window):

    concurrency = sum(decode_s) / window_s        itl_s = sum(decode_s) / sum(decode gaps)

The gaps are what the client sees, from the second token on: the first gap of a disaggregated request is
the KV pull and the decode worker's queue, not a decode step (measured from the first token, prefill-heavy
traffic with two-token outputs read as a decode running at a fraction of a token per second and pulled
workers into decode), so a request with fewer than three tokens gives no gap. Requests are counted when
they end, not when they arrive: in a steady state the two rates are equal,
and only the end knows the output length. Pure: callers pass the time; memory is bounded by
``max_requests`` (the oldest are dropped first, which only shortens the window under a flood).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FinishedRequest:
    """One ended request as the planner needs it."""

    end_s: float  # monotonic seconds
    num_prompt_tokens: int
    num_output_tokens: int
    decode: str | None = None  # the decode worker's address (None: refused before one was picked)
    decode_s: float = 0.0  # second token to last token (0 with fewer than three tokens)
    num_cached_tokens: int = 0  # prompt tokens a prefix cache served (not computed)
    num_decode_gaps: int | None = None  # gaps ``decode_s`` spans (None: num_output_tokens - 2)


@dataclass(frozen=True)
class DecodeSample:
    """One decode worker over the window, measured by the router."""

    tokens_per_s: float  # output tokens it delivered per second
    itl_s: float  # mean gap between its tokens
    concurrency: float  # mean sequences it decoded at once

    def to_json(self) -> dict[str, float]:
        return {"tokens_per_s": round(self.tokens_per_s, 3), "itl_ms": round(self.itl_s * 1e3, 3),
                "concurrency": round(self.concurrency, 3)}


@dataclass(frozen=True)
class TrafficStats:
    """The requests that ended in the last ``window_s``."""

    window_s: float
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    decode: Mapping[str, DecodeSample] = field(default_factory=dict)  # per decode worker address

    @property
    def rate_rps(self) -> float:
        return self.num_requests / self.window_s

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prompt_tokens / self.num_requests if self.num_requests else 0.0

    @property
    def mean_computed_prompt_tokens(self) -> float:
        """Prompt tokens a request needed computed, on average (its prompt less what a prefix cache held)."""
        return (self.prompt_tokens - self.cached_tokens) / self.num_requests if self.num_requests else 0.0

    @property
    def mean_output_tokens(self) -> float:
        return self.output_tokens / self.num_requests if self.num_requests else 0.0


class TrafficWindow:
    """Ended requests over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 60.0, max_requests: int = 100_000) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.window_s = window_s
        self._requests: deque[FinishedRequest] = deque(maxlen=max_requests)
        self._started_s: float | None = None

    def record(self, request: FinishedRequest) -> None:
        if self._started_s is None:
            self._started_s = request.end_s
        self._requests.append(request)

    def start(self, now_s: float) -> None:
        """Mark when observation began: a window younger than ``window_s`` is divided by its age."""
        if self._started_s is None:
            self._started_s = now_s

    def stats(self, now_s: float) -> TrafficStats:
        """What ended in the window ending at ``now_s`` (older entries are dropped)."""
        horizon = now_s - self.window_s
        while self._requests and self._requests[0].end_s < horizon:
            self._requests.popleft()
        started = self._started_s if self._started_s is not None else now_s
        window_s = min(self.window_s, max(now_s - started, 1.0))
        num = prompt = output = cached = 0
        tokens: dict[str, int] = {}
        gaps: dict[str, int] = {}
        busy: dict[str, float] = {}
        for r in self._requests:
            num += 1
            prompt += r.num_prompt_tokens
            output += r.num_output_tokens
            cached += min(r.num_cached_tokens, r.num_prompt_tokens)
            if r.decode is None:
                continue
            tokens[r.decode] = tokens.get(r.decode, 0) + r.num_output_tokens
            num_gaps = r.num_decode_gaps if r.num_decode_gaps is not None else r.num_output_tokens - 2
            if num_gaps > 0 and r.decode_s > 0:
                gaps[r.decode] = gaps.get(r.decode, 0) + num_gaps
                busy[r.decode] = busy.get(r.decode, 0.0) + r.decode_s
        decode = {address: DecodeSample(tokens[address] / window_s, busy[address] / gaps[address],
                                        busy[address] / window_s)
                  for address in gaps}
        return TrafficStats(window_s, num, prompt, output, cached, decode)
