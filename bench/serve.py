"""Serving benchmark: disaggregated workers (1P1D: prefill on one GPU, decode on another) against as many colocated
replicas (one per GPU) at the same request rate, on the same requests, in one run; with ``--workload shifting``
also the same workers able to switch roles with the router's P:D planner acting; plus the router's added latency.

    python bench/serve.py --quick                           # CPU smoke: bundled SmolLM2, a few short requests
    python bench/serve.py                                   # bundled SmolLM2 on CPU, a small CPU workload
    python bench/serve.py --device cuda --model dummy:llama-3.1-8b --gpus 0,1 --request-rate 4 --num-requests 200
    python bench/serve.py --device cuda --model dummy:llama-3.1-8b --mix 1024:256,4096:128 --request-rate 2 \\
        --slo-ttft-ms 1000 --slo-itl-ms 40 --json-out serve.jsonl
    # the shifting workload: prefill-heavy, then decode-heavy, then the two mixed; three setups
    python bench/serve.py --workload shifting --num-workers 3          # CPU, ~10 minutes on 2 cores
    python bench/serve.py --workload shifting                          # 2 workers: the planner cannot switch (below)
    python bench/serve.py --workload shifting --device cuda --model dummy:llama-3.1-8b --gpus 0,0 \\
        --num-kv-blocks 4096                                           # one GPU, 2 workers on it
    python bench/serve.py --workload shifting --device cuda --model dummy:llama-3.1-8b --num-workers 3 \\
        --gpus 0,0,0 --num-kv-blocks 2048                               # one GPU, 3 workers: the planner can act

Setups (each started fresh with ``services.launch.spawn``: real daemons, a real router, then stopped), all with
``--num-workers`` N workers (default 2), ``--num-prefill`` P of them prefill workers where roles are split
(default 1; D = N - P decode workers):

* ``{P}p{D}d`` (``1p1d`` by default): P prefill workers and D decode workers, the router pairing them with
  ``--direct-decode-threshold 0``, so every request is disaggregated (prefill on one, KV pulled to the other).
* ``{N}x-colocated`` (``2x-colocated``): N decode workers, no prefill worker; the router's direct-decode
  threshold is huge, so each decode worker prefills its own requests, and the router balances requests across
  them (least outstanding requests).
* ``{P}p{D}d+planner`` (``--workload shifting`` only, or ``--setups planner``): the ``{P}p{D}d`` workers
  started with ``--role-switching`` (as ``pdserve up --role-planner`` starts them), the router with
  ``--role-planner`` and its planner flags set for the bench's time scale (printed with the results; the
  ``--planner-*`` flags here change them): it evaluates every 2 s (CPU; 5 s GPU) over the last 16 s (30 s) of
  ended requests, switches after 2 evaluations in a row call for the same change, at least 16 s (30 s) after
  the previous switch, sizing the roles at the bench's SLO targets. So it can react within a phase (40 s on
  CPU, 120 s on GPU by default). **With N = 2 it cannot switch at all**: the planner keeps at least one worker
  per role (``planner.py``; the router's switch refuses to move a role's last worker), so 1P1D is the only
  split of two workers and this setup is 1P1D with switchable workers and the planner evaluating; the output
  says so. ``--num-workers 3`` (1P2D to start) lets it move a worker either way.

``--setups`` takes ``disagg``, ``colocated``, ``planner`` or the names above. Every setup's workers are on the
same devices: ``--gpus I,J,...`` gives one GPU per worker (prefill workers first; default 0,1,...,N-1 with
``--device cuda``); with fewer GPUs than workers a GPU may be listed more than once (``--gpus 0,0`` runs both
workers of each setup on one GPU; then pass ``--num-kv-blocks`` so the KV pools fit) and the output says loudly
that it is not the N-GPU comparison. On CPU every worker is on ``cpu`` (the setups then only share the same
cores).

Workload ``mix`` (the default; identical for every setup): open loop, Poisson arrivals at ``--request-rate``
req/s (seeded; the same arrival schedule and the same requests for each setup; ``inf`` sends everything at
once), ``--num-requests`` requests; each picks a (prompt_len, output_len) pair uniformly at random from
``--mix`` (``P:O,P:O,...``). Prompts are random token ids; each request is a streaming
``/v1/completions`` with greedy sampling, ``ignore_eos`` and ``max_tokens`` = its output length, and
``logprobs=0`` with ``return_tokens_as_token_ids`` so every token arrives in a chunk that says how many
tokens it carries (with dummy weights the text can be empty, and empty-text chunks are otherwise held
back). Workers get ``--max-model-len`` = the longest prompt + output (at least 4, the warm-up's) and
``--max-num-seqs``. Before timing, each setup serves a warm-up pair of short requests per prompt length of the
workload; the planner setup's warm-up goes through a router without the planner, which is then replaced by a
fresh router with it, so the planner's window starts empty at the first arrival and every setup starts from its
own split.

Workload ``shifting``: three phases of ``--phase-duration-s`` each (CPU 40 s, GPU 120 s, ``--quick`` 8 s), open
loop with Poisson arrivals inside each phase at that phase's rate (``--phase-rates``, seeded, the same schedule
and requests for every setup): ``prefill-heavy`` (long prompts, short outputs: ``--prefill-heavy-mix``, CPU
384:2,512:2), ``decode-heavy`` (short prompts, long outputs: ``--decode-heavy-mix``, CPU 16:64,32:48), then
``mix`` (a pair drawn uniformly from both mixes). A request belongs to the phase it arrived in; each phase is
reported on its own and all of them together (``overall``): completed/failed, requests meeting the SLO,
goodput, TTFT/ITL/TPOT p50/p99, and the ratios planner / each fixed setup. The planner setup also reports the
switches it decided and when (from ``GET /admin/planner``, polled), the roles over time (``GET
/admin/workers``), per phase the desired counts it asked for (lowest-highest and at the phase's end) beside the
roles the workers had, and the counters that confirm them (the router's ``pdserve_planner_switches_total``, the
workers' ``pdserve_role_switches_total``, ``pdserve_router_migrated_requests_total``).

Metrics per setup: completed and failed requests (a request fails on an HTTP error, an error event in
the stream, a broken connection, the ``--request-timeout-s`` deadline, or fewer tokens than asked
for; failures are counted and listed, never dropped), duration (first arrival to last completion),
request and output-token throughput, TTFT, time to the second token (T2T), ITL and end-to-end latency p50/p99.
TTFT is from sending the request to the first token's chunk; T2T is the second token's arrival minus the first's
(0 when one chunk carries both): on a disaggregated setup the KV transfer not hidden behind the prefill shows
there (``--router-args --no-kv-parts`` pulls a prompt's KV in one piece after its prefill instead of per prefill
chunk); ITL is the gap between token chunks, split evenly over the tokens of a chunk that carries several.

SLO and goodput: a request meets the SLO when it completed, its TTFT <= ``--slo-ttft-ms`` and its
*mean* ITL (TPOT: (last token - first token) / (tokens - 1)) <= ``--slo-itl-ms``. Goodput is the
number of requests that met it divided by the duration (req/s; per phase: by the phase's arrival window); per
GPU it is divided by the number of distinct GPUs the setup used. Defaults: TTFT 2000 ms and mean ITL 50 ms on
GPU (an 8B model on H100/H200 class GPUs); on CPU, where only relative numbers mean anything, 10000 ms and
1000 ms for ``mix`` and 4000 ms and 500 ms for ``shifting`` (tight enough that a phase's overload shows). The
table prints disaggregated / colocated ratios for throughput, goodput, TTFT and ITL.

Router added latency (colocated run of the ``mix`` workload, after the load): TTFT of a short request through
the router minus the mean TTFT of the same request sent straight to each decode worker over gRPC, one request at
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import httpx  # noqa: E402

from bench._common import emit_json  # noqa: E402
from bench.serve_planner import (  # noqa: E402
    PLANNER_DEFAULTS,
    PlannerSettings,
    PlannerWatch,
    counts_by_phase,
    phase_of,
    phase_ratio_rows,
    print_phase_tables,
    print_planner_row,
)
from services.common.metrics import JOIN_STAGES, PULL_STAGES  # noqa: E402
from services.launch.spawn import Daemon, DaemonFailed, daemons, start_router, stop_router  # noqa: E402
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

GPU_MIX = "512:128,2048:256,8192:64"
CPU_MIX = "64:16,256:32,512:8"
QUICK_MIX = "32:4,64:8"
# (num_requests, request_rate) by workload
DEFAULT_LOAD = {"gpu": (200, 4.0), "cpu": (16, 0.5), "quick": (8, 2.0)}
DEFAULT_SLO_MS = {"gpu": (2000.0, 50.0), "cpu": (10000.0, 1000.0)}  # (TTFT, mean ITL)
SHIFTING_SLO_MS = {"gpu": (2000.0, 50.0), "cpu": (4000.0, 500.0)}
# The shifting workload by machine kind: (prefill-heavy mix, decode-heavy mix, rates per phase, phase seconds).
SHIFTING = {"gpu": ("4096:16,8192:8", "128:512,256:384", (2.0, 4.0, 3.0), 120.0),
            "cpu": ("384:2,512:2", "16:64,32:48", (0.4, 0.6, 0.5), 40.0),
            "quick": ("128:2", "16:16", (1.0, 1.0, 1.0), 8.0)}
PHASES = ("prefill-heavy", "decode-heavy", "mix")
SETUP_KINDS = ("disagg", "colocated", "planner")
WARM_UP_TOKENS = 4  # each warm-up request's output (so --max-model-len leaves room for it)
NO_DIRECT = 0  # --direct-decode-threshold: every request goes through a prefill worker
ALWAYS_DIRECT = 1 << 30  # every prompt is "short": decode workers prefill it themselves


@dataclass(frozen=True)
class Request:
    arrival_s: float  # offset from the start of the run
    prompt: list[int]
    output_len: int
    phase: str = "all"  # the shifting workload's phase it arrives in


@dataclass(frozen=True)
class Phase:
    name: str
    mix: list[tuple[int, int]]
    rate: float  # Poisson arrivals per second
    start_s: float
    duration_s: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


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


def make_phases(prefill_heavy: list[tuple[int, int]], decode_heavy: list[tuple[int, int]],
                rates: tuple[float, ...], duration_s: float) -> list[Phase]:
    """The shifting workload's three phases back to back: prefill-heavy, decode-heavy, then both mixes."""
    mixes = (prefill_heavy, decode_heavy, prefill_heavy + decode_heavy)
    return [Phase(name, mix, rate, i * duration_s, duration_s)
            for i, (name, mix, rate) in enumerate(zip(PHASES, mixes, rates, strict=True))]


