"""What both sides of a transfer agree on, torch-free: layouts, KV-cache groups, the compatibility identity and
hash, TP and block-size topology, which pairs can work, the engine description and the wire types. The only part
of the KV library the engine and the router import."""
