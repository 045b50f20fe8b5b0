"""Serving benchmark: 1P1D (prefill on one GPU, decode on another) against two colocated replicas (one per
GPU) at the same request rate, on the same requests, in one run; plus the router's added latency.

    python bench/serve.py --quick                           # CPU smoke: bundled SmolLM2, a few short requests
    python bench/serve.py                                   # bundled SmolLM2 on CPU, a small CPU workload
    python bench/serve.py --device cuda --model dummy:llama-3.1-8b --gpus 0,1 --request-rate 4 --num-requests 200
    python bench/serve.py --device cuda --model dummy:llama-3.1-8b --mix 1024:256,4096:128 --request-rate 2 \\
        --slo-ttft-ms 1000 --slo-itl-ms 40 --json-out serve.jsonl

Setups (each started fresh with ``services.launch.spawn``: real daemons, a real router, then stopped):

* ``1p1d``: one prefill worker on device A, one decode worker on device B, the router pairing them with
  ``--direct-decode-threshold 0``, so every request is disaggregated (prefill on A, KV pulled to B).
* ``2x-colocated``: two decode workers, one on A and one on B, no prefill worker; the router's
  direct-decode threshold is huge, so each decode worker prefills its own requests, and the router
  balances requests across the two (least outstanding requests).

Both use two devices, so the comparison is per pair of GPUs. ``--gpus A,B`` picks them (default 0,1 with
``--device cuda``); with fewer than two GPUs visible ``--gpus 0,0`` runs both workers of each setup on one
GPU (then pass ``--num-kv-blocks`` so two KV pools fit) and the output says loudly that it is not the
two-GPU comparison. On CPU every worker is on ``cpu`` (the two setups then only share the same cores).

Workload (identical for both setups): open loop, Poisson arrivals at ``--request-rate`` req/s (seeded;
the same arrival schedule and the same requests for each setup; ``inf`` sends everything at once),
``--num-requests`` requests; each picks a (prompt_len, output_len) pair uniformly at random from
``--mix`` (``P:O,P:O,...``). Prompts are random token ids; each request is a streaming
``/v1/completions`` with greedy sampling, ``ignore_eos`` and ``max_tokens`` = its output length, and
``logprobs=0`` with ``return_tokens_as_token_ids`` so every token arrives in a chunk that says how many
tokens it carries (with dummy weights the text can be empty, and empty-text chunks are otherwise held
back). Workers get ``--max-model-len`` = the mix's longest prompt + output and ``--max-num-seqs``.
Before timing, each setup serves a warm-up pair of short requests per prompt length of the mix.

Metrics per setup: completed and failed requests (a request fails on an HTTP error, an error event in
the stream, a broken connection, the ``--request-timeout-s`` deadline, or fewer tokens than asked
for; failures are counted and listed, never dropped), duration (first arrival to last completion),
request and output-token throughput, TTFT, ITL and end-to-end latency p50/p99. TTFT is from sending
the request to the first token's chunk; ITL is the gap between token chunks, split evenly over the
tokens of a chunk that carries several.

SLO and goodput: a request meets the SLO when it completed, its TTFT <= ``--slo-ttft-ms`` and its
*mean* ITL (TPOT: (last token - first token) / (tokens - 1)) <= ``--slo-itl-ms``. Goodput is the
number of requests that met it divided by the duration (req/s); per GPU it is divided by the number
of distinct GPUs the setup used (2, both setups). Defaults: TTFT 2000 ms and mean ITL 50 ms on GPU
(an 8B model on H100/H200 class GPUs); 10000 ms and 1000 ms on CPU, where only relative numbers mean
anything. The table prints 1p1d / 2x-colocated ratios for throughput, goodput, TTFT and ITL.

Router added latency (2x-colocated run, after the load): TTFT of a short request through the router
minus the mean TTFT of the same request sent straight to each decode worker over gRPC, one request at
a time, median over a few prompts; connections are open and every prompt was sent once each way
first, so neither side pays a connect or a prefix-cache miss.

Exit status 1 when a setup could not run (its row says why); failed requests are reported, not fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import shlex
import statistics
import sys
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import httpx  # noqa: E402

from bench._common import emit_json  # noqa: E402
from services.launch.spawn import Daemon, DaemonFailed, daemons, start_router, stop_router  # noqa: E402
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

GPU_MIX = "512:128,2048:256,8192:64"
CPU_MIX = "64:16,256:32,512:8"
QUICK_MIX = "32:4,64:8"
# (num_requests, request_rate) by workload
DEFAULT_LOAD = {"gpu": (200, 4.0), "cpu": (16, 0.5), "quick": (8, 2.0)}
DEFAULT_SLO_MS = {"gpu": (2000.0, 50.0), "cpu": (10000.0, 1000.0)}  # (TTFT, mean ITL)
SETUPS = ("1p1d", "2x-colocated")
NO_DIRECT = 0  # --direct-decode-threshold: every request goes through a prefill worker
ALWAYS_DIRECT = 1 << 30  # every prompt is "short": decode workers prefill it themselves


@dataclass(frozen=True)
class Request:
    arrival_s: float  # offset from the start of the run
    prompt: list[int]
    output_len: int


def parse_mix(text: str) -> list[tuple[int, int]]:
    mix = []
    for item in text.split(","):
        prompt_len, _, output_len = item.strip().partition(":")
        try:
            pair = (int(prompt_len), int(output_len))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad mix entry {item!r}: expected PROMPT_LEN:OUTPUT_LEN") from None
        if min(pair) < 1:
            raise argparse.ArgumentTypeError(f"bad mix entry {item!r}: lengths must be >= 1")
        mix.append(pair)
    return mix


def make_workload(mix: list[tuple[int, int]], num_requests: int, rate: float, seed: int) -> list[Request]:
    """Poisson arrivals (exponential gaps, the first request at 0) and uniformly chosen lengths, seeded."""
    rng = random.Random(seed)
    requests, t = [], 0.0
    for i in range(num_requests):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        prompt_len, output_len = rng.choice(mix)
        requests.append(Request(t, [rng.randrange(100, 30000) for _ in range(prompt_len)], output_len))
    return requests


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return float("nan")
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


# ---- one request -------------------------------------------------------------------------------


def _failed(error: str, started: float) -> dict:
    return {"ok": False, "error": error, "latency": time.perf_counter() - started}


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                      timeout_s: float) -> dict:
    """Stream one completion; token chunk arrival stamps give TTFT and ITL. Never raises."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "stream_options": {"include_usage": True}}
    chunks: list[tuple[float, int]] = []  # (arrival, tokens in the chunk)
    usage = None
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return _failed(f"HTTP {response.status_code}: {text}", started)
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    return _failed(f"error event: {error.get('message') if isinstance(error, dict) else error}",
                                   started)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    logprobs = choice.get("logprobs")
                    n = len(logprobs["tokens"]) if logprobs else int(bool(choice.get("text")))
                    if n:
                        chunks.append((now, n))
    except TimeoutError:
        return _failed(f"timeout after {timeout_s:g} s", started)
    except (httpx.HTTPError, OSError, ValueError) as e:
        return _failed(f"{type(e).__name__}: {e}", started)
    done = time.perf_counter()
    tokens = sum(n for _, n in chunks)
    if usage is not None and usage.get("completion_tokens") != tokens:
        return _failed(f"usage says {usage.get('completion_tokens')} tokens, stream carried {tokens}", started)
    if tokens != max_tokens:
        return _failed(f"{tokens} of {max_tokens} tokens", started)
    itl = [(b - a) / n for (a, _), (b, n) in zip(chunks, chunks[1:], strict=False) for _ in range(n)]
    first, last = chunks[0][0], chunks[-1][0]
    return {"ok": True, "ttft": first - started, "itl": itl, "tpot": (last - first) / (tokens - 1) if tokens > 1
            else 0.0, "latency": done - started, "tokens": tokens}