def make_shifting_workload(phases: list[Phase], seed: int) -> list[Request]:
    """Poisson arrivals inside each phase at its rate (the first request at 0), lengths uniform from its mix."""
    rng = random.Random(seed)
    requests: list[Request] = []
    for phase in phases:
        t = phase.start_s
        if requests:
            t += rng.expovariate(phase.rate)
        while t < phase.end_s:
            prompt_len, output_len = rng.choice(phase.mix)
            requests.append(Request(t, [rng.randrange(100, 30000) for _ in range(prompt_len)], output_len,
                                    phase.name))
            t += rng.expovariate(phase.rate)
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
    second = first if chunks[0][1] > 1 or len(chunks) < 2 else chunks[1][0]
    return {"ok": True, "ttft": first - started, "t2t": second - first if tokens > 1 else None,
            "itl": itl, "tpot": (last - first) / (tokens - 1) if tokens > 1
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
                one_request(client, url, [rng.randrange(100, 30000) for _ in range(prompt_len)], WARM_UP_TOKENS,
                            timeout_s)
                for _ in range(2)])
            bad = [r["error"] for r in results if not r["ok"]]
            if bad:
                raise RuntimeError(f"warm-up request of {prompt_len} prompt tokens failed: {bad[0]}")


async def drive(url: str, workload: list[Request], timeout_s: float,
                on_start: Callable[[float], None] | None = None) -> tuple[list[dict], float]:
    """Send each request at its arrival time (open loop); (results in workload order, duration).
    ``on_start`` gets the ``perf_counter`` time of the first arrival (what arrival offsets count from)."""
    async with _client(timeout_s) as client:
        t0 = time.perf_counter()
        if on_start is not None:
            on_start(t0)

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
    t2t = [r["t2t"] for r in ok if r.get("t2t") is not None]
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
        "t2t_p50_ms": percentile(t2t, 0.5) * 1e3, "t2t_p99_ms": percentile(t2t, 0.99) * 1e3,
        "itl_p50_ms": percentile(itl, 0.5) * 1e3, "itl_p99_ms": percentile(itl, 0.99) * 1e3,
        "tpot_p50_ms": percentile(tpot, 0.5) * 1e3, "tpot_p99_ms": percentile(tpot, 0.99) * 1e3,
        "e2e_p50_ms": percentile(latency, 0.5) * 1e3, "e2e_p99_ms": percentile(latency, 0.99) * 1e3,
        "max_send_lag_ms": max(r["send_lag"] for r in results) * 1e3,
    }


