"""The choices of one HTTP request (``n``, times the prompts of a batched completion), run as one stream.

Each choice is its own sequence on the workers. Choices of the same prompt share its KV through the
workers' prefix caches: the first (the leader) runs alone until its first token has come, so the
prompt is prefilled once, then its siblings start on the same (prefill, decode) pair, where the
prompt's full blocks are prefix-cache hits (the prefill worker computes only the last partial
block, the decode worker pulls only that), and each diverges on decode::

    prompt 0:  choice 0 ──prefill──► first token ─┬─► decode ...
                                                  ├─ choice 1: cached prefix ─► decode ...
                                                  └─ choice 2: cached prefix ─► decode ...
    prompt 1:  choice 3 ──prefill──► ...           (prompts run concurrently)

Deltas come out interleaved, tagged with their choice's index. The first failure of any choice ends
the whole stream (the caller reports it); closing the stream cancels every choice, whose own
clean-up (Abort, Release) runs then.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from services.router.flow import Dispatcher
from services.router.generation import Delta, GenerationRequest, Outcome


@dataclass(frozen=True)
class Choice:
    index: int  # in the response: prompt_index * n + i, as OpenAI numbers a batch's choices
    prompt_index: int
    request: GenerationRequest
    outcome: Outcome


async def stream_choices(dispatcher: Dispatcher, choices: Sequence[Choice]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) until every choice has finished; raises the first choice's failure."""
    if len(choices) == 1:
        only = choices[0]
        async with aclosing(dispatcher.stream(only.request, only.outcome)) as deltas:
            async for delta in deltas:
                yield only.index, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | None, BaseException | None]] = asyncio.Queue()
    leaders: dict[int, Choice] = {}
    for choice in choices:
        leaders.setdefault(choice.prompt_index, choice)
    leader_started = {p: asyncio.Event() for p in leaders}

    async def pump(choice: Choice) -> None:
        leads = leaders[choice.prompt_index] is choice
        try:
            affinity = None
            if not leads:
                await leader_started[choice.prompt_index].wait()
                affinity = leaders[choice.prompt_index].outcome.workers
            async with aclosing(dispatcher.stream(choice.request, choice.outcome, affinity)) as deltas:
                async for delta in deltas:
                    queue.put_nowait((choice.index, delta, None))
                    if leads:
                        leader_started[choice.prompt_index].set()
        except Exception as exc:
            queue.put_nowait((choice.index, None, exc))
        finally:
            if leads:  # failed or done without a token: the siblings go on their own
                leader_started[choice.prompt_index].set()

    tasks = [asyncio.create_task(pump(choice), name=f"pdserve-choice-{choice.request.request_id}")
             for choice in choices]
    try:
        unfinished = len(choices)
        while unfinished:
            index, delta, failure = await queue.get()
            if failure is not None:
                raise failure
            assert delta is not None
            yield index, delta
            if delta.finish_reason is not None:
                unfinished -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
