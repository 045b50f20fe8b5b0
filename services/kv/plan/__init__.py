"""From two layouts to descriptors: the descriptor planner, descriptor lists prepared once per peer, staging plans
and the byte runs of state slots. Pure arithmetic over ``services.kv.spec``; nothing here moves bytes."""
