"""How loaded the engine is, as a router scoring it needs: how fast it computes prompt tokens.

(How many are still to compute is ``Scheduler.num_prefill_tokens_pending``.)
"""

from __future__ import annotations

from services.engine.sched.scheduler_output import SchedulerOutput

#: Weight the sums keep per prefill step: the last ~5 steps dominate the rate.
PREFILL_RATE_DECAY = 0.8


def prompt_tokens_of(output: SchedulerOutput) -> int:
    """Prompt positions a scheduled step computes (a decode row's token is not one)."""
    return sum(max(0, min(c.start + c.num_tokens, c.request.num_prompt_tokens) - c.start) for c in output.chunks)


class PrefillRate:
    """Prompt tokens computed per second of step time over recent prefill steps.

    Decaying sums of tokens and of seconds, so a long step weighs by its length and a burst of tiny
    chunks does not swamp one large prefill; 0 until a prefill step was measured.
    """

    def __init__(self, decay: float = PREFILL_RATE_DECAY) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._tokens = 0.0
        self._seconds = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step that computed ``num_tokens`` prompt tokens in ``seconds``; steps without any are ignored."""
        if num_tokens <= 0 or seconds <= 0.0:
            return
        self._tokens = self._tokens * self.decay + num_tokens
        self._seconds = self._seconds * self.decay + seconds

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0.0 else 0.0