# ---- a setup's run -----------------------------------------------------------------------------


def _client(timeout_s: float) -> httpx.AsyncClient:
    # No connection cap: an open loop must not queue requests in the client's pool.
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def warm_up(url: str, prompt_lens: list[int], timeout_s: float) -> None:
    """Two concurrent short requests per prompt length (the router puts them on different replicas)."""
    rng = random.Random(-1)
    async with _client(timeout_s) as client:
        for prompt_len in sorted(set(prompt_lens)):
            results = await asyncio.gather(*[
                one_request(client, url, [rng.randrange(100, 30000) for _ in range(prompt_len)], 4, timeout_s)
                for _ in range(2)])
            bad = [r["error"] for r in results if not r["ok"]]
            if bad:
                raise RuntimeError(f"warm-up request of {prompt_len} prompt tokens failed: {bad[0]}")


async def drive(url: str, workload: list[Request], timeout_s: float) -> tuple[list[dict], float]:
    """Send each request at its arrival time (open loop); (results in workload order, duration)."""
    async with _client(timeout_s) as client:
        t0 = time.perf_counter()

        async def at(req: Request) -> dict:
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
            lag = time.perf_counter() - t0 - req.arrival_s
            return {**await one_request(client, url, req.prompt, req.output_len, timeout_s), "send_lag": lag}

        results = await asyncio.gather(*[at(r) for r in workload])
        return results, time.perf_counter() - t0


