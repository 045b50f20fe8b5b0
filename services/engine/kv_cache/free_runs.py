"""The free never-cached blocks of one pool, as an index of runs of consecutive block ids.

``BlockPool`` hands out fresh blocks from here: the lowest run that fits, or the fewest runs, so
a request's table is a few runs of consecutive ids and its KV transfer a few descriptors.
"""

from __future__ import annotations

from collections.abc import Iterable


class FreeRunIndex:
    """The free never-cached blocks, answering "lowest run of n free blocks" in O(log N).

    A segment tree over block ids. Each node spans a power-of-two range and keeps the length of
    the free run touching its left edge (``pre``), its right edge (``suf``) and the longest run
    inside it (``best``); padding leaves past ``num_blocks`` count as used::

        block    0 1 2 3 | 4 5 6 7        F = free
        free     F F . F | F F . F
        node     pre 2, suf 1, best 2 | pre 2, suf 1, best 2
        root     pre 2, suf 1, best = max(2, 2, suf_left 1 + pre_right 2) = 3   -> run 3..5

    Marking a range used or free rewrites its leaves and their ancestors: O(n + log N).
    """

    def __init__(self, num_blocks: int) -> None:
        size = 1
        while size < num_blocks:
            size *= 2
        self._size = size
        leaves = [1] * num_blocks + [0] * (size - num_blocks)
        self._pre = [0] * size + leaves
        self._suf = [0] * size + leaves
        self._best = [0] * size + leaves
        for node in range(size - 1, 0, -1):
            self._pull(node, size >> node.bit_length())
        self.num_free = num_blocks

    def _pull(self, node: int, half: int) -> None:
        """Recompute ``node`` from its children, each spanning ``half`` leaves."""
        left, right = 2 * node, 2 * node + 1
        pre, suf, best = self._pre, self._suf, self._best
        pre[node] = pre[left] if pre[left] < half else half + pre[right]
        suf[node] = suf[right] if suf[right] < half else half + suf[left]
        best[node] = max(best[left], best[right], suf[left] + pre[right])

    def _set_range(self, lo: int, hi: int, free: bool) -> None:
        value = int(free)
        for leaf in range(self._size + lo, self._size + hi):
            self._pre[leaf] = self._suf[leaf] = self._best[leaf] = value
        first, last, half = (self._size + lo) >> 1, (self._size + hi - 1) >> 1, 1
        while first >= 1:
            for node in range(first, last + 1):
                self._pull(node, half)
            first, last, half = first >> 1, last >> 1, half * 2
        self.num_free += (hi - lo) if free else -(hi - lo)

    def is_free(self, block_id: int) -> bool:
        return self._pre[self._size + block_id] == 1

    def _find_first(self, n: int) -> int | None:
        """Lowest block id starting ``n`` consecutive free blocks, or None."""
        if self._best[1] < n:
            return None
        node, lo, half = 1, 0, self._size // 2
        while node < self._size:
            left = 2 * node
            if self._best[left] >= n:
                node = left
            elif self._suf[left] + self._pre[left + 1] >= n:
                return lo + half - self._suf[left]
            else:
                node, lo = left + 1, lo + half
            half //= 2
        return lo

    def _run_length_from(self, block_id: int, limit: int) -> int:
        length = 0
        while length < limit and block_id + length < self._size and self.is_free(block_id + length):
            length += 1
        return length

    def take(self, n: int, prefer_after: int | None = None) -> tuple[list[int], list[int]]:
        """Mark ``n <= num_free`` blocks used, in as few runs as possible.

        Returns (continuation, rest): the run right after ``prefer_after``, taken when it alone
        fits or when no single run fits anyway, then the rest, from the lowest-addressed run that
        fits or, failing that, the largest runs first (greedy by length gives the fewest runs).
        """
        continuation: list[int] = []
        if prefer_after is not None and n > 0:
            start = prefer_after + 1
            length = self._run_length_from(start, n)
            if length and (length == n or self._best[1] < n):
                self._take_run(start, length, continuation)
        rest: list[int] = []
        while len(continuation) + len(rest) < n:
            need = n - len(continuation) - len(rest)
            start = self._find_first(need)
            if start is None:
                need = self._best[1]
                start = self._find_first(need)
            self._take_run(start, need, rest)
        return continuation, rest

    def _take_run(self, start: int, length: int, taken: list[int]) -> None:
        self._set_range(start, start + length, free=False)
        taken.extend(range(start, start + length))

    def put(self, block_ids: Iterable[int]) -> None:
        """Mark blocks free, one tree update per run of consecutive ids."""
        ordered = sorted(block_ids)
        i = 0
        while i < len(ordered):
            j = i + 1
            while j < len(ordered) and ordered[j] == ordered[j - 1] + 1:
                j += 1
            self._set_range(ordered[i], ordered[j - 1] + 1, free=True)
            i = j
