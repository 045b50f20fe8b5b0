"""What one request's flow takes and yields: the tokenized request, its deltas, and the facts it gathers.

The router's flow (``flow.py``, ``request_run.py``) turns a ``GenerationRequest`` into ``Delta``s and fills its
``Outcome`` as it goes; ``choices.py``, ``answers.py`` and ``responses.py`` read them into OpenAI answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.proto_gen.pdserve.v1 import worker_pb2
from services.router.prefix_index import PromptKeys


@dataclass(frozen=True)
class GenerationRequest:
    """A validated, tokenized request, ready for the workers."""

    request_id: str
    prompt_token_ids: list[int]
    params: worker_pb2.SamplingParams
    arrival_s: float  # time.monotonic() when the HTTP request arrived
    keep_special_tokens: bool = False  # its text keeps special tokens (tool-call and reasoning markers)
    prompt_keys: PromptKeys | None = None  # its prefix keys, shared by the prompt's choices (else made when routed)


# The most likely tokens at one position, best first: (token id, logprob) pairs.
Alternatives = tuple[tuple[int, float], ...]


def alternatives_of(entry: worker_pb2.TopLogprobs) -> Alternatives:
    return tuple(zip(entry.token_ids, entry.logprobs, strict=True))


@dataclass(frozen=True)
class Delta:
    """What one step adds to the answer; ``finish_reason`` is set on the last one.

    ``top_logprobs`` has one entry per token when alternatives were asked for. ``prompt_logprobs``
    (on the first delta, when asked for) has one entry per prompt token, the first None; each
    entry's first pair is the prompt token itself.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None
    top_logprobs: tuple[Alternatives, ...] = ()
    prompt_logprobs: tuple[Alternatives | None, ...] | None = None


@dataclass
class Outcome:
    """Facts about a request gathered while it streams (usage, route)."""

    num_prompt_tokens: int
    num_generated_tokens: int = 0
    num_cached_tokens: int | None = None
    route: str = ""  # a Route once one was taken; "" while unknown, or when refused (--enforce-disagg)
    recomputed_locally: bool = False
    finish_reason: str | None = None
    workers: Workers | None = None  # the pair that served it (once one was picked)
    # The planner's decode time: when the second token-bearing delta left (the first one the decode worker
    # generated after its pull), and how many tokens left after it (one inter-token gap each).
    decode_start_s: float | None = None
    num_decode_gaps: int = 0


@dataclass(frozen=True)
class Workers:
    """A (prefill, decode) pair by address; prefill is None on the direct route."""

    prefill: str | None
    decode: str
