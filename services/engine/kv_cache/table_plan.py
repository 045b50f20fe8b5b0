"""One group's part of an allocation: what happens to its table, planned first, then applied.

``KVCacheManager.allocate_slots`` plans every group (``plan_group``), checks every plan fits
(``plan_fits``), and only then applies them (``apply_plan``): a failed allocation changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.engine.kv_cache.group_managers import GroupManager


@dataclass(frozen=True)
class GroupPlan:
    """What ``allocate_slots`` will do to one group's table; computed without changing anything.

    ``drop``: indices of the table's blocks that fell out of the window (freed, entry -> P);
    ``hit``: the prefix-hit entries appended (placeholders where even the hit is out of window);
    ``touch``: the real blocks of ``hit`` (one reference each);
    ``num_placeholders`` / ``num_new``: entries appended after, as placeholders then new blocks.
    """

    drop: list[int]
    hit: list[int]
    touch: list[int]
    num_placeholders: int
    num_new: int


def plan_group(m: GroupManager, table: Sequence[int], hit: Sequence[int], skip: int, num_tokens: int) -> GroupPlan:
    """The plan for a table that must cover ``num_tokens`` tokens, its first ``skip`` blocks out of window."""
    placeholder = m.placeholder
    drop = out_of_window(table, skip, placeholder)
    hit = [placeholder if len(table) + i < skip else b for i, b in enumerate(hit)]
    length = len(table) + len(hit)
    target = m.spec.num_blocks_for(num_tokens)
    num_placeholders = max(0, min(skip, target) - length)
    num_new = max(0, target - max(length, skip))
    return GroupPlan(drop, hit, [b for b in hit if b != placeholder], num_placeholders, num_new)


def plan_fits(m: GroupManager, table: Sequence[int], plan: GroupPlan) -> bool:
    """Whether the group's pool can take the plan.

    Freeing out-of-window blocks gives back those nobody else references; reviving a cached-free
    prefix block takes it out of the free pool.
    """
    released = sum(1 for i in plan.drop if m.pool.ref_count(table[i]) == 1)
    return m.pool.num_free_blocks + released >= plan.num_new + m.pool.num_to_revive(plan.touch)


def apply_plan(m: GroupManager, table: list[int], plan: GroupPlan) -> list[int]:
    """Carry out a plan ``plan_fits`` accepted; returns the newly allocated blocks."""
    free_entries(m, table, plan.drop)
    m.pool.touch(plan.touch)
    table.extend(plan.hit)
    table.extend([m.placeholder] * plan.num_placeholders)
    last = table[-1] if table and table[-1] != m.placeholder else None
    blocks = m.pool.allocate(plan.num_new, last)
    assert blocks is not None  # plan_fits checked the pool
    table.extend(blocks)
    return blocks


def num_leading_placeholders(table: Sequence[int], placeholder: int) -> int:
    """Length of the leading run of placeholders."""
    n = 0
    while n < len(table) and table[n] == placeholder:
        n += 1
    return n


def out_of_window(table: Sequence[int], skip: int, placeholder: int) -> list[int]:
    """Indices ``< skip`` of the table still holding blocks, ascending.

    Placeholders are a leading run, so the walk goes back from ``skip - 1`` to the first one:
    O(newly freed), not O(table).
    """
    i = min(skip, len(table)) - 1
    drop = []
    while i >= 0 and table[i] != placeholder:
        drop.append(i)
        i -= 1
    return drop[::-1]


def free_entries(m: GroupManager, table: list[int], indices: Sequence[int]) -> None:
    """Free the blocks at ``indices`` (oldest first: evicted first) and put placeholders there."""
    if not indices:
        return
    m.pool.free([table[i] for i in indices])
    for i in indices:
        table[i] = m.placeholder