def summarize_phases(results: list[dict], workload: list[Request], phases: list[Phase], duration: float,
                     slo_ttft_s: float, slo_itl_s: float, num_gpus: int) -> dict[str, dict]:
    """Per phase (a request is in the phase it arrived in; goodput over the phase's arrival window) and overall."""
    out = {}
    for phase in phases:
        mine = [r for r, req in zip(results, workload, strict=True) if req.phase == phase.name]
        out[phase.name] = summarize(mine, phase.duration_s, slo_ttft_s, slo_itl_s, num_gpus) if mine else \
            {"requests": 0}
    out["overall"] = summarize(results, duration, slo_ttft_s, slo_itl_s, num_gpus)
    return out


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


def series(samples: dict[str, float], name: str) -> dict[str, float]:
    """Every non-zero series of ``name`` as {``label=value,...``: value}."""
    out = {}
    for key, value in samples.items():
        metric, _, rest = key.partition("{")
        if metric == name and value:
            out[rest.rstrip("}").replace('"', "")] = value
    return out


def finished_on(d: Daemon, any_role: bool = False) -> int | None:
    """Requests the worker finished so far (its /metrics; ``any_role``: under every role label, for a worker
    that may have switched), None when it cannot be read."""
    samples = scrape(f"http://127.0.0.1:{d.metrics_port}/metrics")
    if any_role:
        found = [v for k, v in series(samples, "pdserve_requests_total").items() if "outcome=finished" in k]
        return int(sum(found)) if samples else None
    value = sample(samples, "pdserve_requests_total", role=d.role, outcome="finished")
    return None if value is None else int(value)


def pull_totals(decode: list[Daemon]) -> dict[str, float]:
    """Summed over the decode workers' /metrics: pulls (a KV part is one, or several read together: "coalesced"
    counts the parts read with a later one), bytes, and seconds per pull stage (pdserve_kv_pull_stage_seconds:
    handshake, ticket check, planning, the READ, the digest...)."""
    joins = [f"join.{stage}" for stage in JOIN_STAGES]
    totals = dict.fromkeys(("pulls", "coalesced", "bytes", "joins", *PULL_STAGES, *joins), 0.0)
    for d in decode:
        samples = scrape(f"http://127.0.0.1:{d.metrics_port}/metrics")
        totals["pulls"] += sample(samples, "pdserve_kv_transfer_seconds_count", role="decode") or 0.0
        totals["coalesced"] += sample(samples, "pdserve_kv_parts_coalesced_total", role="decode") or 0.0
        totals["bytes"] += sample(samples, "pdserve_kv_transfer_bytes_total", role="decode") or 0.0
        for stage in PULL_STAGES:
            totals[stage] += sample(samples, "pdserve_kv_pull_stage_seconds_sum", role="decode", stage=stage) or 0.0
        totals["joins"] += sample(samples, "pdserve_kv_join_stage_seconds_count", role="decode",
                                  stage="last_pull") or 0.0
        for stage, key in zip(JOIN_STAGES, joins, strict=True):
            totals[key] += sample(samples, "pdserve_kv_join_stage_seconds_sum", role="decode", stage=stage) or 0.0
    return totals


