"""NIXL transport for KV: register memory, know peers, READ descriptor lists, collect notifications.

One job per module: ``errors`` (what a transfer raises), ``descriptors`` (regions and the
(addr, len, dev) arrays NIXL takes), ``handle`` (one posted READ and its result), ``prepared`` (descriptor
lists NIXL prepared once per peer), ``reader`` (the agent's worker thread that posts and polls READs, and the
job a caller waits on), ``posting`` (which READs are posted on the caller's thread instead, judged by the rates
learnt per peer) and ``agent`` (:class:`TransferAgent`, which ties them to one NIXL agent). Nothing here
knows layouts, blocks or models: the planner turns those into descriptors.
"""
