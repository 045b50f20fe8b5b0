"""Routing benchmark: KV-aware routing against least-outstanding on real daemons, same requests, one run.

    python bench/routing.py --quick                  # CPU smoke: 2 prefill workers, a few requests per workload
    python bench/routing.py                          # CPU: 3 prefill + 1 decode worker, bundled SmolLM2
    python bench/routing.py --device cuda --num-prefill 4 --scale gpu
    python bench/routing.py --workloads shared-uniform,shared-zipf --json-out routing.jsonl

Setups (each started fresh per policy with ``services.launch.spawn``: ``--num-prefill`` prefill workers and
one decode worker, then a router with ``--routing kv-aware`` or ``--routing least-outstanding`` (a second
one for ``multi-turn-2routers``), warmed up with a few prompts of the workloads' size so that every worker
has measured its prefill rate; the same requests for both policies):

* ``shared``: each prefill worker's KV pool (``--num-kv-blocks``) holds the whole blocks of about 1/N of
  the groups' prefixes plus two requests' questions (``routing_workloads.pool_blocks``). Workloads
  ``shared-uniform`` and ``shared-zipf`` (``--groups`` system prompts of ``--prefix-len`` tokens, a
  ``--question-len`` question each; uniform or Zipf(``--zipf-skew``) popularity; Poisson arrivals).
* ``chat``: pools that hold 1/N of the conversations whole. ``multi-turn`` (``--conversations`` of
  ``--turns`` turns: each prompt is the previous prompt, the model's answer to it and a new message; the
  next turn is sent a think time after the answer) and ``multi-turn-2routers`` (the same kind of
  conversations through two routers, turns alternating between them: the second router knows where the
  history is only from the workers' KV events).
* ``mix``: ``length-mix``, ``bench/serve.py``'s random prompts of mixed lengths (nothing to reuse; TTFT
  and spread only).

Workloads of a setup run one after another on its workers and routers (decision counts are differences;
the index carries over, as a running router's would); each workload's prompts are new, so what an earlier
one left in the pools is never a hit. Requests are
streamed ``/v1/completions`` of token-id prompts (greedy, ``ignore_eos``), with ``--direct-decode-threshold
0`` by default so every request is disaggregated and the prefill workers' caches are what is measured
(``--direct auto`` lets the router's cost-based direct route decide).

Measures, per workload and policy:

* cached tokens: ``usage.prompt_tokens_details.cached_tokens`` of each response (the prefill worker's
  prefix-cache hit, or the decode worker's when served directly), against the ideal: what a perfect
  router gets with these pools (``routing_workloads``: each group's prefix once computed and then always
  reused, each turn's whole history reused; whole blocks, never the prompt's last token). For multi-turn
  the history is the previous prompt plus its answer; a prefill worker never computed the answer (the
  decode worker did), so ``/held`` also gives the ideal that counts only the previous prompt. The
  usage counts what the engine found cached when it admitted the prompt, so a request preempted in a
  tight pool that finds its own first blocks again counts them too: cached can then exceed the ideal
  (seen once, in a ``--quick`` run of 24-block pools).
* TTFT p50 / p90: sending to the first streamed token, at the client.
* per prefill worker: prompt tokens routed to it and tokens it computed (prompt - cached), from the
  router's per-request log line (``route= prefill= prompt_tokens= cached_tokens=``, the router runs at
  ``--log-level INFO``): max / median over workers; and the router's outstanding requests on each prefill
  worker (``pdserve_router_worker_outstanding_requests``, sampled every 0.25 s and averaged over the run):
  max / median, the queue spread.
* the router's ``pdserve_router_routing_decisions_total{role="prefill"}`` by reason, and routes; each
  prefill worker's measured rate after the workload (``KVSnapshot``'s load), which KV-aware scores divide by.
* ``--records``: every request's record (rid, prompt, cached, ideal, TTFT, router, workers) in the JSON.

A ratio row per workload gives kv-aware / least-outstanding. Exit status 1 when a setup could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import httpx  # noqa: E402

from bench import routing_workloads as wl  # noqa: E402
from bench._common import emit_json  # noqa: E402
from bench.serve import parse_mix, percentile, sample, scrape  # noqa: E402
from services.launch.spawn import DaemonFailed, daemons, free_port, terminate  # noqa: E402
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

POLICIES = ("kv-aware", "least-outstanding")
SETUP_WORKLOADS = {"shared": ("shared-uniform", "shared-zipf"), "chat": ("multi-turn", "multi-turn-2routers"),
                   "mix": ("length-mix",)}
WORKLOADS = tuple(w for ws in SETUP_WORKLOADS.values() for w in ws)
_LOG_LINE = re.compile(r"request id=cmpl-(?P<rid>\S+)-[0-9a-f]{12} end=\S+ route=(?P<route>\S+) "
                       r"prefill=(?P<prefill>\S+) decode=(?P<decode>\S+) prompt_tokens=(?P<prompt>\d+) "
                       r"cached_tokens=(?P<cached>\S+)")


@dataclass(frozen=True)
class Scale:
    """Workload sizes; one per ``--scale`` (a flag of the same name overrides each field)."""

    num_prefill: int
    groups: int  # shared-prefix: system prompts
    prefix_len: int
    question_len: int
    shared_requests: int
    shared_rate: float  # Poisson arrivals per second
    conversations: int
    conversation_rate: float  # conversation starts per second
    turns: int
    system_len: int
    message_len: int
    answer_len: int
    think_s: float  # mean think time between an answer and the next message
    mix: str
    mix_requests: int
    mix_rate: float
    output_len: int = 4  # shared-prefix answers
    zipf_skew: float = 1.0
    # The routers' --kv-overload-queue-tokens (None: the router's default, sized for GPU prefill rates). On CPU
    # a worker prefills ~100-300 tokens/s, so 256 tokens is already 1-2 s of queue.
    overload_queue_tokens: int | None = 256


SCALES = {
    "quick": Scale(num_prefill=2, groups=4, prefix_len=128, question_len=32, shared_requests=12, shared_rate=1.5,
                   conversations=3, conversation_rate=1.0, turns=3, system_len=48, message_len=48, answer_len=8,
                   think_s=0.3, mix="64:8,256:4", mix_requests=6, mix_rate=1.0),
    "cpu": Scale(num_prefill=3, groups=6, prefix_len=192, question_len=32, shared_requests=60, shared_rate=1.2,
                 conversations=6, conversation_rate=1.0, turns=4, system_len=64, message_len=48, answer_len=8,
                 think_s=0.5, mix="64:16,256:32,512:8", mix_requests=12, mix_rate=1.0),
    "gpu": Scale(num_prefill=4, groups=16, prefix_len=2048, question_len=128, shared_requests=240, shared_rate=8.0,
                 conversations=16, conversation_rate=2.0, turns=6, system_len=1024, message_len=256, answer_len=64,
                 think_s=1.0, mix="512:128,2048:256,8192:64", mix_requests=120, mix_rate=4.0,
                 overload_queue_tokens=None),
}


# ---- a router whose per-request log lines we read ----------------------------------------------


@dataclass
class LoggedRouter:
    """``pdserve router`` at ``--log-level INFO``: each request's log line (which workers served it, its
    cached tokens) is kept by request id; warnings and errors pass through to stderr."""

    proc: subprocess.Popen
    url: str
    served: dict[str, dict] = field(default_factory=dict)

    def pump(self) -> None:
        for line in self.proc.stderr:
            m = _LOG_LINE.search(line)
            if m:
                self.served[m["rid"]] = {"route": m["route"], "prefill": None if m["prefill"] == "None" else
                                         m["prefill"], "decode": m["decode"], "prompt": int(m["prompt"])}
            elif " WARNING " in line or " ERROR " in line or "Traceback" in line:
                sys.stderr.write(f"[router] {line}")


def start_router(args: argparse.Namespace, policy: str, prefill: list[str], decode: list[str],
                 timeout_s: float = 120.0) -> LoggedRouter:
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "--log-level", "INFO", "router", "--host", "127.0.0.1",
           "--port", str(port), "--health-interval-s", "0.5", "--routing", policy,
           "--direct-decode-threshold", args.direct, "--prefill", ",".join(prefill), "--decode", ",".join(decode)]
    if args.overload_queue_tokens is not None:
        cmd += ["--kv-overload-queue-tokens", str(args.overload_queue_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    router = LoggedRouter(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True), f"http://127.0.0.1:{port}")
    threading.Thread(target=router.pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise RuntimeError(f"router exited with {router.proc.returncode}")
        if _ready(router.url, policy, len(prefill) + len(decode)):
            return router
        time.sleep(0.2)
    terminate(router.proc)
    raise RuntimeError(f"router not ready after {timeout_s:g} s")


def _ready(url: str, policy: str, num_workers: int) -> bool:
    """Serving (``/health`` ok) and, KV-aware, synced with every worker's KV events."""
    samples = scrape(f"{url}/metrics")
    if sample(samples, "pdserve_router_status", status="ok") != 1:
        return False
    return policy != "kv-aware" or sample(samples, "pdserve_router_kv_index_workers", state="synced") == num_workers


