"""Tensor-parallel engines: rank 0 schedules and runs in the daemon; ranks 1.. are follower processes.

``group.TPGroup`` (rank 0's side) spawns the followers, agrees on the KV block count and sends
every step to them; ``follower`` is a follower's main loop, which builds the same
``runner.rank_runtime.RankRuntime`` as rank 0; ``messages`` is what travels between them. The KV
transfers of a follower's shard are not the engine's: the worker layer installs a rank service in
each follower (``rank_service``) and stands in for its KV rank on rank 0
(``services.worker.follower_kv_rank``), so the engine imports no NIXL code.
"""
