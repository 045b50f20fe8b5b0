"""Stop strings on a text stream: cut at the first one, never showing the client part of one."""

from __future__ import annotations


class StopStringMatcher:
    """Cut a streamed text at the first stop string, never showing the client part of one.

    ``feed`` emits text only once no stop string can still begin inside it. The cut is where the
    full text would be cut: at the earliest occurrence of any stop, and among stops starting
    there, the longest. So a complete match is held back while a stop that starts earlier, or a
    longer one starting at the same place, could still complete with the next delta; stopping
    is then delayed by at most the length of the longest stop string.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stops!r}")
        self._stops = stops
        self._pending = ""
        self._matched: str | None = None
        self._finished = False

    @property
    def matched(self) -> str | None:
        """The stop string the text was cut at, once ``feed`` or ``flush`` found one."""
        return self._matched

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add newly detokenized text; return (text safe to emit now, matched stop string or None)."""
        if self._finished:
            raise ValueError("StopStringMatcher fed after it matched or was flushed")
        if not self._stops:
            return delta, None
        text = self._pending + delta
        match = _earliest_match(text, self._stops)
        hold_from = _earliest_partial(text, self._stops)
        if match is not None and (hold_from is None or hold_from > match[0]):
            self._finished = True
            self._matched = match[1]
            self._pending = ""
            return text[: match[0]], match[1]
        if hold_from is None:
            hold_from = len(text)
        self._pending = text[hold_from:]
        return text[:hold_from], None

    def flush(self) -> str:
        """The held-back tail when generation ended; cut before a stop that was waiting to be final."""
        if self._finished:
            return ""
        self._finished = True
        text, self._pending = self._pending, ""
        match = _earliest_match(text, self._stops)
        if match is None:
            return text
        self._matched = match[1]
        return text[: match[0]]


def _earliest_match(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(position, stop) of the earliest complete stop in ``text``, longest first on a tie."""
    best: tuple[int, str] | None = None
    for stop in stops:
        position = text.find(stop)
        if position < 0:
            continue
        if best is None or (position, -len(stop)) < (best[0], -len(best[1])):
            best = (position, stop)
    return best


def _earliest_partial(text: str, stops: tuple[str, ...]) -> int | None:
    """Earliest position from which the rest of ``text`` is a proper prefix of some stop."""
    earliest: int | None = None
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if stop.startswith(text[-length:]):
                position = len(text) - length
                if earliest is None or position < earliest:
                    earliest = position
                break
    return earliest
