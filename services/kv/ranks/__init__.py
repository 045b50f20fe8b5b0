"""One TP rank's registered KV as both sides use it: the ``KVRank`` protocol and ``LocalKVRank`` (its NIXL agent,
buffers, digest runner), and the rank's staging area with its gather and scatter."""