def summarize(results: list[dict], duration: float, slo_ttft_s: float, slo_itl_s: float, num_gpus: int) -> dict:
    ok = [r for r in results if r["ok"]]
    good = [r for r in ok if r["ttft"] <= slo_ttft_s and r["tpot"] <= slo_itl_s]
    ttft, itl = [r["ttft"] for r in ok], [x for r in ok for x in r["itl"]]
    latency, tpot = [r["latency"] for r in ok], [r["tpot"] for r in ok]
    goodput = len(good) / duration
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": dict(Counter(r["error"] for r in results if not r["ok"]).most_common(5)),
        "duration_s": duration, "req_s": len(ok) / duration,
        "output_tok_s": sum(r["tokens"] for r in ok) / duration,
        "slo_met": len(good), "goodput_req_s": goodput, "goodput_per_gpu_req_s": goodput / num_gpus if num_gpus
        else None,
        "ttft_p50_ms": percentile(ttft, 0.5) * 1e3, "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
        "itl_p50_ms": percentile(itl, 0.5) * 1e3, "itl_p99_ms": percentile(itl, 0.99) * 1e3,
        "tpot_p50_ms": percentile(tpot, 0.5) * 1e3, "tpot_p99_ms": percentile(tpot, 0.99) * 1e3,
        "e2e_p50_ms": percentile(latency, 0.5) * 1e3, "e2e_p99_ms": percentile(latency, 0.99) * 1e3,
        "max_send_lag_ms": max(r["send_lag"] for r in results) * 1e3,
    }


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page as {``name{labels}``: value}; empty when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def sample(samples: dict[str, float], name: str, **labels: str) -> float | None:
    """The value of the series ``name`` whose labels include ``labels`` (in any order), else None."""
    wanted = {f'{k}="{v}"' for k, v in labels.items()}
    for key, value in samples.items():
        series, _, rest = key.partition("{")
        if series == name and wanted <= set(rest.rstrip("}").split(",")):
            return value
    return None


def finished_on(d: Daemon) -> int | None:
    """Requests the worker finished so far (its /metrics), None when it cannot be read."""
    value = sample(scrape(f"http://127.0.0.1:{d.metrics_port}/metrics"), "pdserve_requests_total",
                   role=d.role, outcome="finished")
    return None if value is None else int(value)


def routes_of(router_url: str) -> dict[str, int]:
    samples = scrape(f"{router_url}/metrics")
    counts = {route: sample(samples, "pdserve_router_routed_requests_total", route=route)
              for route in ("disaggregated", "direct", "fallback")}
    return {route: int(v) for route, v in counts.items() if v is not None}


# ---- router added latency ----------------------------------------------------------------------


async def direct_ttft(stub: worker_pb2_grpc.DecodeWorkerStub, prompt: list[int]) -> float:
    """TTFT of ``prompt`` sent straight to a decode worker (same params as through the router)."""
    params = worker_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=True)
    started, ttft = time.perf_counter(), float("nan")
    async for _ in stub.Generate(worker_pb2.GenerateRequest(request_id=f"direct-{uuid.uuid4().hex}",
                                                            prompt_token_ids=prompt, params=params)):
        if math.isnan(ttft):
            ttft = time.perf_counter() - started
    return ttft


async def router_added_latency(url: str, decode_addrs: list[str], prompts: list[list[int]]) -> float:
    """Median over ``prompts`` of TTFT via the router minus the mean direct TTFT over the replicas (the
    router may pick any). Channels and the HTTP connection are opened and each prompt is sent once
    both ways before it is timed, so neither side pays a connect or a prefix-cache miss."""
    channels = [grpc.aio.insecure_channel(addr) for addr in decode_addrs]
    stubs = [worker_pb2_grpc.DecodeWorkerStub(ch) for ch in channels]
    try:
        async with _client(60) as client:
            async def via_router(prompt: list[int]) -> float:
                result = await one_request(client, url, prompt, 2, 60)
                if not result["ok"]:
                    raise RuntimeError(f"router added latency probe: {result['error']}")
                return result["ttft"]

            diffs = []
            for i, prompt in enumerate(prompts):
                for stub in stubs:
                    await direct_ttft(stub, prompt)
                await via_router(prompt)
                if i % 2:  # alternate which side goes first
                    routed = await via_router(prompt)
                    direct = [await direct_ttft(stub, prompt) for stub in stubs]
                else:
                    direct = [await direct_ttft(stub, prompt) for stub in stubs]
                    routed = await via_router(prompt)
                diffs.append(routed - statistics.mean(direct))
    finally:
        for ch in channels:
            await ch.close()
    return statistics.median(diffs)


