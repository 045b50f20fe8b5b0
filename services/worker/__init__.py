"""Daemon glue both worker daemons (services/prefill, services/decode) share; they never import each other.

- ``daemon.py``: the skeleton of a worker daemon: bind the gRPC server (cluster token, mTLS), address,
  engine id and epoch, KV ranks, the engine thread, /metrics and engine stats, the ready line, SIGTERM
  drain, shutdown. Each daemon adds only its :class:`~services.worker.daemon.Role` (its servicers).
- ``grpc_server.py``: the grpc.aio server with grpc.health.v1, in-flight counting and the drain that stops it.
- ``receive_limit.py``: the server's receive limit, the largest message a worker can legitimately get.
- ``role_switch.py``: the role served now, a switch between roles, and each role's drain (a switch's or a stop's).
- ``switch_rpc.py``, ``drain_rpc.py``: the ``SwitchRole`` and ``Drain`` RPCs, mixed into both servicers.
- ``worker_info.py``: the Info RPC's answer (identity, compatibility, load).
- ``kv_ranks.py``: one KV rank (NIXL agent and KV shard) per TP rank, and going down with the TP group.
- ``follower_kv_rank.py``: rank 0's proxies for the follower TP ranks' KV shards and NIXL agents.
- ``follower_kv_service.py``: the service in each follower TP process that runs its shard's NIXL agent.

Torch-free plumbing both daemons and the router use (addresses, TLS, auth, metrics) is services.common's.
"""
