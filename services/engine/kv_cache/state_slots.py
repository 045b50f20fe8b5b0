"""Per-request state slots: which row of the state pool each running request of a state model owns.

Torch-free, owned by ``KVCacheManager``. A model with state layers (Granite-4.0-H's Mamba2) keeps,
per request and state layer, one fixed-size state (``state_pool.py``) instead of KV blocks; the
slot says which. A request gets a slot with its first allocation and gives it back whenever its
blocks go (finish, abort, preemption, a failed pull or load); a hold keeps it with the blocks until
their release (a peer reads the state after the prompt with the KV, or a late READ may still write it).
A request that gets a slot starts from token 0 (state models get no prefix hits), so the
model zeroes a slot's state at a chunk that starts at position 0.
"""

from __future__ import annotations


class StateSlots:
    """``num_slots`` slots, lowest free one first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free slot; ValueError when none is left (check ``num_free`` first)."""
        if not self._free:
            raise ValueError(f"all {self.num_slots} state slots are taken")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not taken")
        self._free.append(slot)