# ---- setups ------------------------------------------------------------------------------------


def run_setup(setup: str, args, devices: tuple[str, str], worker_argv: tuple[str, ...],
              workload: list[Request], num_gpus: int) -> dict:
    if setup == "1p1d":
        specs = [("prefill", args.model, ("--device", devices[0], *worker_argv)),
                 ("decode", args.model, ("--device", devices[1], *worker_argv))]
    else:
        specs = [("decode", args.model, ("--device", device, *worker_argv)) for device in devices]
    row = {"kind": "setup", "setup": setup, "workers": [f"{role}@{extra[1]}" for role, _, extra in specs]}
    print(f"# {setup}: starting {', '.join(row['workers'])}", file=sys.stderr, flush=True)
    try:
        with daemons(*specs) as started:
            prefill = [d.address for d in started if d.role == "prefill"]
            decode = [d for d in started if d.role == "decode"]
            router = start_router(args.model, prefill, [d.address for d in decode],
                                  direct_decode_threshold=NO_DIRECT if prefill else ALWAYS_DIRECT)
            try:
                asyncio.run(warm_up(router.url, [len(r.prompt) for r in workload], args.request_timeout_s))
                before = [finished_on(d) for d in decode]
                routes_before = routes_of(router.url)
                results, duration = asyncio.run(drive(router.url, workload, args.request_timeout_s))
                row.update(summarize(results, duration, args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3, num_gpus))
                after = [finished_on(d) for d in decode]
                row["decode_finished"] = [None if None in (a, b) else a - b for a, b in zip(after, before, strict=True)]
                row["routes"] = {k: v - routes_before.get(k, 0) for k, v in routes_of(router.url).items()}
                if setup != "1p1d":
                    rng = random.Random(1)
                    prompts = [[rng.randrange(100, 30000) for _ in range(64)] for _ in range(3 if args.quick else 7)]
                    try:
                        row["router_added_ms"] = asyncio.run(router_added_latency(
                            router.url, [d.address for d in decode], prompts)) * 1e3
                    except (RuntimeError, grpc.RpcError) as e:
                        row["router_added_error"] = str(e)
            finally:
                stop_router(router)
    except (DaemonFailed, RuntimeError) as e:
        row["error"] = str(e)
        print(f"# {setup}: could not run: {e}", file=sys.stderr, flush=True)
    return row


RATIO_FIELDS = ("req_s", "output_tok_s", "goodput_req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms")


def ratio_row(rows: list[dict]) -> dict | None:
    by = {r["setup"]: r for r in rows if "error" not in r}
    if set(by) != set(SETUPS):
        return None
    a, b = by["1p1d"], by["2x-colocated"]

    def ratio(x: float, y: float) -> float:
        return x / y if y else (float("nan") if not x else float("inf"))

    return {"kind": "ratio", "setup": "1p1d/2x-colocated", **{k: ratio(a[k], b[k]) for k in RATIO_FIELDS}}


# ---- devices and arguments ---------------------------------------------------------------------


