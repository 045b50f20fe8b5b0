"""Serving benchmark: TTFT, inter-token latency and throughput through the router, disaggregated
(1 prefill + 1 decode worker) vs one colocated worker, side by side; plus the router's added latency.

    python bench/serve.py                                   # bundled SmolLM2 on CPU
    python bench/serve.py --model dummy:llama-3.1-8b --device cuda --num-requests 256 --concurrency 32

Each setup is started fresh (``services.launcher``: real daemons and a real router), driven with a
bounded load of streaming completions (random prompt token ids, ignore_eos, greedy), and stopped.
The colocated setup is the same router with one decode worker that prefills everything itself.
The router's added latency is TTFT through the router minus TTFT of the same request sent straight
to the decode worker over gRPC, one request at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import httpx  # noqa: E402

from bench._common import emit_json  # noqa: E402
from services.launcher import daemons, start_router, stop_router  # noqa: E402
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    stamps = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    done = time.perf_counter()
    return {"ttft": stamps[0] - started if stamps else float("nan"),
            "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)], "latency": done - started}


async def drive(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def bounded(p):
            async with sem:
                return await one_request(client, url, p, max_tokens)

        await one_request(client, url, prompts[0], 4)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*[bounded(p) for p in prompts])
        elapsed = time.perf_counter() - started
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    return {"requests": len(prompts), "seconds": elapsed, "output_tok_s": len(prompts) * max_tokens / elapsed,
            "ttft_p50_ms": _pct(ttft, 0.5) * 1e3, "ttft_p90_ms": _pct(ttft, 0.9) * 1e3,
            "itl_p50_ms": _pct(itl, 0.5) * 1e3, "itl_p90_ms": _pct(itl, 0.9) * 1e3,
            "latency_p50_ms": _pct([r["latency"] for r in results], 0.5) * 1e3}


async def direct_ttft(decode_addr: str, prompt: list[int]) -> float:
    async with grpc.aio.insecure_channel(decode_addr) as ch:
        started = time.perf_counter()
        params = worker_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        async for _ in worker_pb2_grpc.DecodeWorkerStub(ch).Generate(worker_pb2.GenerateRequest(
                request_id=f"direct-{random.random()}", prompt_token_ids=prompt, params=params)):
            return time.perf_counter() - started
    return float("nan")


async def router_ttft(url: str, prompt: list[int]) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        return (await one_request(client, url, prompt, 2))["ttft"]


def router_added_latency(url: str, decode_addr: str, prompts: list[list[int]]) -> float:
    diffs = []
    for p in prompts:
        d = asyncio.run(direct_ttft(decode_addr, p))
        r = asyncio.run(router_ttft(url, p))
        diffs.append(r - d)
    return statistics.median(diffs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="8 requests of 64+8 tokens")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.concurrency, args.prompt_len, args.output_len = 8, 4, 64, 8
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    worker = ("--device", args.device, "--max-num-seqs", str(max(args.concurrency, 8)))

    rows = []
    for setup in ("disaggregated", "colocated"):
        specs = [("decode", args.model, worker)]
        if setup == "disaggregated":
            specs.insert(0, ("prefill", args.model, worker))
        with daemons(*specs) as started:
            prefill = [d.address for d in started if d.role == "prefill"]
            decode = [d.address for d in started if d.role == "decode"]
            router = start_router(args.model, prefill, decode, direct_decode_threshold=0 if prefill else 1 << 30)
            try:
                row = {"setup": setup, "prompt_len": args.prompt_len, "output_len": args.output_len,
                       "concurrency": args.concurrency, **asyncio.run(
                           drive(router.url, prompts, args.output_len, args.concurrency))}
                if setup == "colocated":
                    row["router_added_ms"] = router_added_latency(router.url, decode[0], prompts[:5]) * 1e3
                rows.append(row)
            finally:
                stop_router(router)
    if emit_json(rows, args.json_out, args.json):
        return
    print(f"# serve: {args.num_requests} requests, concurrency {args.concurrency}, "
          f"prompt {args.prompt_len} + output {args.output_len} tokens")
    print(f"{'setup':>14} {'tok/s':>8} {'TTFT p50':>9} {'p90':>8} {'ITL p50':>8} {'p90':>8} {'lat p50':>9}")
    for r in rows:
        print(f"{r['setup']:>14} {r['output_tok_s']:>8.1f} {r['ttft_p50_ms']:>9.1f} {r['ttft_p90_ms']:>8.1f} "
              f"{r['itl_p50_ms']:>8.1f} {r['itl_p90_ms']:>8.1f} {r['latency_p50_ms']:>9.1f}")
    added = [r["router_added_ms"] for r in rows if "router_added_ms" in r]
    if added:
        print(f"router added latency (median TTFT via router minus direct gRPC): {added[0]:.2f} ms")


if __name__ == "__main__":
    main()