# ---- one request ---------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, url: str, rid: str, prompt: tuple[int, ...], max_tokens: int,
               timeout_s: float) -> dict:
    """Stream one completion: TTFT, the answer's token ids, cached tokens from usage. Never raises."""
    body = {"prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "stream_options": {"include_usage": True}}
    started, first, answer, usage = time.perf_counter(), None, [], None
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", f"{url}/v1/completions", json=body,
                                                             headers={"X-Request-Id": rid}) as response:
            if response.status_code != 200:
                return {"ok": False, "error": f"HTTP {response.status_code}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "error": f"error event: {chunk['error']}"}
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    tokens = (choice.get("logprobs") or {}).get("tokens") or []
                    if tokens and first is None:
                        first = time.perf_counter()
                    answer += [int(t.removeprefix("token_id:")) for t in tokens]
    except TimeoutError:
        return {"ok": False, "error": f"timeout after {timeout_s:g} s"}
    except (httpx.HTTPError, OSError, ValueError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if first is None or usage is None or len(answer) != max_tokens:
        return {"ok": False, "error": f"{len(answer)} of {max_tokens} tokens, usage {usage}"}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ok": True, "ttft": first - started, "cached": cached, "answer": tuple(answer)}


def _client(timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


# ---- drivers: open loop, and conversations -----------------------------------------------------


async def drive_requests(urls: list[str], requests: list[wl.Request], ideal: list[int], tag: str,
                         timeout_s: float) -> list[dict]:
    """Each request at its arrival time through the first router; one record per request."""
    async with _client(timeout_s) as client:
        t0 = time.perf_counter()

        async def at(i: int, r: wl.Request) -> dict:
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            rid = f"{tag}{i:05d}"
            result = await send(client, urls[0], rid, r.prompt, r.output_len, timeout_s)
            return {"rid": rid, "prompt": len(r.prompt), "ideal": ideal[i], "held": ideal[i], **result}

        return await asyncio.gather(*[at(i, r) for i, r in enumerate(requests)])


async def drive_conversations(urls: list[str], conversations: list[wl.Conversation], block_size: int, tag: str,
                              timeout_s: float) -> list[dict]:
    """Each conversation turn after turn, turn t through router ``t % len(urls)``; a record per turn with the
    ideal (whole history) and what the prefill worker can hold (the previous prompt)."""
    async with _client(timeout_s) as client:
        t0 = time.perf_counter()

        async def talk(c: wl.Conversation) -> list[dict]:
            await asyncio.sleep(max(0.0, t0 + c.start_s - time.perf_counter()))
            records, prompt, history, held = [], c.messages[0], 0, 0
            for turn in range(len(c.messages)):
                rid = f"{tag}{c.conversation_id:03d}t{turn:02d}"
                result = await send(client, urls[turn % len(urls)], rid, prompt, c.output_len, timeout_s)
                records.append({"rid": rid, "prompt": len(prompt), "turn": turn, "router": turn % len(urls),
                                "ideal": wl.cacheable_tokens(history, len(prompt), block_size),
                                "held": wl.cacheable_tokens(held, len(prompt), block_size), **result})
                if not result["ok"] or turn + 1 == len(c.messages):
                    break
                await asyncio.sleep(c.think_after(turn))
                history, held = len(prompt) + len(result["answer"]), len(prompt)
                prompt = wl.next_prompt(prompt, result["answer"], c.messages[turn + 1])
            return records

        return [r for records in await asyncio.gather(*[talk(c) for c in conversations]) for r in records]


class QueueSampler:
    """The routers' outstanding requests per prefill worker, sampled while a workload runs, time-averaged."""

    def __init__(self, urls: list[str], prefill: list[str], interval_s: float = 0.25) -> None:
        self.urls, self.prefill, self.interval_s = urls, prefill, interval_s
        self.sums = dict.fromkeys(prefill, 0.0)
        self.num_samples = 0

    async def run(self) -> None:
        while True:
            pages = await asyncio.gather(*[asyncio.to_thread(scrape, f"{u}/metrics") for u in self.urls])
            for address in self.prefill:
                self.sums[address] += sum(sample(p, "pdserve_router_worker_outstanding_requests", role="prefill",
                                                 address=address) or 0.0 for p in pages)
            self.num_samples += 1
            await asyncio.sleep(self.interval_s)

    def means(self) -> list[float]:
        return [s / max(self.num_samples, 1) for s in self.sums.values()]


async def run_sampled(coro, sampler: QueueSampler) -> list[dict]:
    task = asyncio.create_task(sampler.run())
    try:
        return await coro
    finally:
        task.cancel()


# ---- a workload on a running setup -------------------------------------------------------------


def make_workload(name: str, args: argparse.Namespace) -> list[wl.Request] | list[wl.Conversation]:
    """The workload's requests (or conversations), seeded: the same for both policies."""
    seed = args.seed + WORKLOADS.index(name)
    if name.startswith("shared"):
        skew = args.zipf_skew if name == "shared-zipf" else 0.0
        return wl.shared_prefix(args.shared_requests, args.shared_rate, args.groups, args.prefix_len,
                                args.question_len, args.output_len, skew, seed)
    if name.startswith("multi-turn"):
        return wl.multi_turn(args.conversations, args.turns, args.conversation_rate, args.system_len,
                             args.message_len, args.answer_len, args.think_s, seed)
    return wl.length_mix(args.mix_requests, args.mix_rate, parse_mix(args.mix), seed)


async def warm_up(url: str, count: int, prompt_len: int, timeout_s: float) -> None:
    """``count`` random requests of ``prompt_len`` tokens at once, so every worker has run a prefill (and the
    decode worker a pull) and measured its prefill rate on prompts of the workload's size: a rate measured
    on tiny prompts is mostly step overhead, and KV-aware scores compare workers by it."""
    rng = random.Random(-1)
    async with _client(timeout_s) as client:
        results = await asyncio.gather(*[send(client, url, f"warm{i}", wl.random_tokens(rng, prompt_len), 2,
                                              timeout_s) for i in range(count)])
    bad = [r["error"] for r in results if not r["ok"]]
    if bad:
        raise RuntimeError(f"warm-up request failed: {bad[0]}")


def router_counts(url: str) -> Counter:
    """Prefill decisions by reason and requests by route, from the router's /metrics."""
    counts: Counter = Counter()
    for key, value in scrape(f"{url}/metrics").items():
        name, _, rest = key.partition("{")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if name == "pdserve_router_routing_decisions_total" and labels.get("role") == "prefill":
            counts[labels["reason"]] += value
        elif name == "pdserve_router_routed_requests_total":
            counts[f"route:{labels['route']}"] += value
    return counts


def run_workload(name: str, policy: str, routers: list[LoggedRouter], prefill: list[str],
                 args: argparse.Namespace) -> dict:
    """One workload through ``routers`` (multi-turn-2routers: two, turns alternating; else the first)."""
    routers = routers if name == "multi-turn-2routers" else routers[:1]
    urls = [r.url for r in routers]
    before = sum((router_counts(u) for u in urls), Counter())
    workload, tag, sampler = make_workload(name, args), name[:2] + policy[:2], QueueSampler(urls, prefill)
    started = time.perf_counter()
    if name.startswith("multi-turn"):
        drive = drive_conversations(urls, workload, args.block_size, tag, args.request_timeout_s)
    else:
        ideal = wl.ideal_cached_tokens(workload, args.block_size)
        drive = drive_requests(urls, workload, ideal, tag, args.request_timeout_s)
    records = asyncio.run(run_sampled(drive, sampler))
    duration_s = time.perf_counter() - started
    served = _wait_for_logs(routers, [r["rid"] for r in records if r["ok"]])
    counts = sum((router_counts(u) for u in urls), Counter()) - before
    for r in records:
        r.pop("answer", None)
        r.update(served.get(r["rid"], {}))
    return {"kind": "workload", "workload": name, "policy": policy, "duration_s": duration_s,
            **summarize(records, served, prefill, sampler), "prefill_rates": prefill_rates(prefill),
            "counts": dict(counts), "records": records}


def _wait_for_logs(routers: list[LoggedRouter], rids: list[str], timeout_s: float = 10.0) -> dict[str, dict]:
    """Every request's router log line (a line is written as the request ends, maybe just after the client
    has its last byte)."""
    deadline = time.monotonic() + timeout_s
    while True:
        served = {rid: line for r in routers for rid, line in list(r.served.items())}
        if all(rid in served for rid in rids) or time.monotonic() > deadline:
            return served
        time.sleep(0.1)


def prefill_rates(prefill: list[str]) -> list[float]:
    """Each prefill worker's measured prefill rate (tokens/s, its ``WorkerLoad``): what KV-aware scores
    divide by."""
    rates = []
    for address in prefill:
        with grpc.insecure_channel(address) as channel:
            snapshot = worker_pb2_grpc.PrefillWorkerStub(channel).KVSnapshot(worker_pb2.KVSnapshotRequest(), timeout=10)
        rates.append(round(snapshot.load.prefill_tokens_per_s, 1))
    return rates


def summarize(records: list[dict], served: dict[str, dict], prefill: list[str], sampler: QueueSampler) -> dict:
    ok = [r for r in records if r["ok"]]
    routed = {a: 0 for a in prefill}
    computed = {a: 0 for a in prefill}
    for r in ok:
        address = served.get(r["rid"], {}).get("prefill")
        if address in routed:
            routed[address] += r["prompt"]
            computed[address] += r["prompt"] - r["cached"]
    prompt, cached = sum(r["prompt"] for r in ok), sum(r["cached"] for r in ok)
    ideal, held = sum(r["ideal"] for r in ok), sum(r["held"] for r in ok)
    later = [r for r in ok if r["ideal"] > 0]
    ttft = [r["ttft"] for r in ok]
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": dict(Counter(r["error"] for r in records if not r["ok"]).most_common(3)),
        "unlogged": sum(1 for r in ok if r["rid"] not in served),
        "prompt_tokens": prompt, "cached_tokens": cached, "ideal_tokens": ideal, "held_tokens": held,
        "cached_frac": cached / prompt if prompt else None, "of_ideal": cached / ideal if ideal else None,
        "of_held": cached / held if held else None,
        "reused_90": sum(1 for r in later if r["cached"] >= 0.9 * r["ideal"]), "reusable": len(later),
        "ttft_p50_ms": percentile(ttft, 0.5) * 1e3, "ttft_p90_ms": percentile(ttft, 0.9) * 1e3,
        "prefill_prompt_tokens": list(routed.values()), "prefill_computed_tokens": list(computed.values()),
        "prompt_spread": spread(list(routed.values())), "computed_spread": spread(list(computed.values())),
        "queue_means": sampler.means(), "queue_spread": spread(sampler.means()),
    }


def spread(values: list[float]) -> float | None:
    """max / median over workers (None when the median is 0)."""
    median = statistics.median(values) if values else 0
    return max(values) / median if median > 0 else None


# ---- setups --------------------------------------------------------------------------------------


def pool_blocks(setup: str, args: argparse.Namespace) -> int:
    """Each prefill worker's KV pool: its 1/N share of the prefixes (or conversations), two requests' own
    tokens beside them; ``mix``: room for 16 of its longest requests."""
    n, bs = args.num_prefill, args.block_size
    if setup == "shared":
        return wl.pool_blocks(math.ceil(args.groups / n), args.prefix_len, args.question_len + args.output_len, bs)
    if setup == "chat":
        longest = wl.max_prompt_len(make_workload("multi-turn", args)[0])
        return wl.pool_blocks(math.ceil(args.conversations / n), longest, args.message_len + args.answer_len, bs)
    return 16 * wl.blocks_for(max_model_len("mix", args), bs)


def max_model_len(setup: str, args: argparse.Namespace) -> int:
    if setup == "shared":
        return args.prefix_len + args.question_len + args.output_len
    if setup == "chat":
        return wl.max_prompt_len(make_workload("multi-turn", args)[0]) + args.answer_len
    return max(p + o for p, o in parse_mix(args.mix))


def worker_specs(setup: str, args: argparse.Namespace) -> list[tuple[str, str | None, tuple[str, ...]]]:
    common = ("--block-size", str(args.block_size), "--max-model-len", str(max_model_len(setup, args)),
              *shlex.split(args.worker_args))
    devices = [args.device] if args.device == "cpu" or not args.gpus else [f"cuda:{g}" for g in args.gpus.split(",")]
    specs = [("prefill", args.model, ("--device", devices[i % len(devices)], "--num-kv-blocks",
                                      str(pool_blocks(setup, args)), *common)) for i in range(args.num_prefill)]
    specs.append(("decode", args.model, ("--device", devices[args.num_prefill % len(devices)], "--num-kv-blocks",
                                         str(args.decode_kv_blocks), *common)))
    return specs


def run_setup(setup: str, policy: str, args: argparse.Namespace) -> list[dict]:
    """Fresh workers for ``setup``, a router (two for multi-turn-2routers) warmed up, then its workloads in
    turn; a row per workload (with the error, if the setup could not run)."""
    names = [w for w in SETUP_WORKLOADS[setup] if w in args.workloads]
    print(f"# {setup} / {policy}: starting {args.num_prefill} prefill workers ({pool_blocks(setup, args)} KV blocks "
          f"each) + 1 decode worker for {', '.join(names)}", file=sys.stderr, flush=True)
    rows: list[dict] = []
    try:
        with daemons(*worker_specs(setup, args)) as started:
            prefill = [d.address for d in started if d.role == "prefill"]
            decode = [d.address for d in started if d.role == "decode"]
            routers: list[LoggedRouter] = []
            try:
                for _ in range(2 if "multi-turn-2routers" in names else 1):
                    routers.append(start_router(args, policy, prefill, decode))
                asyncio.run(warm_up(routers[0].url, 2 * len(prefill), warm_up_len(setup, args),
                                    args.request_timeout_s))
                for name in names:
                    rows.append(run_workload(name, policy, routers, prefill, args))
                    # The whole row, so a run cut short by its time limit still leaves what it measured.
                    print(f"# {name} / {policy}: {rows[-1]['completed']}/{rows[-1]['requests']} in "
                          f"{rows[-1]['duration_s']:.1f} s; row " + json.dumps(
                              {k: v for k, v in rows[-1].items() if k != "records"}),
                          file=sys.stderr, flush=True)
            finally:
                for router in routers:
                    terminate(router.proc)
    except (DaemonFailed, RuntimeError, grpc.RpcError) as e:
        print(f"# {setup} / {policy}: could not run: {e}", file=sys.stderr, flush=True)
        rows += [{"kind": "workload", "workload": n, "policy": policy, "error": str(e)}
                 for n in names if n not in {r["workload"] for r in rows}]
    return rows


def warm_up_len(setup: str, args: argparse.Namespace) -> int:
    """A typical prompt of the setup's workloads: a shared-prefix request, a first turn, the mix's mean."""
    if setup == "shared":
        return args.prefix_len + args.question_len
    if setup == "chat":
        return args.system_len + args.message_len
    mix = parse_mix(args.mix)
    return sum(p for p, _ in mix) // len(mix)


RATIO_FIELDS = ("cached_frac", "of_ideal", "ttft_p50_ms", "ttft_p90_ms", "prompt_spread", "computed_spread",
                "queue_spread")


def ratio_rows(rows: list[dict]) -> list[dict]:
    """kv-aware / least-outstanding per workload, where both ran."""
    out = []
    for name in dict.fromkeys(r["workload"] for r in rows):
        by = {r["policy"]: r for r in rows if r["workload"] == name and "error" not in r}
        if set(by) >= set(POLICIES):
            a, b = by["kv-aware"], by["least-outstanding"]
            out.append({"kind": "ratio", "workload": name, "policy": "kv/lo", **{
                k: a[k] / b[k] if a.get(k) is not None and b.get(k) else None for k in RATIO_FIELDS}})
    return out


# ---- arguments and output ------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every worker; default cpu)")
    ap.add_argument("--gpus", default=None, metavar="I,J,...", help="with --device cuda: GPUs handed to the "
                    "workers in turn (default: all on the current device)")
    ap.add_argument("--scale", choices=sorted(SCALES), default=None, help="workload sizes (default cpu; gpu with "
                    "--device cuda; quick with --quick)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke: --scale quick")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"which of {','.join(POLICIES)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"which of {','.join(WORKLOADS)}")
    ap.add_argument("--direct", default="0", metavar="TOKENS|auto",
                    help="the routers' --direct-decode-threshold (default 0: every request disaggregated)")
    ap.add_argument("--block-size", type=int, default=16, help="every worker's KV block size (default 16)")
    ap.add_argument("--decode-kv-blocks", type=int, default=512, help="the decode worker's KV pool (default 512)")
    ap.add_argument("--worker-args", default="", help='more worker flags, e.g. "--enforce-eager"')
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    for name, value in vars(SCALES["cpu"]).items():
        kind = type(value) if value is not None else int
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"default per --scale (cpu: "
                        f"{value})")
    ap.add_argument("--json", action="store_true", help="print JSON lines (a row per workload and policy, ratios)")
    ap.add_argument("--json-out", default=None, help="also write the JSON lines here")
    ap.add_argument("--records", action="store_true", help="keep every request's record (rid, prompt, cached, "
                    "ideal, TTFT, workers) in the JSON rows")
    args = ap.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.policies) - set(POLICIES) | set(args.workloads) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown policy or workload: {', '.join(sorted(unknown))}")
    scale = SCALES[args.scale or ("quick" if args.quick else "gpu" if args.device.startswith("cuda") else "cpu")]
    for name, value in vars(scale).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def header(args: argparse.Namespace) -> str:
    return "\n".join([
        f"# routing: {args.model or 'bundled SmolLM2-135M-Instruct'} on {args.device}; {args.num_prefill} prefill + "
        f"1 decode workers, block {args.block_size}; routers --direct-decode-threshold {args.direct}, overload valve "
        f"{args.overload_queue_tokens or 'router default'} tokens",
        f"# shared-prefix: {args.groups} groups x {args.prefix_len}-token prefix + {args.question_len}-token question, "
        f"{args.shared_requests} requests at {args.shared_rate:g}/s, zipf skew {args.zipf_skew:g}; pools "
        f"{pool_blocks('shared', args)} blocks",
        f"# multi-turn: {args.conversations} conversations x {args.turns} turns ({args.system_len}-token system + "
        f"{args.message_len}-token messages, {args.answer_len}-token answers, think {args.think_s:g} s), starting at "
        f"{args.conversation_rate:g}/s; pools {pool_blocks('chat', args)} blocks",
        f"# length-mix: {args.mix_requests} requests of {args.mix} at {args.mix_rate:g}/s; pools "
        f"{pool_blocks('mix', args)} blocks",
    ])


