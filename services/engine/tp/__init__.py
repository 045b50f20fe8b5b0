"""Tensor-parallel engines: rank 0 schedules and runs in the daemon; ranks 1.. are follower processes.

``group.TPGroup`` (rank 0's side) spawns the followers, agrees on the KV block count, sends every
step to them, and stands in for their KV ranks (``remote_rank.FollowerKVRank``) so the KV
library can pull into, or publish, each rank's own shard. ``follower`` is a follower's main
loop; ``messages`` is what travels between them.
"""
