"""Router overhead: the same requests straight to a worker and through the router, side by side in one run.

    python bench/router_overhead.py --model dummy:tiny --bodies 1024,3800 --rounds 4     # CPU check (small prompts)
    python bench/router_overhead.py --make-model build/overhead_model                   # the GPU run's model, once
    python bench/router_overhead.py --device cuda --model build/overhead_model --worker-args "--max-model-len 131072"

One decode worker (``pdserve decode``) and a decode-only router in front of it (``services.launch.spawn``).
Each cell (a body size, a concurrency) sends one prompt whose completion body is that many bytes, with
``max_tokens=1``, greedy: ``--rounds`` rounds of ``concurrency`` requests straight to the worker (gRPC
``Generate`` with the token ids the router's own ``/tokenize`` gives for the text, tokenized before the clock
starts) and then the same through the router (HTTP ``/v1/completions``, streamed, the text prompt), alternating,
so both meet the same worker state; the prompt is the same throughout, so after the warm-up the worker's
prefix cache holds it and TTFT is mostly what sits around the model. Measured at the client: send to the first
token (gRPC chunk with a token, or SSE event). Printed per cell: p50 and p99 of both, the router's added
latency (router - direct, per percentile) and the ratio; and the router's own time per stage from its
``pdserve_router_overhead_seconds`` (mean over the cell's requests), which is what it adds besides the HTTP
hop. The routed side is timed with ``bench/raw_http.py`` (``--client raw``): httpx's own parsing costs ~2 ms a
request on the 2-core build machine, which is the client's, not the router's; ``--client httpx`` measures with it.
The prompt's random short words are about 2 bytes a token, so a 200 KB body is a ~100K-token prompt: the
worker's context (``--max-model-len``) must hold it; on CPU use small bodies (the first command). ``--make-model``
writes ``bench/overhead_model.py``'s model (a random 2-layer Llama with 131072 positions and the bundled SmolLM2
tokenizer, ~8 MB, no transformers needed) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import httpx  # noqa: E402

from bench.raw_http import StreamTimer  # noqa: E402
from services.launch.spawn import start_daemon, start_router, stop_daemon, stop_router  # noqa: E402
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

STAGES_METRIC = "pdserve_router_overhead_seconds"


def _prompt_text(num_bytes: int, seed: int = 0) -> str:
    """Words of plain English letters, about ``num_bytes`` long once in the JSON body."""
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < num_bytes - 80:  # room for the body's other fields
        word = "".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def _direct(stub: worker_pb2_grpc.DecodeWorkerStub, token_ids: list[int], n: int) -> float:
    request = worker_pb2.GenerateRequest(request_id=f"bench-direct-{n}-{time.monotonic_ns()}",
                                         prompt_token_ids=token_ids,
                                         params=worker_pb2.SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    async for chunk in stub.Generate(request, timeout=600):
        if chunk.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("the worker's stream ended without a token")


async def _routed_httpx(http: httpx.AsyncClient, body: bytes) -> float:
    start = time.perf_counter()
    async with http.stream("POST", "/v1/completions", content=body,
                           headers={"content-type": "application/json"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"router answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("the router's stream ended without a token")


def _stage_totals(router_url: str) -> dict[str, tuple[float, float]]:
    """(count, sum) per stage from the router's /metrics."""
    with urllib.request.urlopen(f"{router_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith(STAGES_METRIC + "_count") or line.startswith(STAGES_METRIC + "_sum"):
            name, value = line.rsplit(" ", 1)
            stage = name.split('stage="')[1].split('"')[0]
            out.setdefault(stage, [0.0, 0.0])[name.startswith(STAGES_METRIC + "_sum")] = float(value)
    return {stage: (count, total) for stage, (count, total) in out.items()}


async def _cell(stub, http: httpx.AsyncClient, router_url: str, body_bytes: int, concurrency: int,
                rounds: int, client: str) -> dict:
    text = _prompt_text(body_bytes, seed=body_bytes)
    body = json.dumps({"prompt": text, "max_tokens": 1, "temperature": 0, "stream": True}).encode()
    timer = StreamTimer(router_url, "/v1/completions", body)
    try:
        return await _timed_cell(stub, http, router_url, text, body, concurrency, rounds,
                                 timer.first_event if client == "raw" else partial(_routed_httpx, http, body))
    finally:
        await timer.close()


async def _timed_cell(stub, http: httpx.AsyncClient, router_url: str, text: str, body: bytes, concurrency: int,
                      rounds: int, routed: Callable[[], Awaitable[float]]) -> dict:
    tokenized = await http.post("/tokenize", json={"prompt": text})
    if tokenized.status_code != 200:
        raise SystemExit(f"/tokenize answered {tokenized.status_code}: {tokenized.text}")
    token_ids = tokenized.json()["tokens"]
    for _ in range(2):  # warm-up: the prompt into the worker's prefix cache, the router's paths hot
        await _direct(stub, token_ids, -1)
        await routed()
    before = _stage_totals(router_url)
    direct: list[float] = []
    via_router: list[float] = []
    for r in range(rounds):
        direct += await asyncio.gather(*(_direct(stub, token_ids, r * concurrency + i) for i in range(concurrency)))
        via_router += await asyncio.gather(*(routed() for _ in range(concurrency)))
    after = _stage_totals(router_url)
    stages = {stage: (after[stage][1] - before.get(stage, (0, 0))[1])
              / max(after[stage][0] - before.get(stage, (0, 0))[0], 1) * 1e3 for stage in after}
    row = {"body_bytes": len(body), "prompt_tokens": len(token_ids), "concurrency": concurrency,
           "requests": len(via_router)}
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        d, t = _percentile(direct, q) * 1e3, _percentile(via_router, q) * 1e3
        row.update({f"direct_{name}_ms": round(d, 3), f"router_{name}_ms": round(t, 3),
                    f"added_{name}_ms": round(t - d, 3), f"ratio_{name}": round(t / d, 3)})
    row["direct_mean_ms"] = round(statistics.fmean(direct) * 1e3, 3)
    row["router_stage_mean_ms"] = {stage: round(ms, 3) for stage, ms in stages.items()}
    return row


async def _run(args: argparse.Namespace, decode_address: str, router_url: str) -> list[dict]:
    rows = []
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    async with grpc.aio.insecure_channel(decode_address, options=[("grpc.max_receive_message_length", 64 << 20)]) \
            as channel, httpx.AsyncClient(base_url=router_url, timeout=600, limits=limits) as http:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        for body_bytes in args.bodies:
            for concurrency in args.concurrency:
                rows.append(await _cell(stub, http, router_url, body_bytes, concurrency, args.rounds, args.client))
                _print_row(rows[-1])
    return rows


def _print_row(row: dict) -> None:
    print(f"body {row['body_bytes']:>7} B ({row['prompt_tokens']:>6} tokens) c={row['concurrency']:<3} "
          f"n={row['requests']:<4} | direct p50 {row['direct_p50_ms']:8.2f} p99 {row['direct_p99_ms']:8.2f} ms "
          f"| router p50 {row['router_p50_ms']:8.2f} p99 {row['router_p99_ms']:8.2f} ms "
          f"| added p50 {row['added_p50_ms']:+8.2f} p99 {row['added_p99_ms']:+8.2f} ms "
          f"| ratio p50 {row['ratio_p50']:.2f} p99 {row['ratio_p99']:.2f}", flush=True)
    print("    router stages (mean ms): " + " ".join(f"{s}={ms:.3f}" for s, ms in row["router_stage_mean_ms"].items()),
          flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the worker's and router's --model (default: bundled SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bodies", default="1024,204800", help="completion body sizes in bytes (default 1 KB, 200 KB)")
    p.add_argument("--concurrency", default="1,32", help="concurrent requests per round (default 1,32)")
    p.add_argument("--rounds", type=int, default=8, help="rounds per cell, each side (default 8)")
    p.add_argument("--worker-args", default="", help="more flags for the decode worker, one string")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw",
                   help="the router's HTTP client: raw (bench/raw_http.py, the default: what is timed is the router, "
                        "not a client library) or httpx")
    p.add_argument("--json-out", default=None, help="append the rows as JSON lines to this file")
    p.add_argument("--make-model", default=None, metavar="DIR",
                   help="write the bench's model (bench/overhead_model.py) to DIR and exit")
    args = p.parse_args()
    if args.make_model:
        from bench.overhead_model import make_overhead_model

        print(f"wrote {make_overhead_model(args.make_model)}")
        return 0
    args.bodies = [int(x) for x in args.bodies.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    decode = start_daemon("decode", args.model, "--device", args.device, *shlex.split(args.worker_args))
    try:
        router = start_router(args.model, [], [decode.address], direct_decode_threshold="auto")
        try:
            rows = asyncio.run(_run(args, decode.address, router.local_url))
        finally:
            stop_router(router)
    finally:
        stop_daemon(decode)
    if args.json_out:
        with open(args.json_out, "a") as out:
            for row in rows:
                out.write(json.dumps({"bench": "router_overhead", "device": args.device, "client": args.client,
                                      **row}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
