"""Markers in a streamed text: find the next one, and hold back a tail that may still grow into one.

The tool-call and reasoning parsers cut generated text at markers (``<tool_call>``, ``</think>``,
``<|channel|>``) that arrive split over any number of deltas. A parser emits text only up to
``hold_start``: the tail from there could be the first characters of a marker, so it waits for
the next delta (or the end of generation) to tell. The markers of one scan never contain one
another, so the first complete marker found is the one the whole text would be cut at.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(position, marker) of the earliest complete marker at or after ``start``, longest first on a tie."""
    best: tuple[int, str] | None = None
    for marker in markers:
        position = text.find(marker, start)
        if position >= 0 and (best is None or (position, -len(marker)) < (best[0], -len(best[1]))):
            best = (position, marker)
    return best


def hold_start(text: str, markers: Sequence[str]) -> int:
    """Where the tail of ``text`` that is a proper prefix of some marker begins (``len(text)`` if none)."""
    earliest = len(text)
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:length]):
                earliest = min(earliest, len(text) - length)
                break
    return earliest


def search_from(text: str, markers: Sequence[str]) -> int:
    """Where a later search for ``markers`` in ``text`` grown may start: none can begin before this."""
    return max(0, len(text) - max(len(marker) for marker in markers) + 1)
