"""The engine's paged KV cache: the tensors, and the bookkeeping of which blocks each request holds.

Start with ``manager.py``: ``KVCacheManager`` is what the scheduler calls (prefix lookup, then
check-then-act allocation, publish, free / hold / release). A *group* is the layers sharing one
block table; the manager keeps one table per group per request and delegates to, bottom up:

- ``free_runs.py``: ``FreeRunIndex``, a pool's never-cached free blocks as runs of consecutive
  ids, so tables stay contiguous (few transfer descriptors).
- ``block_pool.py``: ``BlockPool``, one group's blocks: reference counts, the free pool, and the
  prefix cache's hash -> block map with LRU eviction of cached-free blocks.
- ``block_hash.py``: the block hash (a pinned, chained encoding other processes recompute) and
  ``BlockHashChains``, each request's chain computed once and shared by the device prefix cache
  and the host tier (``services.engine.offload``).
- ``events.py``: KV events, what the pools' prefix caches store and remove (``KVEventLog``,
  numbered on the engine thread, off unless a subscriber turned it on), for a router's index.
- ``group_managers.py``: ``GroupManager`` and its kinds, ``FullAttentionManager`` and
  ``SlidingWindowManager``: how a group's table grows, which blocks a query still reads, where a
  prefix hit may start; also what a sliding group's placeholder entries are.
- ``prefix_hit.py``: the longest cached prefix every group can serve.
- ``table_plan.py``: one group's part of an allocation, planned without changing anything, then applied.
- ``state_slots.py``: ``StateSlots``, the state-pool row each request of a model with state layers
  (Mamba2) owns beside its blocks.

``buffers.py`` is the torch side: ``KVCache``, the buffers the model runner writes, laid out
from ``services.kv.spec.layout``; ``state_pool.py`` holds the Mamba2 states (``StatePool``). Everything
else here is pure Python.
"""
