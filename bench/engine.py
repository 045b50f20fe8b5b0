"""Engine throughput: prefill and decode tokens/s at several batch sizes, beside their floors.

    python bench/engine.py                                    # CPU, bundled SmolLM2 GGUF, fp32
    python bench/engine.py --model dummy:llama-3.1-8b --dtype bfloat16 --device cuda

On CUDA every decode step is timed three times: through the decode CUDA graphs with pipelined
steps (the engine's default), through the graphs with each step waiting for its tokens ("sync",
``async_scheduling`` off), and eagerly (the same engine with its graph runner detached), so the
columns share weights, KV and prompts; --enforce-eager builds the engine without graphs and times
the eager path only.

Floors (speed of light, ``bench/floors.py``): a decode step must read every weight once (a MoE model: the
experts its batch picks), the context's KV and each request's state, so it cannot beat those bytes / memory
bandwidth; a prefill cannot beat 2 * active params * tokens (plus causal attention) / peak FLOP/s.
On CUDA the peaks come from the device's datasheet; on CPU they are measured here (a large
matmul and a large copy), so the floor is this machine's own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import services  # noqa: E402,F401,I001  (oneDNN ISA cap before torch)
import torch  # noqa: E402

from bench._common import GPU_PEAKS, emit_json  # noqa: E402
from bench.floors import decode_floor_bytes, prefill_flops  # noqa: E402
from services.engine.engine_config import EngineConfig  # noqa: E402
from services.engine.kv_cache.buffers import TORCH_DTYPES  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.contract.sampling_params import SamplingParams  # noqa: E402
from services.kv.spec.layout import LayoutKind  # noqa: E402



def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine_peaks(device: torch.device, dtype: torch.dtype) -> tuple[float, float, str]:
    """(memory bandwidth B/s, matmul FLOP/s, where the numbers come from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bw, flops) in GPU_PEAKS.items():
            if key in name:
                return bw, flops, f"datasheet {key}"
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    t = time.perf_counter()
    reps = 3
    for _ in range(reps):
        a @ b
    _sync(device)
    flops = 2 * n**3 * reps / (time.perf_counter() - t)
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    bandwidth = 2 * src.numel() * reps / (time.perf_counter() - t)  # read + write
    return bandwidth, flops, "measured on this machine"