def pull_profile(before: dict[str, float], after: dict[str, float]) -> dict:
    """Where the pulls of a load went: their count, GiB, the mean milliseconds per pull of each stage, and per
    pulled request the mean milliseconds of each stage from its last ticket to its first decode token (what the
    decode worker adds to the gap between tokens 1 and 2)."""
    pulls = after["pulls"] - before["pulls"]
    profile = {"pulls": int(pulls), "parts_coalesced": int(after["coalesced"] - before["coalesced"]),
               "gib": round((after["bytes"] - before["bytes"]) / 2**30, 3)}
    if pulls:
        profile["mean_stage_ms"] = {stage: round((after[stage] - before[stage]) / pulls * 1e3, 3)
                                    for stage in PULL_STAGES}
    joins = after["joins"] - before["joins"]
    if joins:
        profile["mean_join_ms"] = {stage: round((after[f"join.{stage}"] - before[f"join.{stage}"]) / joins * 1e3, 3)
                                   for stage in JOIN_STAGES}
    return profile


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


def setup_name(kind: str, args) -> str:
    """``1p1d``, ``2x-colocated``, ``1p1d+planner`` (for the default two workers, one of them prefill)."""
    split = f"{args.num_prefill}p{args.num_workers - args.num_prefill}d"
    return {"disagg": split, "colocated": f"{args.num_workers}x-colocated", "planner": f"{split}+planner"}[kind]


def setup_specs(kind: str, args, devices: list[str], worker_argv: tuple[str, ...]) -> list[tuple]:
    """The :func:`daemons` specs of a setup: one worker per device (prefill workers first)."""
    if kind == "colocated":
        return [("decode", args.model, ("--device", device, *worker_argv)) for device in devices]
    extra = ("--role-switching",) if kind == "planner" else ()
    roles = ["prefill"] * args.num_prefill + ["decode"] * (args.num_workers - args.num_prefill)
    return [(role, args.model, ("--device", device, *worker_argv, *extra))
            for role, device in zip(roles, devices, strict=True)]


def run_setup(kind: str, args, devices: list[str], worker_argv: tuple[str, ...], workload: list[Request],
              num_gpus: int, phases: list[Phase] | None) -> dict:
    setup = setup_name(kind, args)
    specs = setup_specs(kind, args, devices, worker_argv)
    row = {"kind": "setup", "setup": setup, "setup_kind": kind,
           "workers": [f"{role}@{extra[1]}" for role, _, extra in specs]}
    print(f"# {setup}: starting {', '.join(row['workers'])}", file=sys.stderr, flush=True)
    settings = planner_settings(args)
    router_argv = settings.router_argv(args.slo_ttft_ms, args.slo_itl_ms)
    try:
        with daemons(*specs) as started:
            prefill = [d.address for d in started if d.role == "prefill"]
            decode = [d for d in started if d.role == "decode"]
            threshold = NO_DIRECT if prefill else ALWAYS_DIRECT
            router = start_router(args.model, prefill, [d.address for d in decode], *args.router_args.split(),
                                  direct_decode_threshold=threshold)
            try:
                asyncio.run(warm_up(router.url, [len(r.prompt) for r in workload], args.request_timeout_s))
                if kind == "planner":  # a fresh router: the planner's window must not start with the warm-up
                    stop_router(router)
                    router = start_router(args.model, prefill, [d.address for d in decode], *router_argv,
                                          *args.router_args.split(),
                                          direct_decode_threshold=threshold)
                counted = started if kind == "planner" else decode
                before = [finished_on(d, kind == "planner") for d in counted]
                routes_before = routes_of(router.url)
                pulls_before = pull_totals(decode)
                watch = PlannerWatch(router.url, min(1.0, settings.interval_s / 2)) if kind == "planner" else None
                results, duration = asyncio.run(drive(router.url, workload, args.request_timeout_s,
                                                      watch.start if watch else None))
                if watch:
                    watch.stop()
                row.update(summarize(results, duration, args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3, num_gpus))
                row["per_request"] = [
                    {"phase": req.phase, "arrival_s": round(req.arrival_s, 3), "prompt": len(req.prompt),
                     "output": req.output_len, "ok": r["ok"], "ttft_ms": round(r["ttft"] * 1e3, 1) if r["ok"] else None,
                     "t2t_ms": round(r["t2t"] * 1e3, 1) if r["ok"] and r["t2t"] is not None else None,
                     "tpot_ms": round(r["tpot"] * 1e3, 2) if r["ok"] else None}
                    for req, r in zip(workload, results, strict=True)]
                if phases:
                    row["phases"] = summarize_phases(results, workload, phases, duration, args.slo_ttft_ms / 1e3,
                                                     args.slo_itl_ms / 1e3, num_gpus)
                after = [finished_on(d, kind == "planner") for d in counted]
                key = "finished_by_worker" if kind == "planner" else "decode_finished"
                row[key] = [None if None in (a, b) else a - b for a, b in zip(after, before, strict=True)]
                row["routes"] = {k: v - routes_before.get(k, 0) for k, v in routes_of(router.url).items()}
                if prefill:
                    row["pull_profile"] = pull_profile(pulls_before, pull_totals(decode))
                if watch:
                    row["planner"] = planner_report(watch, router.url, started, settings, args, phases)
                if kind == "colocated" and args.workload == "mix":
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
    # The summary now, so a run cut short by its time limit still leaves the setups it finished.
    print(f"# {setup}: done; row " + json.dumps({k: v for k, v in row.items() if k != "per_request"}),
          file=sys.stderr, flush=True)
    return row