def _fmt(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def print_table(rows: list[dict], ratios: list[dict]) -> None:
    cols = (("workload", 19), ("policy", 17), ("ok/fail", 7), ("cached", 6), ("/ideal", 6), ("/held", 6),
            ("turns>=.9", 9), ("TTFT p50", 8), ("p90 ms", 7), ("prompt", 6), ("computed", 8), ("queue", 6))
    print(" ".join(f"{n:>{w}}" for n, w in cols) + "  (spreads: max/median over prefill workers)")
    for r in rows + ratios:
        if "error" in r:
            print(f"{r['workload']:>19} {r['policy']:>17}  could not run: {r['error']}")
            continue
        x = "x" if r["kind"] == "ratio" else ""
        reuse = f"{r['reused_90']}/{r['reusable']}" if r["kind"] != "ratio" and r["reusable"] else "-"
        cells = (r["workload"], r["policy"], "" if x else f"{r['completed']}/{r['failed']}",
                 _fmt(r["cached_frac"], ".3f", x), _fmt(r["of_ideal"], ".3f", x), _fmt(r.get("of_held"), ".3f"),
                 reuse, _fmt(r["ttft_p50_ms"], ".0f" if not x else ".2f", x),
                 _fmt(r["ttft_p90_ms"], ".0f" if not x else ".2f", x), _fmt(r["prompt_spread"], ".2f", x),
                 _fmt(r["computed_spread"], ".2f", x), _fmt(r["queue_spread"], ".2f", x))
        print(" ".join(f"{c!s:>{w}}" for c, (_, w) in zip(cells, cols, strict=True)))
    for r in rows:
        if "error" not in r:
            counts = " ".join(f"{k}={v:g}" for k, v in sorted(r["counts"].items()) if v)
            print(f"# {r['workload']} / {r['policy']}: prefill prompt tokens {r['prefill_prompt_tokens']}, computed "
                  f"{r['prefill_computed_tokens']}, mean outstanding {[round(q, 2) for q in r['queue_means']]}, "
                  f"measured prefill tok/s {r['prefill_rates']}; "
                  f"{counts}; {r['duration_s']:.1f} s" + (f"; {r['unlogged']} without a log line" if r["unlogged"]
                                                          else ""))
            for error, count in r["errors"].items():
                print(f"# {r['workload']} / {r['policy']}: FAILED x{count}: {error}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(header(args), file=sys.stderr if args.json else sys.stdout, flush=True)
    rows = [row for setup in SETUP_WORKLOADS if set(SETUP_WORKLOADS[setup]) & set(args.workloads)
            for policy in args.policies for row in run_setup(setup, policy, args)]
    order = {(w, p): i for i, (w, p) in enumerate((w, p) for w in WORKLOADS for p in POLICIES)}
    rows.sort(key=lambda r: order[(r["workload"], r["policy"])])
    ratios = ratio_rows(rows)
    if not args.records:
        for r in rows:
            r.pop("records", None)
    status = 1 if any("error" in r for r in rows) else 0
    if not emit_json(rows + ratios, args.json_out, args.json):
        print_table(rows, ratios)
    return status


if __name__ == "__main__":
    sys.exit(main())