def resolve_devices(args) -> tuple[tuple[str, str], int, str | None]:
    """(device A, device B), distinct GPUs used, and a note to print loudly (or None)."""
    device = args.device.strip()
    if device not in ("auto", "cpu", "cuda"):
        sys.exit(f"--device {device}: expected auto, cpu or cuda (pick GPUs with --gpus A,B)")
    visible = 0
    if device != "cpu":
        from services.launch.placement import detect_gpus

        visible = detect_gpus()
        if device == "cuda" and not visible:
            sys.exit("--device cuda: no CUDA device is visible")
    if not visible:
        if args.gpus:
            print("# note: --gpus is ignored on CPU", file=sys.stderr)
        return ("cpu", "cpu"), 0, None
    try:
        gpus = [int(g) for g in (args.gpus or "0,1").split(",")]
    except ValueError:
        gpus = []
    if len(gpus) != 2:
        sys.exit(f"--gpus {args.gpus}: expected two GPU indices A,B")
    if max(gpus) >= visible or min(gpus) < 0:
        hint = " (only one GPU: --gpus 0,0 runs both workers on it, which is not the two-GPU comparison)" \
            if visible == 1 else ""
        sys.exit(f"--gpus {','.join(map(str, gpus))}: {visible} CUDA device(s) visible{hint}")
    note = None
    if gpus[0] == gpus[1]:
        if args.num_kv_blocks is None:
            sys.exit(f"--gpus {gpus[0]},{gpus[1]}: both workers of a setup share one GPU; pass --num-kv-blocks so "
                     "their two KV pools fit (each sizes its pool from the free memory otherwise)")
        note = (f"!!! NOTE: both workers of each setup run on ONE GPU (cuda:{gpus[0]}): this is NOT the two-GPU "
                "1P1D vs 2x-colocated comparison; the two setups only share one device's time. !!!")
    return (f"cuda:{gpus[0]}", f"cuda:{gpus[1]}"), len(set(gpus)), note


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto: cuda when visible)")
    ap.add_argument("--gpus", default=None, metavar="A,B",
                    help="GPU of the prefill (1p1d) / first replica, and of the decode / second replica (default 0,1)")
    ap.add_argument("--request-rate", type=float, default=None,
                    help=f"Poisson arrivals per second, or inf (default GPU {DEFAULT_LOAD['gpu'][1]:g}, "
                         f"CPU {DEFAULT_LOAD['cpu'][1]:g}, --quick {DEFAULT_LOAD['quick'][1]:g})")
    ap.add_argument("--num-requests", type=int, default=None,
                    help=f"default GPU {DEFAULT_LOAD['gpu'][0]}, CPU {DEFAULT_LOAD['cpu'][0]}, "
                         f"--quick {DEFAULT_LOAD['quick'][0]}")
    ap.add_argument("--mix", type=parse_mix, default=None, metavar="P:O,...",
                    help=f"prompt_len:output_len pairs, picked uniformly (default GPU {GPU_MIX}, CPU {CPU_MIX}, "
                         f"--quick {QUICK_MIX})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrivals, lengths and prompt ids")
    ap.add_argument("--slo-ttft-ms", type=float, default=None,
                    help=f"default GPU {DEFAULT_SLO_MS['gpu'][0]:g}, CPU {DEFAULT_SLO_MS['cpu'][0]:g}")
    ap.add_argument("--slo-itl-ms", type=float, default=None,
                    help="bound on a request's mean ITL (TPOT) "
                         f"(default GPU {DEFAULT_SLO_MS['gpu'][1]:g}, CPU {DEFAULT_SLO_MS['cpu'][1]:g})")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="every worker's --max-num-seqs")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="every worker's --num-kv-blocks (needed when both workers share a GPU)")
    ap.add_argument("--worker-args", default="", help='more worker flags, e.g. "--enforce-eager"')
    ap.add_argument("--request-timeout-s", type=float, default=600.0, help="a request slower than this fails")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"which of {','.join(SETUPS)} to run")
    ap.add_argument("--quick", action="store_true",
                    help=f"CPU smoke: {DEFAULT_LOAD['quick'][0]} requests of {QUICK_MIX}, fewer router probes")
    ap.add_argument("--json", action="store_true", help="print JSON lines (one per setup, one of ratios)")
    ap.add_argument("--json-out", default=None, help="also write the JSON lines to this file")
    args = ap.parse_args(argv)
    unknown = set(args.setups.split(",")) - set(SETUPS)
    if unknown:
        ap.error(f"--setups: unknown {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices, num_gpus, note = resolve_devices(args)
    kind = "cpu" if devices[0] == "cpu" else "gpu"
    load = "quick" if args.quick else kind
    args.num_requests = args.num_requests or DEFAULT_LOAD[load][0]
    args.request_rate = args.request_rate or DEFAULT_LOAD[load][1]
    if args.num_requests < 1 or args.request_rate <= 0:
        sys.exit("--num-requests and --request-rate must be positive")
    mix = args.mix or parse_mix(QUICK_MIX if args.quick else CPU_MIX if kind == "cpu" else GPU_MIX)
    args.slo_ttft_ms = args.slo_ttft_ms or DEFAULT_SLO_MS[kind][0]
    args.slo_itl_ms = args.slo_itl_ms or DEFAULT_SLO_MS[kind][1]
    max_model_len = max(p + o for p, o in mix)
    worker_argv = ("--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(max_model_len),
                   *(("--num-kv-blocks", str(args.num_kv_blocks)) if args.num_kv_blocks else ()),
                   *shlex.split(args.worker_args))
    workload = make_workload(mix, args.num_requests, args.request_rate, args.seed)
    header = [
        f"# serve: {args.model or 'bundled SmolLM2-135M-Instruct'}, devices A={devices[0]} B={devices[1]}; "
        f"{args.num_requests} requests, Poisson {args.request_rate:g} req/s (seed {args.seed}, "
        f"{workload[-1].arrival_s:.1f} s of arrivals), mix {','.join(f'{p}:{o}' for p, o in mix)} "
        "(prompt:output tokens, uniform)",
        f"# setups: 1p1d = prefill@A + decode@B; 2x-colocated = decode@A + decode@B (each prefills itself); "
        f"workers: {' '.join(worker_argv)}",
        f"# SLO: TTFT <= {args.slo_ttft_ms:g} ms and mean ITL (TPOT) <= {args.slo_itl_ms:g} ms; "
        "goodput = requests meeting it / duration" + (f"; per GPU: / {num_gpus}" if num_gpus else ""),
    ]
    if note:
        header.insert(0, note)
    print("\n".join(header), file=sys.stderr if args.json else sys.stdout, flush=True)

    rows = [run_setup(s, args, devices, worker_argv, workload, num_gpus) for s in SETUPS
            if s in args.setups.split(",")]
    for r in rows:
        r.update(devices=list(devices), num_gpus=num_gpus, request_rate=args.request_rate, seed=args.seed,
                 mix=[list(m) for m in mix], slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms,
                 slo_itl_stat="mean", max_model_len=max_model_len, max_num_seqs=args.max_num_seqs)
    ratios = ratio_row(rows)
    status = 1 if any("error" in r for r in rows) else 0
    if emit_json(rows + ([ratios] if ratios else []), args.json_out, args.json):
        return status
    print_table(rows, ratios, num_gpus, note)
    return status


def print_table(rows: list[dict], ratios: dict | None, num_gpus: int, note: str | None) -> None:
    cols = [("ok", "completed", "d"), ("fail", "failed", "d"), ("dur s", "duration_s", ".1f"),
            ("req/s", "req_s", ".2f"), ("tok/s", "output_tok_s", ".1f"), ("good/s", "goodput_req_s", ".2f"),
            ("good/GPU", "goodput_per_gpu_req_s", ".2f"), ("TTFT p50", "ttft_p50_ms", ".0f"),
            ("p99", "ttft_p99_ms", ".0f"), ("ITL p50", "itl_p50_ms", ".1f"), ("p99", "itl_p99_ms", ".1f"),
            ("E2E p50", "e2e_p50_ms", ".0f"), ("p99", "e2e_p99_ms", ".0f")]
    print(f"{'setup':>17} " + " ".join(f"{name:>9}" for name, _, _ in cols) + "   (ms for latencies)")
    for r in rows:
        if "error" in r:
            print(f"{r['setup']:>17}  could not run: {r['error']}")
            continue
        cells = [format(r[key], fmt) if r[key] is not None else "-" for _, key, fmt in cols]
        print(f"{r['setup']:>17} " + " ".join(f"{c:>9}" for c in cells))
    if ratios:
        cells = [format(ratios[key], ".2f") + "x" if key in ratios else "" for _, key, _ in cols]
        print(f"{'1p1d/colocated':>17} " + " ".join(f"{c:>9}" for c in cells))
    for r in rows:
        if "error" in r:
            continue
        extra = f"SLO met by {r['slo_met']}/{r['requests']}; decode workers finished {r['decode_finished']}; " \
                f"routes {r['routes']}; max send lag {r['max_send_lag_ms']:.1f} ms"
        print(f"# {r['setup']}: {extra}")
        for error, count in r["errors"].items():
            print(f"# {r['setup']}: FAILED x{count}: {error}")
    added = [r["router_added_ms"] for r in rows if "router_added_ms" in r]
    for r in rows:
        if "router_added_error" in r:
            print(f"router added latency: not measured: {r['router_added_error']}")
    if added:
        print(f"router added latency (median TTFT via router minus direct gRPC to a decode worker): {added[0]:.2f} ms")
    if note:
        print(note)


if __name__ == "__main__":
    sys.exit(main())