def planner_settings(args) -> PlannerSettings:
    return PlannerSettings(args.planner_interval_s, args.planner_window_s, args.planner_hysteresis,
                           args.planner_dwell_s, args.planner_margin, args.planner_decode_tokens_per_s)


def planner_report(watch: PlannerWatch, router_url: str, workers: list[Daemon], settings: PlannerSettings, args,
                   phases: list[Phase] | None) -> dict:
    """What the planner did during the load: its switch decisions and the roles over time (polled), and the
    router's and workers' counters of switches and migrations."""
    bounds = [(p.name, p.start_s, p.end_s) for p in phases or ()]
    router = scrape(f"{router_url}/metrics")
    worker_switches = {}
    for d in workers:
        counts = series(scrape(f"http://127.0.0.1:{d.metrics_port}/metrics"), "pdserve_role_switches_total")
        if counts:
            worker_switches[d.address] = counts
    timeline = [{**e, "phase": phase_of(e["t_s"], bounds)} for e in watch.timeline()]
    report = {
        "settings": settings.describe(), "switch_decisions": watch.switches(), "timeline": timeline,
        "router_switches": series(router, "pdserve_planner_switches_total"), "worker_switches": worker_switches,
        "migrated": int(sum(series(router, "pdserve_router_migrated_requests_total").values())),
        "decisions_by_reason": {k.removeprefix("reason="): int(v)
                                for k, v in series(router, "pdserve_planner_decisions_total").items()},
        "decisions": watch.decisions,
        "by_phase": counts_by_phase(watch.events, bounds),
    }
    if args.num_workers < 3:
        report["cannot_switch"] = (f"with {args.num_workers} workers the planner cannot switch: it keeps at least one "
                                   "worker per role, so 1P1D is the only split (this setup is 1P1D with switchable "
                                   "workers and the planner evaluating); --num-workers 3 lets it act")
    return report


RATIO_FIELDS = ("req_s", "output_tok_s", "goodput_req_s", "ttft_p50_ms", "ttft_p99_ms", "t2t_p50_ms", "itl_p50_ms",
                "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms")


def ratio_row(rows: list[dict], a_name: str, b_name: str) -> dict | None:
    by = {r["setup"]: r for r in rows if "error" not in r}
    if a_name not in by or b_name not in by:
        return None
    a, b = by[a_name], by[b_name]

    def ratio(x: float, y: float) -> float:
        return x / y if y else (float("nan") if not x else float("inf"))

    return {"kind": "ratio", "setup": f"{a_name}/{b_name}", **{k: ratio(a[k], b[k]) for k in RATIO_FIELDS}}


# ---- devices and arguments ---------------------------------------------------------------------


