"""The reader's side (decode): the puller's pipeline (check: ``ticket_shape``, ``state``, ``tickets``; plan:
``pull_plan``, ``pieces``, ``read_targets``; read: ``post_reads``; verify: ``verify``, ``state``; timed by
``stage_clock``), the handshake-time ``topology_check``, peer descriptions and the errors a pull raises. Never
imports ``services.kv.owner``."""
