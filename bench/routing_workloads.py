"""The routing benchmark's workloads, shared by the real-daemon run (``bench/routing.py``) and the simulator
(``bench/routing_sim.py``), so both send the same kind of traffic and count the ideal the same way.

* **shared-prefix**: ``groups`` long system prompts; each request is one group's system prompt plus a short
  question of its own. Group popularity is uniform or Zipf-skewed (weight of the k-th group ``1/(k+1)^s``).
* **multi-turn**: conversations of several turns; each turn's prompt is the previous turn's prompt, the
  answer the model gave, and a new user message, so the whole history is a prefix of the next prompt.
  The answer is only known once the previous turn ended, so a conversation is a script (its user
  messages) that the driver turns into prompts.
* **length mix**: ``bench/serve.py``'s random prompts of mixed lengths: nothing shared, ideal 0.

Prompts are token ids drawn uniformly from ``[100, 30000)`` (inside every bundled vocabulary), seeded.

The ideal is what a perfect router would get from the workers' prefix caches, given pools that hold what
it assigns them (the benches size them so): a shared-prefix request reuses its group's prefix unless it is
the group's first request; a turn after the first reuses its whole history. Caches hold full blocks only
and the engine always computes a prompt's last token, so each reusable length is counted as
``cacheable_tokens``: whole blocks of ``min(shared, prompt - 1)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

TOKEN_LOW, TOKEN_HIGH = 100, 30000
SHARED_PREFIX, MULTI_TURN, LENGTH_MIX = "shared-prefix", "multi-turn", "length-mix"


@dataclass(frozen=True)
class Request:
    """One request of an open-loop workload. ``group``: its shared prefix's group (None: shares nothing);
    ``shared_len``: leading tokens it shares with the other requests of its group."""

    arrival_s: float
    prompt: tuple[int, ...]
    output_len: int
    group: int | None = None
    shared_len: int = 0


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat as a script: the user message of each turn (the first one opens with the system
    prompt), each answered with ``output_len`` tokens; turn 0 is sent at ``start_s``, turn t+1
    ``think_s[t]`` after turn t's answer ended."""

    conversation_id: int
    start_s: float
    messages: tuple[tuple[int, ...], ...]
    output_len: int
    think_s: tuple[float, ...] = ()

    def think_after(self, turn: int) -> float:
        return self.think_s[turn] if turn < len(self.think_s) else 0.0


def random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n))


def arrivals(rng: random.Random, num_requests: int, rate: float) -> list[float]:
    """Poisson arrival times (the first at 0); ``inf`` sends everything at once."""
    times, t = [], 0.0
    for i in range(num_requests):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        times.append(t)
    return times


def zipf_weights(num_groups: int, skew: float) -> list[float]:
    """Normalized popularity of each group: ``1/(k+1)^skew`` (``skew`` 0: uniform)."""
    raw = [1.0 / (k + 1) ** skew for k in range(num_groups)]
    total = sum(raw)
    return [w / total for w in raw]


def shared_prefix(num_requests: int, rate: float, num_groups: int, prefix_len: int, question_len: int,
                  output_len: int, skew: float = 0.0, seed: int = 0) -> list[Request]:
    """Requests of ``num_groups`` system prompts of ``prefix_len`` tokens, each with a fresh question of
    ``question_len`` tokens; the group is drawn by ``zipf_weights(num_groups, skew)``."""
    if min(num_groups, prefix_len, question_len, output_len) < 1:
        raise ValueError("num_groups, prefix_len, question_len and output_len must be >= 1")
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, prefix_len) for _ in range(num_groups)]
    weights = zipf_weights(num_groups, skew)
    groups = rng.choices(range(num_groups), weights, k=num_requests)
    return [Request(t, prefixes[g] + random_tokens(rng, question_len), output_len, g, prefix_len)
            for t, g in zip(arrivals(rng, num_requests, rate), groups, strict=True)]


def length_mix(num_requests: int, rate: float, mix: Sequence[tuple[int, int]], seed: int = 0) -> list[Request]:
    """``bench/serve.py``'s workload: each request a random prompt of a (prompt, output) length pair
    drawn uniformly from ``mix``."""
    rng = random.Random(seed)
    out = []
    for t in arrivals(rng, num_requests, rate):
        prompt_len, output_len = rng.choice(list(mix))
        out.append(Request(t, random_tokens(rng, prompt_len), output_len))
    return out


def multi_turn(num_conversations: int, num_turns: int, rate: float, system_len: int, message_len: int,
               output_len: int, think_s: float = 0.0, seed: int = 0) -> list[Conversation]:
    """Conversations starting at Poisson times; each turn adds a ``message_len``-token user message (the
    first turn also a ``system_len``-token system prompt of its own). The user thinks an exponentially
    drawn time of mean ``think_s`` between an answer and the next message: random gaps, so that turns of
    different conversations do not stay in lockstep (a round-robin router would then keep each one on one
    worker by accident)."""
    if min(num_turns, message_len, output_len) < 1 or system_len < 0:
        raise ValueError("num_turns, message_len and output_len must be >= 1, system_len >= 0")
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(arrivals(rng, num_conversations, rate)):
        messages = [random_tokens(rng, system_len + message_len)]
        messages += [random_tokens(rng, message_len) for _ in range(num_turns - 1)]
        thinks = tuple(rng.expovariate(1 / think_s) if think_s > 0 else 0.0 for _ in range(num_turns - 1))
        out.append(Conversation(i, t, tuple(messages), output_len, thinks))
    return out


def next_prompt(prompt: Sequence[int], answer: Sequence[int], message: Sequence[int]) -> tuple[int, ...]:
    """The next turn's prompt: the history (previous prompt and its answer) then the new message."""
    return (*prompt, *answer, *message)


def max_prompt_len(conversation: Conversation) -> int:
    """The last turn's prompt length: every message and every answer but the last."""
    return sum(map(len, conversation.messages)) + conversation.output_len * (len(conversation.messages) - 1)


def cacheable_tokens(shared_len: int, prompt_len: int, block_size: int) -> int:
    """Tokens a prefix cache can serve of ``shared_len`` reusable leading tokens: whole blocks, and never
    the prompt's last token (the engine computes it to sample from)."""
    usable = min(shared_len, prompt_len - 1)
    return max(usable, 0) // block_size * block_size


def ideal_cached_tokens(requests: Sequence[Request], block_size: int) -> list[int]:
    """Per request (in the given order), what a perfect router gets: the group's prefix, except for the
    group's earliest request (someone computes it once)."""
    seen: set[int] = set()
    out = [0] * len(requests)
    for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival_s):
        r = requests[i]
        if r.group is not None and r.group in seen:
            out[i] = cacheable_tokens(r.shared_len, len(r.prompt), block_size)
        if r.group is not None:
            seen.add(r.group)
    return out


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def pool_blocks(num_held: int, held_len: int, extra_len: int, block_size: int, slack_requests: int = 2) -> int:
    """A prefill worker's KV pool that holds ``num_held`` prefixes of ``held_len`` tokens (their whole
    blocks) plus room for ``slack_requests`` requests' own ``extra_len`` tokens: sized so that a worker
    caches about its share of the prefixes and no more."""
    return num_held * (held_len // block_size) + slack_requests * (blocks_for(extra_len, block_size) + 1)
