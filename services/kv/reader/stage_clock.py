"""A pull's stage timer: ``PullResult.stages``, the decode worker's ``pdserve_kv_pull_stage_seconds`` and the
benchmarks read what it records.

Stages are consecutive: ``mark(stage)`` closes the stage that ran since the previous mark (or the start), so they
add up to the whole pull. A sub-stage (``read.<name>``) runs inside one of them, once per rank's READ at the same
time: the largest is kept, and the sub-stages follow the stages in the dict.
"""

from __future__ import annotations

import time
from collections.abc import Mapping


class StageClock:
    """The seconds of a pull's stages, in the order they ran, and of the sub-stages inside them."""

    def __init__(self) -> None:
        self.started = self._last = time.perf_counter()
        self._stages: dict[str, float] = {}
        self._subs: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        """End ``stage`` now: it took the time since the previous mark."""
        now = time.perf_counter()
        self._stages[stage] = now - self._last
        self._last = now

    def sub(self, stage: str, seconds: float) -> None:
        """A sub-stage's seconds; of several concurrent ones of that name (one per READ), the largest."""
        self._subs[stage] = max(self._subs.get(stage, 0.0), seconds)

    def subs(self, prefix: str, stages: Mapping[str, float]) -> None:
        """Each of ``stages`` (e.g. one READ's, ``read_stages``) as the sub-stage ``prefix + name``."""
        for name, seconds in stages.items():
            self.sub(prefix + name, seconds)

    @property
    def seconds(self) -> float:
        """From the start to the last mark."""
        return self._last - self.started

    def stages(self) -> dict[str, float]:
        return {**self._stages, **self._subs}