def resolve_devices(args) -> tuple[list[str], int, str | None]:
    """One device per worker, distinct GPUs used, and a note to print loudly (or None)."""
    n = args.num_workers
    device = args.device.strip()
    if device not in ("auto", "cpu", "cuda"):
        sys.exit(f"--device {device}: expected auto, cpu or cuda (pick GPUs with --gpus I,J,...)")
    visible = 0
    if device != "cpu":
        from services.launch.placement import detect_gpus

        visible = detect_gpus()
        if device == "cuda" and not visible:
            sys.exit("--device cuda: no CUDA device is visible")
    if not visible:
        if args.gpus:
            print("# note: --gpus is ignored on CPU", file=sys.stderr)
        return ["cpu"] * n, 0, None
    try:
        gpus = [int(g) for g in (args.gpus or ",".join(map(str, range(n)))).split(",")]
    except ValueError:
        gpus = []
    if len(gpus) != n:
        sys.exit(f"--gpus {args.gpus}: expected {n} GPU indices, one per worker (--num-workers {n})")
    if max(gpus) >= visible or min(gpus) < 0:
        hint = f" (only {visible}: list a GPU more than once, e.g. --gpus {','.join(['0'] * n)}, to share it, which " \
            f"is not the {n}-GPU comparison)" if visible < n else ""
        sys.exit(f"--gpus {','.join(map(str, gpus))}: {visible} CUDA device(s) visible{hint}")
    note = None
    if len(set(gpus)) < n:
        if args.num_kv_blocks is None:
            sys.exit(f"--gpus {','.join(map(str, gpus))}: workers of a setup share a GPU; pass --num-kv-blocks so "
                     "their KV pools fit (each sizes its pool from the free memory otherwise)")
        note = (f"!!! NOTE: the {n} workers of each setup share {len(set(gpus))} GPU(s) ({','.join(map(str, gpus))}): "
                f"this is NOT the {n}-GPU disaggregated vs colocated comparison; the setups only share the devices' "
                "time. !!!")
    return [f"cuda:{g}" for g in gpus], len(set(gpus)), note


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto: cuda when visible)")
    ap.add_argument("--gpus", default=None, metavar="I,J,...",
                    help="one GPU per worker, prefill workers first (default 0,1,...; repeat one to share it)")
    ap.add_argument("--num-workers", type=int, default=2, help="workers in every setup (default 2)")
    ap.add_argument("--num-prefill", type=int, default=1,
                    help="prefill workers of the disaggregated setups (and the planner's start); default 1")
    ap.add_argument("--workload", choices=("mix", "shifting"), default="mix",
                    help="mix: one length mix throughout (default); shifting: prefill-heavy, decode-heavy, then mix")
    ap.add_argument("--request-rate", type=float, default=None,
                    help=f"mix: Poisson arrivals per second, or inf (default GPU {DEFAULT_LOAD['gpu'][1]:g}, "
                         f"CPU {DEFAULT_LOAD['cpu'][1]:g}, --quick {DEFAULT_LOAD['quick'][1]:g})")
    ap.add_argument("--num-requests", type=int, default=None,
                    help=f"mix: default GPU {DEFAULT_LOAD['gpu'][0]}, CPU {DEFAULT_LOAD['cpu'][0]}, "
                         f"--quick {DEFAULT_LOAD['quick'][0]}")
    ap.add_argument("--mix", type=parse_mix, default=None, metavar="P:O,...",
                    help=f"mix: prompt_len:output_len pairs, picked uniformly (default GPU {GPU_MIX}, CPU {CPU_MIX}, "
                         f"--quick {QUICK_MIX})")
    ap.add_argument("--phase-duration-s", type=float, default=None,
                    help=f"shifting: each phase's arrival window (default GPU {SHIFTING['gpu'][3]:g}, CPU "
                         f"{SHIFTING['cpu'][3]:g}, --quick {SHIFTING['quick'][3]:g})")
    ap.add_argument("--phase-rates", default=None, metavar="R1,R2,R3",
                    help="shifting: Poisson arrivals per second in each phase (default GPU "
                         f"{','.join(map(str, SHIFTING['gpu'][2]))}, CPU {','.join(map(str, SHIFTING['cpu'][2]))})")
    ap.add_argument("--prefill-heavy-mix", type=parse_mix, default=None, metavar="P:O,...",
                    help=f"shifting: the first phase's mix (default GPU {SHIFTING['gpu'][0]}, CPU "
                         f"{SHIFTING['cpu'][0]})")
    ap.add_argument("--decode-heavy-mix", type=parse_mix, default=None, metavar="P:O,...",
                    help=f"shifting: the second phase's mix (default GPU {SHIFTING['gpu'][1]}, CPU "
                         f"{SHIFTING['cpu'][1]}); the third draws from both")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrivals, lengths and prompt ids")
    ap.add_argument("--slo-ttft-ms", type=float, default=None,
                    help=f"default GPU {DEFAULT_SLO_MS['gpu'][0]:g}, CPU {DEFAULT_SLO_MS['cpu'][0]:g} "
                         f"(shifting: {SHIFTING_SLO_MS['cpu'][0]:g})")
    ap.add_argument("--slo-itl-ms", type=float, default=None,
                    help="bound on a request's mean ITL (TPOT) "
                         f"(default GPU {DEFAULT_SLO_MS['gpu'][1]:g}, CPU {DEFAULT_SLO_MS['cpu'][1]:g} "
                         f"(shifting: {SHIFTING_SLO_MS['cpu'][1]:g}))")
    for name, index, kind, what in (("interval-s", 0, float, "evaluate every this many seconds"),
                                    ("window-s", 1, float, "size the roles by the requests of this last window"),
                                    ("hysteresis", 2, int, "switch after this many evaluations in a row"),
                                    ("dwell-s", 3, float, "at least this long between two switches"),
                                    ("margin", 4, float, "workers past the rounding boundary before a switch"),
                                    ("decode-tokens-per-s", 5, float, "decode capacity until the fit")):
        ap.add_argument(f"--planner-{name}", type=kind, default=None,
                        help=f"planner setup: {what} (default GPU {PLANNER_DEFAULTS['gpu'][index]:g}, CPU "
                             f"{PLANNER_DEFAULTS['cpu'][index]:g})")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="every worker's --max-num-seqs")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="every worker's --num-kv-blocks (needed when workers share a GPU)")
    ap.add_argument("--worker-args", default="", help='more worker flags, e.g. "--enforce-eager"')
    ap.add_argument("--router-args", default="", help='more router flags, e.g. "--no-kv-parts"')
    ap.add_argument("--request-timeout-s", type=float, default=600.0, help="a request slower than this fails")
    ap.add_argument("--setups", default=None,
                    help="which of disagg, colocated, planner (or their names, e.g. 1p1d) to run (default: the "
                         "first two; with --workload shifting all three)")
    ap.add_argument("--quick", action="store_true",
                    help=f"CPU smoke: {DEFAULT_LOAD['quick'][0]} requests of {QUICK_MIX}, fewer router probes "
                         f"(shifting: {SHIFTING['quick'][3]:g} s phases)")
    ap.add_argument("--json", action="store_true", help="print JSON lines (one per setup, one of ratios)")
    ap.add_argument("--json-out", default=None, help="also write the JSON lines to this file")
    args = ap.parse_args(argv)
    if not 1 <= args.num_prefill < args.num_workers:
        ap.error("--num-prefill must be at least 1 and leave at least one decode worker (--num-workers)")
    if args.workload == "shifting" and (args.mix or args.num_requests or args.request_rate):
        ap.error("--workload shifting takes --phase-rates, --phase-duration-s and the phase mixes, not --mix, "
                 "--num-requests or --request-rate")
    names = {setup_name(kind, args): kind for kind in SETUP_KINDS}
    wanted = args.setups.split(",") if args.setups else \
        list(SETUP_KINDS if args.workload == "shifting" else SETUP_KINDS[:2])
    unknown = [s for s in wanted if s not in SETUP_KINDS and s not in names]
    if unknown:
        ap.error(f"--setups: unknown {', '.join(unknown)} (expected {', '.join(SETUP_KINDS)} or "
                 f"{', '.join(names)})")
    args.setup_kinds = [k for k in SETUP_KINDS if k in {names.get(s, s) for s in wanted}]
    return args


