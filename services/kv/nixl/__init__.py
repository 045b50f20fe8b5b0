"""NIXL transport for KV: register memory, know peers, READ descriptor lists, collect notifications.

One job per module: ``errors`` (what a transfer raises), ``descriptors`` (regions and the
(addr, len, dev) arrays NIXL takes), ``handle`` (one posted READ and its result), ``reader`` (the
agent's worker thread that posts and polls READs) and ``agent`` (:class:`TransferAgent`, which ties
them to one NIXL agent). Nothing here knows layouts, blocks or models: the planner turns those into
descriptors.
"""
