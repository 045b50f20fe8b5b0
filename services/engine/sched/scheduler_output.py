"""What the scheduler hands out: a step's chunks (``SchedulerOutput``), the placeholder token of a step in flight,
and its prefix-cache counters. The model runner's own step types are ``runner.step``."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.request import Request

# The token of a sampling chunk whose step is still running (``Scheduler.advance``); never a real id.
PLACEHOLDER_TOKEN = -1


@dataclass(frozen=True)
class ScheduledChunk:
    """Run ``request.all_token_ids[start:start + num_tokens]`` at positions ``start..``.

    ``samples`` is True when the chunk reaches the request's newest token, so the logits at its
    last position give the next token::

        all_token_ids  t0 t1 t2 t3 t4 t5        request.num_tokens = 6
        chunk          start=0, num_tokens=2 -> t0 t1,       samples=False (prefill continues)
        chunk          start=2, num_tokens=4 -> t2 t3 t4 t5, samples=True  (logits at t5)
    """

    request: Request
    start: int
    num_tokens: int
    samples: bool

    # What the model runner reads (``runner.step.Chunk``); a TP follower rebuilds the same from a message.
    @property
    def token_ids(self) -> list[int]:
        """The chunk's tokens, sliced without building the request's whole token list."""
        r, start, end = self.request, self.start, self.start + self.num_tokens
        prompt = r.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        n = len(prompt)
        return prompt[start:] + r.output_token_ids[max(start - n, 0): end - n]

    @property
    def block_ids(self) -> list[list[int]]:
        return self.request.block_ids

    @property
    def state_slot(self) -> int | None:
        return self.request.state_slot

    @property
    def kv_rounding(self) -> str:
        return self.request.kv_rounding

    @property
    def return_logits(self) -> bool:
        """Whether every position's logits are kept: asked for, or they hold prompt logprobs."""
        p = self.request.sampling_params
        return p.return_logits or (p.prompt_logprobs is not None and self.start < self.request.num_prompt_tokens - 1)


@dataclass
class PrefixCacheStats:
    """Prefix lookups of admitted requests per tier (``hits`` + ``misses`` = lookups) and tokens served.

    The host tier is consulted only for what the device tier missed: a host hit is a request whose
    prefix reached past its device hit.
    """

    device_hits: int = 0
    device_misses: int = 0
    device_hit_tokens: int = 0
    host_hits: int = 0
    host_misses: int = 0
    host_hit_tokens: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    # Preempted this step: their blocks are gone; they will be recomputed from token 0.
    preempted_request_ids: tuple[str, ...]
    # Finished (or aborted) since the previous step: the runner can drop their per-request state.
    finished_request_ids: tuple[str, ...]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def check_sample(request_id: str, sample: tuple[int, float | None] | None) -> None:
    """Refuse a missing or impossible sampled token (id, logprob) before it changes anything."""
    if sample is None:
        raise ValueError(f"no sampled token for request {request_id!r}")
    token_id = sample[0]
    if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < 2**32:
        raise ValueError(f"request {request_id!r}: bad token id {token_id!r}")
