"""The reader's side (decode): the puller (check, plan, read, verify), ticket checks, the pull's state and digest
verification, peer descriptions and the errors a pull raises. Never imports ``services.kv.owner``."""
