"""The host KV tier: TTFT of a repeated long prompt with a device hit, a host-tier hit and no hit, and
the tier's store and load throughput beside plain pinned-memory copies of the same bytes, in one run.

    python bench/offload.py                                         # CPU smoke: dummy:tiny, 1k tokens
    python bench/offload.py --model dummy:llama-3.1-8b --dtype bfloat16 --prompt-len 8192 \\
        --offload-gib 16 --factor 4

TTFT here is the engine's: ``add_request`` to the first sampled token (no HTTP, no transfer), one
prompt at a time, median of ``--rounds`` fresh prompts per case:

- no hit: a prompt never seen;
- device hit: the same prompt again, its blocks still in the device prefix cache;
- host hit: the same prompt after the device prefix cache was emptied (``reset_prefix_cache``), so
  every full span comes back from the host tier (the load is inside the TTFT) and only the last
  partial span is computed.

Store throughput: the stores a prefill queues (all its full spans, one copy job) timed from the
end of that step to the copy's completion; load throughput: a host hit's load job, submit to
completion. Each is printed beside a pinned copy of the same number of bytes (one contiguous
``copy_`` device -> pinned host, and back), measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench._common import emit_json  # noqa: E402
from services.contract.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine_config import EngineConfig  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _poll(engine: LLMEngine) -> None:
    """Take in finished copies; sleeping a little lets the copier's thread have the GIL (a tight loop
    would make each hand-over wait for the interpreter's 5 ms switch interval)."""
    engine.scheduler.take_finished_loads()
    time.sleep(5e-5)


def _settle(engine: LLMEngine) -> None:
    """Until every copy in flight is taken in."""
    tier = engine.host_tier
    while tier.stats().store_queue_depth or tier.stats().loads_in_flight or tier.has_completions:
        _poll(engine)


def ttft(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    """Seconds from add_request to the first token (the request finishes with it)."""
    _sync(engine.device)
    started = time.perf_counter()
    request = engine.add_request(request_id, prompt, FIRST_TOKEN)
    while not request.finished:
        engine.step()
        if not engine.last_step_ran:  # waiting for a load: as the engine thread would, let the copier run
            time.sleep(5e-5)
    return time.perf_counter() - started


def store_seconds(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Prefill a new prompt, then time its stores from the end of the step that queued them."""
    tier = engine.host_tier
    before = tier.stats().bytes_stored
    request = engine.add_request(request_id, prompt, FIRST_TOKEN)
    while not request.finished:
        engine.step()
    queued = time.perf_counter()
    while tier.stats().store_queue_depth:
        _poll(engine)
    return time.perf_counter() - queued, tier.stats().bytes_stored - before


def load_seconds(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """A host hit's load alone: submitted by the step that admits the request, timed to completion."""
    tier = engine.host_tier
    before = tier.stats().bytes_loaded
    engine.kv_manager.reset_prefix_cache()
    request = engine.add_request(request_id, prompt, FIRST_TOKEN)
    engine.step()  # admits it: the load starts
    submitted = time.perf_counter()
    while engine.scheduler.num_loading:
        _poll(engine)
    elapsed = time.perf_counter() - submitted
    while not request.finished:
        engine.step()
    return elapsed, tier.stats().bytes_loaded - before


def pinned_copy_seconds(num_bytes: int, device: torch.device, rounds: int) -> tuple[float, float]:
    """(device -> pinned host, pinned host -> device) seconds for one contiguous copy of ``num_bytes``."""
    pin = device.type == "cuda"
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    out = []
    for dst, source in ((host, src), (src, host)):
        times = []
        for _ in range(rounds + 1):
            _sync(device)
            t = time.perf_counter()
            dst.copy_(source, non_blocking=pin)
            _sync(device)
            times.append(time.perf_counter() - t)
        out.append(statistics.median(times[1:]))
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--factor", type=int, default=4, help="--kv-offload-block-factor")
    ap.add_argument("--offload-gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    blocks_per_prompt = -(-args.prompt_len // args.block_size) + 1
    engine = LLMEngine(EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_kv_blocks=4 * blocks_per_prompt, max_num_batched_tokens=max(8192, args.prompt_len),
        max_model_len=args.prompt_len + 16, kv_offload_bytes=int(args.offload_gib * 2**30),
        kv_offload_block_factor=args.factor))
    dev = engine.device
    vocab = min(engine.model_config.vocab_size, 30000)
    gen = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist()

    ttft(engine, "warm", prompt())  # kernels, allocations
    _settle(engine)
    cases: dict[str, list[float]] = {"no hit": [], "device hit": [], "host hit": []}
    stores, loads = [], []
    for r in range(args.rounds):
        p = prompt()
        seconds, num_bytes = store_seconds(engine, f"s{r}", p)  # a no-hit prefill, its stores timed
        stores.append((seconds, num_bytes))
        cases["device hit"].append(ttft(engine, f"d{r}", p))
        _settle(engine)
        engine.kv_manager.reset_prefix_cache()
        cases["host hit"].append(ttft(engine, f"h{r}", p))
        _settle(engine)
        loads.append(load_seconds(engine, f"l{r}", p))
        _settle(engine)
        cases["no hit"].append(ttft(engine, f"n{r}", prompt()))
        _settle(engine)

    store_s, store_bytes = statistics.median(s for s, _ in stores), stores[0][1]
    load_s, load_bytes = statistics.median(s for s, _ in loads), loads[0][1]
    d2h_s, _ = pinned_copy_seconds(store_bytes, dev, args.rounds)
    _, h2d_s = pinned_copy_seconds(load_bytes, dev, args.rounds)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    base = statistics.median(cases["no hit"])
    common = dict(device=device_name, model=engine.source.name, dtype=engine.dtype, prompt_len=args.prompt_len,
                  factor=args.factor, block_size=args.block_size)
    rows = [dict(common, case=name, ttft_ms=statistics.median(v) * 1e3, vs_no_hit=statistics.median(v) / base)
            for name, v in cases.items()]
    rows += [dict(common, case="store", num_bytes=store_bytes, seconds=store_s, gbs=store_bytes / store_s / 1e9,
                  pinned_gbs=store_bytes / d2h_s / 1e9, vs_pinned=d2h_s / store_s),
             dict(common, case="load", num_bytes=load_bytes, seconds=load_s, gbs=load_bytes / load_s / 1e9,
                  pinned_gbs=load_bytes / h2d_s / 1e9, vs_pinned=h2d_s / load_s)]
    engine.close()
    if emit_json(rows, args.json_out, args.json):
        return
    print(f"# host KV tier: {engine.source.name} {engine.dtype} on {device_name}, prompt {args.prompt_len} tokens, "
          f"block {args.block_size}, factor {args.factor}, median of {args.rounds}")
    print(f"{'case':>12} {'TTFT ms':>10} {'vs no hit':>10}")
    for r in rows[:3]:
        print(f"{r['case']:>12} {r['ttft_ms']:>10.2f} {r['vs_no_hit']:>10.3f}")
    print(f"{'copy':>12} {'MiB':>8} {'ms':>8} {'GB/s':>8} {'pinned GB/s':>12} {'vs pinned':>10}")
    for r in rows[3:]:
        print(f"{r['case']:>12} {r['num_bytes'] / 2**20:>8.1f} {r['seconds'] * 1e3:>8.2f} {r['gbs']:>8.2f} "
              f"{r['pinned_gbs']:>12.2f} {r['vs_pinned']:>10.2f}")


if __name__ == "__main__":
    main()