def resolve_workload(args, kind: str) -> tuple[list[Request], list[Phase] | None, str]:
    """The requests, the phases (shifting) and a line describing them."""
    if args.workload == "mix":
        load = "quick" if args.quick else kind
        args.num_requests = args.num_requests or DEFAULT_LOAD[load][0]
        args.request_rate = args.request_rate or DEFAULT_LOAD[load][1]
        if args.num_requests < 1 or args.request_rate <= 0:
            sys.exit("--num-requests and --request-rate must be positive")
        mix = args.mix or parse_mix(QUICK_MIX if args.quick else CPU_MIX if kind == "cpu" else GPU_MIX)
        workload = make_workload(mix, args.num_requests, args.request_rate, args.seed)
        args.mix = mix
        return workload, None, (f"{args.num_requests} requests, Poisson {args.request_rate:g} req/s (seed {args.seed}, "
                                f"{workload[-1].arrival_s:.1f} s of arrivals), mix "
                                f"{','.join(f'{p}:{o}' for p, o in mix)} (prompt:output tokens, uniform)")
    heavy, light, rates, duration = SHIFTING["quick" if args.quick else kind]
    try:
        rates = tuple(float(r) for r in args.phase_rates.split(",")) if args.phase_rates else rates
    except ValueError:
        rates = ()
    if len(rates) != 3 or min(rates) <= 0:
        sys.exit(f"--phase-rates {args.phase_rates}: expected three positive rates")
    duration = args.phase_duration_s or duration
    phases = make_phases(args.prefill_heavy_mix or parse_mix(heavy), args.decode_heavy_mix or parse_mix(light),
                         rates, duration)
    workload = make_shifting_workload(phases, args.seed)
    args.mix = sorted({m for p in phases for m in p.mix})
    counts = Counter(r.phase for r in workload)
    described = "; ".join(f"{p.name} {p.start_s:g}-{p.end_s:g} s: {counts[p.name]} requests at {p.rate:g}/s of "
                          f"{','.join(f'{a}:{b}' for a, b in p.mix)}" for p in phases)
    return workload, phases, (f"shifting workload, {len(workload)} requests (seed {args.seed}), Poisson per phase "
                              f"(prompt:output tokens, uniform): {described}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices, num_gpus, note = resolve_devices(args)
    kind = "cpu" if devices[0] == "cpu" else "gpu"
    workload, phases, described = resolve_workload(args, kind)
    slo = SHIFTING_SLO_MS if args.workload == "shifting" else DEFAULT_SLO_MS
    args.slo_ttft_ms = args.slo_ttft_ms or slo[kind][0]
    args.slo_itl_ms = args.slo_itl_ms or slo[kind][1]
    for name, value in zip(("interval_s", "window_s", "hysteresis", "dwell_s", "margin", "decode_tokens_per_s"),
                           PLANNER_DEFAULTS[kind], strict=True):
        if getattr(args, f"planner_{name}") is None:
            setattr(args, f"planner_{name}", value)
    max_model_len = max(p + max(o, WARM_UP_TOKENS) for p, o in args.mix)
    worker_argv = ("--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(max_model_len),
                   *(("--num-kv-blocks", str(args.num_kv_blocks)) if args.num_kv_blocks else ()),
                   *shlex.split(args.worker_args))
    names = {k: setup_name(k, args) for k in SETUP_KINDS}
    p, d, n = args.num_prefill, args.num_workers - args.num_prefill, args.num_workers
    header = [
        f"# serve: {args.model or 'bundled SmolLM2-135M-Instruct'}, {n} workers per setup on "
        f"{','.join(devices)}; {described}",
        f"# setups: {names['disagg']} = {p} prefill + {d} decode workers, every request disaggregated; "
        f"{names['colocated']} = {n} decode workers that prefill their own requests; {names['planner']} = the "
        f"{names['disagg']} workers with --role-switching and the router's planner acting; "
        f"workers: {' '.join(worker_argv)}",
        f"# SLO: TTFT <= {args.slo_ttft_ms:g} ms and mean ITL (TPOT) <= {args.slo_itl_ms:g} ms; "
        "goodput = requests meeting it / duration" + (f"; per GPU: / {num_gpus}" if num_gpus else ""),
    ]
    if "planner" in args.setup_kinds:
        header.append(f"# planner: {planner_settings(args).describe()}; targets = the SLO above")
        if n < 3:
            header.append(f"# !!! with {n} workers the planner cannot switch (at least one worker per role): "
                          f"{names['planner']} is {names['disagg']} with switchable workers; --num-workers 3 lets "
                          "it act !!!")
    if note:
        header.insert(0, note)
    print("\n".join(header), file=sys.stderr if args.json else sys.stdout, flush=True)

    rows = [run_setup(k, args, devices, worker_argv, workload, num_gpus, phases) for k in args.setup_kinds]
    for r in rows:
        r.update(devices=list(devices), num_gpus=num_gpus, workload=args.workload, seed=args.seed,
                 mix=[list(m) for m in args.mix], slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms,
                 slo_itl_stat="mean", max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                 num_workers=n, num_prefill=p)
        if phases:
            r["phase_bounds"] = [[ph.name, ph.start_s, ph.end_s, ph.rate, [list(m) for m in ph.mix]] for ph in phases]
        else:
            r["request_rate"] = args.request_rate
    ratios = [q for q in (ratio_row(rows, names["disagg"], names["colocated"]),
                          ratio_row(rows, names["planner"], names["disagg"]),
                          ratio_row(rows, names["planner"], names["colocated"])) if q]
    phase_ratios = phase_ratio_rows(rows, names["planner"], [names["disagg"], names["colocated"]]) if phases else []
    status = 1 if any("error" in r for r in rows) else 0
    if emit_json(rows + ratios + phase_ratios, args.json_out, args.json):
        return status
    print_table(rows, ratios, note)
    if phases:
        print_phase_tables(rows, phase_ratios, [(ph.name, ph.start_s, ph.end_s) for ph in phases])
    for r in rows:
        print_planner_row(r)
    return status


def print_table(rows: list[dict], ratios: list[dict], note: str | None) -> None:
    cols = [("ok", "completed", "d"), ("fail", "failed", "d"), ("dur s", "duration_s", ".1f"),
            ("req/s", "req_s", ".2f"), ("tok/s", "output_tok_s", ".1f"), ("good/s", "goodput_req_s", ".2f"),
            ("good/GPU", "goodput_per_gpu_req_s", ".2f"), ("TTFT p50", "ttft_p50_ms", ".0f"),
            ("p99", "ttft_p99_ms", ".0f"), ("T2T p50", "t2t_p50_ms", ".0f"), ("p99", "t2t_p99_ms", ".0f"),
            ("ITL p50", "itl_p50_ms", ".1f"), ("p99", "itl_p99_ms", ".1f"),
            ("E2E p50", "e2e_p50_ms", ".0f"), ("p99", "e2e_p99_ms", ".0f")]
    width = max([17, *(len(r["setup"]) for r in rows + ratios)])
    print(f"{'setup':>{width}} " + " ".join(f"{name:>9}" for name, _, _ in cols) + "   (ms for latencies)")
    for r in rows:
        if "error" in r:
            print(f"{r['setup']:>{width}}  could not run: {r['error']}")
            continue
        cells = [format(r[key], fmt) if r[key] is not None else "-" for _, key, fmt in cols]
        print(f"{r['setup']:>{width}} " + " ".join(f"{c:>9}" for c in cells))
    for q in ratios:
        cells = [format(q[key], ".2f") + "x" if key in q else "" for _, key, _ in cols]
        print(f"{q['setup']:>{width}} " + " ".join(f"{c:>9}" for c in cells))
    for r in rows:
        if "error" in r:
            continue
        finished = f"decode workers finished {r['decode_finished']}" if "decode_finished" in r else \
            f"workers finished {r['finished_by_worker']}"
        extra = f"SLO met by {r['slo_met']}/{r['requests']}; {finished}; routes {r['routes']}; max send lag " \
                f"{r['max_send_lag_ms']:.1f} ms"
        print(f"# {r['setup']}: {extra}")
        if r.get("pull_profile", {}).get("pulls"):
            profile = r["pull_profile"]
            stages = " ".join(f"{k}={v:.2f}" for k, v in profile["mean_stage_ms"].items())
            print(f"# {r['setup']}: {profile['pulls']} pulls ({profile.get('parts_coalesced', 0)} more parts read "
                  f"with a later one), {profile['gib']} GiB; mean ms per pull: {stages}")
            if "mean_join_ms" in profile:
                joins = " ".join(f"{k}={v:.2f}" for k, v in profile["mean_join_ms"].items())
                print(f"# {r['setup']}: last ticket to first decode token, mean ms per request: {joins}")
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
