"""Serving with TP workers placed on their own GPUs: greedy tokens, TTFT and in-service pull rate.

Each setup is one prefill and one decode worker (``tp@devices`` per side) behind a router, started
fresh from ``services.launch.spawn`` (real daemons, real NIXL), driven with streaming completions of
random prompt token ids (greedy, ignore_eos), and stopped. Every completion is compared with a
colocated TP1 engine run in this process first, on the first device named. The decode worker's
own metrics give the bytes it pulled and the time its pulls took::

    python bench/tp_serving.py --model dummy:qwen3-0.6b --dtype float32 \\
        --setups "1@cuda:0/1@cuda:1; 2@cuda:0,cuda:1/1@cuda:1; 1@cuda:0/2@cuda:0,cuda:1"
    python bench/tp_serving.py --device-free-cpu            # every side on CPU (no GPU needed)

Setup syntax: ``PREFILL/DECODE``, each ``TP@DEVICE[,DEVICE...]`` (one device per rank); setups
separated by ``;``. When the two sides' TP differ, both use head-major KV blocks (HND), as
``pdserve up`` does. Greedy equality on GPU is only meaningful in float32 (bf16 all-reduces in a
different order flip near-ties of a random model).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit_json  # noqa: E402
from services.launch.spawn import Daemon, daemons, start_router, stop_router  # noqa: E402


def parse_side(text: str) -> tuple[int, str]:
    tp, _, devices = text.strip().partition("@")
    if not tp.isdigit() or not devices or len(devices.split(",")) != int(tp):
        raise ValueError(f"{text!r}: expected TP@DEVICE[,DEVICE...] with one device per rank")
    return int(tp), devices


def reference(model: str, dtype: str, device: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of a colocated TP1 engine (freed before the setups start)."""
    import torch

    from services.contract.sampling_params import SamplingParams
    from services.engine.engine_config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device, num_kv_blocks=1024))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = [out.token_ids for out in engine.generate(prompts, params)]
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens


def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One streaming completion: (seconds to the first token, every token id)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started, first, tokens = time.perf_counter(), None, []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0].get("logprobs"):
                first = first or time.perf_counter()
                tokens += [int(t.removeprefix("token_id:")) for t in choices[0]["logprobs"]["tokens"]]
    return (first or time.perf_counter()) - started, tokens


def metric(d: Daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def run_setup(args, setup: str, prompts: list[list[int]], expected: list[list[int]]) -> dict:
    p_side, d_side = setup.split("/")
    (p_tp, p_dev), (d_tp, d_dev) = parse_side(p_side), parse_side(d_side)
    common = ["--dtype", args.dtype, "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", "32"]
    if p_tp != d_tp:
        common += ["--kv-block-order", "HND"]
    started = time.perf_counter()
    with daemons(("prefill", args.model, (*common, "--tp", str(p_tp), "--device", p_dev)),
                 ("decode", args.model, (*common, "--tp", str(d_tp), "--device", d_dev))) as (prefill, decode):
        up_s = time.perf_counter() - started
        router = start_router(args.model, [prefill.address], [decode.address],
                              *(["--no-kv-parts"] if args.no_kv_parts else []))
        try:
            complete(router.url, prompts[0][:32], 2)  # warm-up (and first handshake)
            before = {n: metric(decode, n) for n in ("pdserve_kv_transfer_bytes_total",
                                                     "pdserve_kv_transfer_seconds_sum",
                                                     "pdserve_kv_transfer_seconds_count")}
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(lambda p: complete(router.url, p, args.max_tokens), prompts))
            elapsed = time.perf_counter() - t0
            after = {n: metric(decode, n) - before[n] for n in before}
        finally:
            stop_router(router)
    ttft = sorted(r[0] for r in results)
    pulled, pull_s, pulls = (after["pdserve_kv_transfer_bytes_total"], after["pdserve_kv_transfer_seconds_sum"],
                             after["pdserve_kv_transfer_seconds_count"])
    return {"setup": setup.strip(), "p_tp": p_tp, "p_devices": p_dev, "d_tp": d_tp, "d_devices": d_dev,
            "startup_s": up_s, "requests": len(prompts),
            "greedy_equal": sum(r[1] == e for r, e in zip(results, expected, strict=True)),
            "ttft_p50_ms": statistics.median(ttft) * 1e3, "output_tok_s": len(prompts) * args.max_tokens / elapsed,
            "pulls": int(pulls), "pulled_gb": pulled / 1e9, "pull_ms_mean": pull_s / max(pulls, 1) * 1e3,
            "pull_gb_s": pulled / pull_s / 1e9 if pull_s else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:qwen3-0.6b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--setups", default="1@cuda:0/1@cuda:1; 2@cuda:0,cuda:1/1@cuda:1; 1@cuda:0/2@cuda:0,cuda:1")
    ap.add_argument("--device-free-cpu", action="store_true", help="run the TP pairs 1/1, 2/1, 1/2 on CPU")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--no-kv-parts", action="store_true",
                    help="the router's --no-kv-parts: each prompt's KV in one pull after its prefill")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    setups = [s for s in args.setups.split(";") if s.strip()]
    if args.device_free_cpu:
        setups = ["1@cpu/1@cpu", "2@cpu,cpu/1@cpu", "1@cpu/2@cpu,cpu"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    first_device = parse_side(setups[0].split("/")[0])[1].split(",")[0]
    expected = reference(args.model, args.dtype, first_device, prompts, args.max_tokens)
    rows = []
    for setup in setups:
        try:
            rows.append(run_setup(args, setup, prompts, expected))
        except Exception as e:  # noqa: BLE001 - one failed setup must not hide the others
            rows.append({"setup": setup.strip(), "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    emit_json(rows, args.json_out, to_stdout=False)
    print(f"\n# TP serving, {args.model} {args.dtype}, {args.num_requests} requests x {args.prompt_len} prompt "
          f"tokens, {args.max_tokens} out, concurrency {args.concurrency}, KV "
          + ("in one pull" if args.no_kv_parts else "per prefill chunk"))
    print(f"{'prefill':>22} {'decode':>22} {'greedy=':>8} {'TTFT p50 ms':>11} {'tok/s':>8} {'pulls':>5} "
          f"{'GB':>7} {'ms/pull':>8} {'GB/s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['setup']:>46} failed: {r['error'][:120]}")
            continue
        print(f"{str(r['p_tp']) + '@' + r['p_devices']:>22} {str(r['d_tp']) + '@' + r['d_devices']:>22} "
              f"{r['greedy_equal']:>4}/{r['requests']:<3} {r['ttft_p50_ms']:>11.1f} {r['output_tok_s']:>8.1f} "
              f"{r['pulls']:>5} {r['pulled_gb']:>7.3f} {r['pull_ms_mean']:>8.2f} {r['pull_gb_s']:>7.2f}")


if __name__ == "__main__":
    main()
