"""KV sent per prefill chunk: the computed blocks of a watched prefill, pinned as they become full.

A prefill worker that hands a long prompt's KV out in parts watches its request
(``AsyncEngine.add_request(..., kv_part_align=A)``). After every step, on the engine thread,
``PartWatch.collect`` looks at each watched request that is running: when it has computed past the
next multiple of ``A`` (a block boundary on both sides of the transfer), the blocks of the tokens
since its last part are pinned (``Scheduler.pin_computed``) and reported as a ``PinnedPart``; the
daemon signs the part's ticket on its event loop. The last partial block, and whatever the last step
computed, go with the request's final ticket when it finishes: a part never reaches the prompt's
end. Pinning before the next step matters: a preemption or an abort frees the request's blocks, but
not the pinned ones a reader may be reading.

On a GPU the step that computed a part may still be running when the step returns (prefill chunks
are not waited for), so ``collect`` waits for the device once before it reports any part: a reader's
READ and the owner's digest must see the written KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.engine.request import RequestStatus

if TYPE_CHECKING:
    from services.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class PinnedPart:
    """Tokens ``start .. end`` of a request's prompt are computed and their blocks pinned; ``block_ids``
    is each group's table from token 0 to ``end`` (placeholders included), as a ticket names them."""

    request_id: str
    start: int
    end: int
    block_ids: list[list[int]]


@dataclass
class _Watched:
    align: int
    num_prompt_tokens: int
    pinned_to: int = 0  # end of the last part reported


class PartWatch:
    """The engine thread's record of watched prefills and how far each has been handed out in parts."""

    def __init__(self) -> None:
        self._watched: dict[str, _Watched] = {}

    def watch(self, request_id: str, align: int, num_prompt_tokens: int) -> None:
        """Report ``request_id``'s prompt in parts ending on multiples of ``align`` tokens."""
        if align < 1:
            raise ValueError(f"a KV part alignment of {align} tokens")
        self._watched[request_id] = _Watched(align, num_prompt_tokens)

    def __len__(self) -> int:
        return len(self._watched)

    def collect(self, engine: LLMEngine) -> list[PinnedPart]:
        """The parts the last step completed, pinned; requests that ended are forgotten."""
        due: list[tuple[str, _Watched, int]] = []
        for rid, w in list(self._watched.items()):
            request = engine.scheduler.get_request(rid)
            if request is None or request.status.finished:
                del self._watched[rid]
                continue
            last_part_end = (w.num_prompt_tokens - 1) // w.align * w.align  # the final ticket has the rest
            end = min(request.num_computed_tokens // w.align * w.align, last_part_end)
            if request.status is RequestStatus.RUNNING and end > w.pinned_to:
                due.append((rid, w, end))
        if not due:
            return []
        engine.wait_for_kv_writes()
        parts = []
        for rid, w, end in due:
            tables = engine.pin_kv_part(rid, w.pinned_to, end, w.num_prompt_tokens)
            if tables is not None:
                parts.append(PinnedPart(rid, w.pinned_to, end, tables))
                w.pinned_to = end
        return parts