def bench_prefill(engine: LLMEngine, batch: int, prompt_len: int, rounds: int) -> float:
    """Seconds to prefill `batch` distinct prompts (first token sampled), best of `rounds`."""
    best = float("inf")
    vocab = min(engine.model_config.vocab_size, 30000)
    for r in range(rounds):
        gen = torch.Generator().manual_seed(1000 * r + batch)
        prompts = [torch.randint(100, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"prefill-{batch}-{r}-{i}", p, params)
        _sync(engine.device)
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        _sync(engine.device)
        best = min(best, time.perf_counter() - t)
    return best


def bench_decode(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    """Seconds per decode step with `batch` running sequences (prefill excluded)."""
    vocab = min(engine.model_config.vocab_size, 30000)
    gen = torch.Generator().manual_seed(7 + batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{batch}-{i}", torch.randint(100, vocab, (prompt_len,), generator=gen).tolist(),
                           params)
    while engine.scheduler.num_waiting or any(  # until every prompt is prefilled
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler._running
    ):
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    _sync(engine.device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine.device)
    elapsed = (time.perf_counter() - t) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def bench_decode_sync(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    """``bench_decode`` with pipelined decode steps switched off: each step waits for its tokens."""
    engine.async_scheduling, was = False, engine.async_scheduling
    try:
        return bench_decode(engine, batch, prompt_len, steps)
    finally:
        engine.async_scheduling = was


def bench_decode_eager(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    """``bench_decode`` with the engine's decode graphs switched off for the run, timed on its second run: the
    first compiles the Triton kernels' variants for the unpadded eager shapes (once per process, seconds at bs 32),
    which three warm-up steps do not all reach and which would otherwise be charged to the steady eager step."""
    graphs, engine.runner.decode_graphs = engine.runner.decode_graphs, None
    try:
        bench_decode(engine, batch, prompt_len, steps)
        return bench_decode(engine, batch, prompt_len, steps)
    finally:
        engine.runner.decode_graphs = graphs


def bench_kv_shared_skip(engine: LLMEngine, prompt_lens: list[int], rounds: int) -> list[dict]:
    """Prefill of one prompt with the KV-shared-layer skip on and off, same engine and weights.

    Layers past the last KV-writing layer then run only the tokens whose output is read (the last
    one here); without the skip they run every prompt token (see ``TailBatch``).
    """
    rows = []
    for n in prompt_lens:
        seconds = {}
        for skip in (True, False):
            engine.runner.kv_shared_prefill_skip = skip
            bench_prefill(engine, 1, n, 1)  # warm-up at this length
            seconds[skip] = bench_prefill(engine, 1, n, rounds)
        engine.runner.kv_shared_prefill_skip = True
        rows.append(dict(case="kv_shared_skip", prompt_len=n, prefill_skip_ms=seconds[True] * 1e3,
                         prefill_noskip_ms=seconds[False] * 1e3, speedup=seconds[False] / seconds[True]))
    return rows


def hf_rows(args, mc, dev: torch.device, dtype: torch.dtype) -> dict[tuple, float]:
    """HF transformers' seconds per case on the same weights, device and dtype, before the engine exists
    (both would not fit beside each other's KV at 8B)."""
    from bench.hf_reference import hf_decode_step_s, hf_model, hf_prefill_s

    model = hf_model(mc, dev, dtype, seed=0)
    seconds = {("prefill", n): hf_prefill_s(model, n, args.rounds) for n in args.prefill_lens}
    for batch in args.batch_sizes:
        for context in args.decode_contexts:
            seconds[("decode", batch, context)] = hf_decode_step_s(model, batch, context, args.decode_steps)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def _csv(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", type=_csv, default=[1, 32], help="decode batch sizes")
    ap.add_argument("--decode-contexts", type=_csv, default=None,
                    help="context lengths of the decode cases (default: --prompt-len)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prefill-lens", type=_csv, default=None,
                    help="one-prompt prefill lengths (default: --prompt-len at each batch size, as before)")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-layout", default="cross_layer", choices=[k.value for k in LayoutKind])
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--attention-backend", default=None, help="the engine's --attention-backend (default: auto)")
    ap.add_argument("--enforce-eager", action="store_true", help="no decode CUDA graphs (eager column only)")
    ap.add_argument("--quantization", default="auto", help="the engine's --quantization (auto, none, fp8, mxfp4)")
    ap.add_argument("--hf", action="store_true",
                    help="also time HF transformers on the same dummy weights (Llama presets) and print ratios")
    ap.add_argument("--skip-prompt-lens", default=None,
                    help="e.g. 2048,8192: also time prefill with and without the KV-shared-layer skip")
    ap.add_argument("--json", action="store_true", help="one JSON object per case per line")
    ap.add_argument("--json-out", default=None, help="also write the JSON lines to this file")
    args = ap.parse_args()
    if args.hf and not (args.model or "").startswith("dummy:"):
        raise SystemExit("--hf needs a dummy:<preset> model (the reference is built from the same preset)")
    args.decode_contexts = args.decode_contexts or [args.prompt_len]

    extra = {} if args.attention_backend is None else {"attention_backend": args.attention_backend}
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, kv_layout=LayoutKind(args.kv_layout),
        max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False, enforce_eager=args.enforce_eager, quantization=args.quantization, **extra,
    )
    hf_seconds = {}
    if args.hf:
        from services.engine.model_config.hf import preset

        dev = config.resolve_device()
        hf_seconds = hf_rows(args, preset(args.model.removeprefix("dummy:")), dev,
                             TORCH_DTYPES["bfloat16" if args.dtype == "auto" and dev.type == "cuda" else
                                          ("float32" if args.dtype == "auto" else args.dtype)])
    engine = LLMEngine(config)
    graphs = engine.runner.decode_graphs
    mc, dev = engine.model_config, engine.device
    dtype = TORCH_DTYPES[engine.dtype]
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    bandwidth, flops, peak_src = machine_peaks(dev, dtype)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    common = dict(device=device_name, model=engine.source.name, dtype=engine.dtype, kv_layout=args.kv_layout,
                  attention_backend=getattr(engine.config, "attention_backend", "torch_sdpa"),
                  peak_source=peak_src, peak_bandwidth_gbs=bandwidth / 1e9, peak_tflops=flops / 1e12)

    bench_prefill(engine, 1, min(args.prompt_len, 512), 1)  # warm-up
    rows = []
    prefill_cases = [(1, n) for n in args.prefill_lens] if args.prefill_lens else \
        [(b, args.prompt_len) for b in args.batch_sizes]
    for batch, n in prefill_cases:
        bench_prefill(engine, batch, n, 1)  # warm-up at this shape
        prefill_s = bench_prefill(engine, batch, n, args.rounds)
        floor_s = batch * prefill_flops(mc, n) / flops
        hf_s = hf_seconds.get(("prefill", n)) if batch == 1 else None
        rows.append(dict(common, case="prefill", batch=batch, prompt_len=n, prefill_s=prefill_s,
                         prefill_tok_s=batch * n / prefill_s, prefill_floor_s=floor_s, prefill_mfu=floor_s / prefill_s,
                         hf_s=hf_s, hf_mfu=floor_s / hf_s if hf_s else None,
                         vs_hf=prefill_s / hf_s if hf_s else None))
    for batch in args.batch_sizes:
        for context in args.decode_contexts:
            step_s = bench_decode(engine, batch, context, args.decode_steps)
            eager_s = bench_decode_eager(engine, batch, context, args.decode_steps) if graphs else step_s
            sync_s = bench_decode_sync(engine, batch, context, args.decode_steps) if graphs else step_s
            floor_s = decode_floor_bytes(engine, weight_bytes, batch, context, dtype.itemsize) / bandwidth
            hf_s = hf_seconds.get(("decode", batch, context))
            rows.append(dict(common, case="decode", batch=batch, context=context, decode_step_ms=step_s * 1e3,
                             decode_tok_s=batch / step_s, decode_step_eager_ms=eager_s * 1e3,
                             decode_step_sync_ms=sync_s * 1e3, sync_floor=sync_s / floor_s,
                             decode_floor_ms=floor_s * 1e3, decode_vs_floor=step_s / floor_s,
                             decode_graphs=graphs is not None, graph_speedup=eager_s / step_s,
                             hf_step_ms=hf_s * 1e3 if hf_s else None, vs_hf=step_s / hf_s if hf_s else None))
    skip_rows = []
    if args.skip_prompt_lens:
        if not engine.model.skips_to_tail:
            raise SystemExit(f"{engine.source.name} has no KV-shared layers: nothing to skip")
        skip_rows = bench_kv_shared_skip(engine, [int(n) for n in args.skip_prompt_lens.split(",")], args.rounds)
    if emit_json(rows + skip_rows, args.json_out, args.json):
        return
    print_tables(engine, graphs, weight_bytes, common, rows, skip_rows)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(engine: LLMEngine, graphs, weight_bytes: int, common: dict, rows: list[dict],
                 skip_rows: list[dict]) -> None:
    print(f"# {common['device']}  model={engine.source.name}  dtype={engine.dtype}  attention="
          f"{common['attention_backend']}  weights={weight_bytes / 1e9:.2f} GB  peaks ({common['peak_source']}): "
          f"{common['peak_bandwidth_gbs']:.0f} GB/s, {common['peak_tflops']:.1f} TFLOP/s")
    if graphs is not None:
        print(f"# decode CUDA graphs: {len(graphs.captured)} captured in {graphs.capture_s:.2f} s "
              f"(batch, context): {graphs.captured}")
    print("# prefill floor: matmul on active parameters + causal attention FLOPs / peak; decode floor: (weights a step "
          "reads, routed experts it picks only + KV + state) / bandwidth")
    print(f"{'batch':>5} {'prompt':>7} {'prefill ms':>11} {'tok/s':>9} {'MFU':>6} {'HF ms':>9} {'HF MFU':>7} "
          f"{'x HF':>6}")
    for r in (r for r in rows if r["case"] == "prefill"):
        print(f"{r['batch']:>5} {r['prompt_len']:>7} {r['prefill_s'] * 1e3:>11.2f} {r['prefill_tok_s']:>9.0f} "
              f"{r['prefill_mfu']:>6.2f} {_fmt(r['hf_s'] and r['hf_s'] * 1e3, '9.2f'):>9} "
              f"{_fmt(r['hf_mfu'], '7.2f'):>7} {_fmt(r['vs_hf'], '6.2f'):>6}")
    step = "graph ms" if graphs is not None else "step ms"
    print(f"{'batch':>5} {'context':>7} {step:>9} {'sync ms':>9} {'eager ms':>9} {'floor ms':>9} {'x floor':>8} "
          f"{'tok/s':>9} {'HF ms':>8} {'x HF':>6}")
    for r in (r for r in rows if r["case"] == "decode"):
        print(f"{r['batch']:>5} {r['context']:>7} {r['decode_step_ms']:>9.2f} {r['decode_step_sync_ms']:>9.2f} "
              f"{r['decode_step_eager_ms']:>9.2f} "
              f"{r['decode_floor_ms']:>9.3f} {r['decode_vs_floor']:>8.2f} {r['decode_tok_s']:>9.1f} "
              f"{_fmt(r['hf_step_ms'], '8.2f'):>8} {_fmt(r['vs_hf'], '6.2f'):>6}")
    if skip_rows:
        print(f"{'prompt':>7} {'prefill ms, skip':>17} {'no skip':>9} {'speed-up':>9}")
        for r in skip_rows:
            print(f"{r['prompt_len']:>7} {r['prefill_skip_ms']:>17.2f} {r['prefill_noskip_ms']:>9.2f} "
                  f"{r['speedup']:>9.2f}")


if __name__ == "__main__":
    main()
