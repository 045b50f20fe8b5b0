"""Several synthetic KV owners (``bench.kv_synthetic``) in one process, for ``bench/transfer.py --quick``.

Each owner process pays its imports and NIXL start-up (seconds of CPU); the CI smoke run's pulls take
milliseconds, so one process serves every owner of a scenario there. Each engine keeps its own NIXL
agents, gRPC handshake and tickets, prints its own lines as ``bench.kv_synthetic`` does (a hello line
names its engine only through its tickets), and all exit when stdin closes.

    python -m bench.transfer_owners '<json list of bench.kv_synthetic configs>'
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from bench.kv_synthetic import serve


async def serve_all(cfgs: list[dict]) -> None:
    # Every engine blocks a worker of the default executor on reading stdin until it closes; the rest
    # (digests, staging copies) need workers of their own.
    workers = len(cfgs) + (os.cpu_count() or 1) + 4
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=workers))
    await asyncio.gather(*(serve(cfg) for cfg in cfgs))


if __name__ == "__main__":
    asyncio.run(serve_all(json.loads(sys.argv[1])))
