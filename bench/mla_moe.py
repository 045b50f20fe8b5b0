"""DeepSeek's and Granite's CUDA paths against the alternatives, side by side in one run: how ``triton_mla``
and the grouped experts were chosen.

    python bench/mla_moe.py                          # CUDA: DeepSeek-V2-Lite and Granite-4.0-H-Tiny shapes, bf16
    python bench/mla_moe.py --quick --device cpu     # smoke: tiny shapes, a few iterations (not a measurement)

Rows:

* ``moe``: one MoE layer's routed experts (the router's choice given: uniform random top-k per token) by
  token count, ``loop`` (one expert at a time, the CPU path) against ``grouped`` (two ``torch._grouped_mm``
  calls), eager, and ``grouped`` replayed from a CUDA graph; beside the floor of reading the distinct
  chosen experts' weights once at the HBM peak.
* ``mla_decode``: absorbed attention over a paged cache of latent rows (16 heads, latent 512 + rope 64,
  DeepSeek-V2-Lite's), batch x context, ``torch_mla`` (gather + masked SDPA) against ``triton_mla`` (the
  kernel at its default tile), each eager and replayed from a CUDA graph (as decode steps run), a tile
  sweep of the kernel (graph replays), beside the floor of reading every row once at the HBM peak.
* ``mla_prefill``: the expanded form of one fresh prompt (no prefix) and of a chunk after a prefix,
  ``torch_mla`` against ``triton_mla`` (per-request SDPA with a lower-right causal mask), with its values
  as they are (SDPA's memory-efficient kernel) and zero-padded to the key width (its flash kernel).

Times are medians of ``--iters`` runs of ``--reps`` calls (CUDA events). The last lines are the table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import GPU_PEAKS, cuda_graph_ms, emit_json  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and iterations: a smoke run")
    ap.add_argument("--moe-models", default="deepseek-v2-lite,granite-4.0-h-tiny-shape")
    ap.add_argument("--moe-tokens", default="1,8,32,128,512,2048")
    ap.add_argument("--decode", default="1x2048,1x8192,32x2048,32x8192", help="batch x context pairs")
    ap.add_argument("--prefill", default="2048@0,8192@0,2048@6144", help="chunk@prefix pairs")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json-out", default=None)
    return ap.parse_args(argv)


class Timer:
    def __init__(self, device, iters: int, reps: int) -> None:
        import torch

        self.torch, self.device, self.iters, self.reps = torch, device, iters, reps

    def __call__(self, fn: Callable[[], object]) -> float:
        """Median ms per call."""
        torch = self.torch
        fn()
        fn()
        times = []
        for _ in range(self.iters):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.reps):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / self.reps)
            else:
                t0 = time.perf_counter()
                for _ in range(self.reps):
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / self.reps)
        return statistics.median(times)

    def graph(self, fn: Callable[[], object]) -> float | None:
        """Median ms per replay of ``fn`` captured in a CUDA graph (None off CUDA), timed as ``__call__`` times."""
        if self.device.type != "cuda":
            return None
        return cuda_graph_ms(fn, self.iters, replays=self.reps, warmup_replays=2, device=self.device)


def moe_rows(args, device, dtype, timer: Timer, peak_bw: float | None) -> list[dict]:
    import torch

    from services.engine.model_config.hf import preset
    from services.engine.models.moe import RoutedExperts

    rows = []
    for model in filter(None, args.moe_models.split(",")):
        config = preset(model)
        if config.moe is not None:
            moe = config.moe
            num, k, inter = moe.n_routed_experts, moe.num_experts_per_tok, moe.moe_intermediate_size
        else:
            spec = config.granite.experts
            num, k, inter = spec.num_local_experts, spec.num_experts_per_tok, spec.intermediate_size
        hidden = config.hidden_size
        if args.quick:
            num, hidden, inter = min(num, 8), 64, 32
            k = min(k, 2)
        experts = RoutedExperts(num, hidden, inter, dtype, device, path="loop")
        with torch.no_grad():
            experts.gate_up.normal_(std=0.02)
            experts.down.normal_(std=0.02)
        per_expert = 3 * hidden * inter * experts.gate_up.element_size()
        for tokens in (int(t) for t in args.moe_tokens.split(",")):
            gen = torch.Generator().manual_seed(tokens)
            chosen = torch.stack([torch.randperm(num, generator=gen)[:k] for _ in range(tokens)]).to(device)
            weights = torch.rand(tokens, k, generator=gen).to(device)
            x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
            row = {"kind": "moe", "model": model, "tokens": tokens, "experts": num, "k": k, "hidden": hidden,
                   "intermediate": inter, "distinct_experts": int(chosen.unique().numel())}
            call = functools.partial(experts, x, weights, chosen)
            with torch.inference_mode():
                experts.path = "loop"
                row["loop_ms"] = timer(call)
                experts.path = "grouped"
                try:
                    row["grouped_ms"] = timer(call)
                    row["grouped_graph_ms"] = timer.graph(call)
                except RuntimeError as e:  # a device or dtype torch._grouped_mm lacks
                    row["grouped_error"] = str(e).splitlines()[0]
            if peak_bw:
                row["floor_ms"] = row["distinct_experts"] * per_expert / peak_bw * 1e3
            rows.append(row)
            print(f"# {row}", file=sys.stderr, flush=True)
    return rows


class LatentCache:
    """A paged cache of latent rows (one MLA group, one layer) filled with random rows, and DeepSeek-V2-Lite's
    attention shapes."""

    def __init__(self, device, dtype, tokens: int, quick: bool) -> None:
        import torch

        from services.engine.kv_cache.buffers import DTYPE_NAMES, KVCache
        from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
        from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind

        self.heads, self.latent, self.rope, self.nope, self.v_dim = (4, 64, 16, 32, 32) if quick else \
            (16, 512, 64, 128, 128)
        self.block_size = 16
        width = self.latent + self.rope
        self.num_blocks = -(-tokens // self.block_size) + 8
        group = KVCacheGroupSpec(0, AttentionKind.MLA, (0,), self.block_size, None, 1, width)
        spec = KVLayoutSpec(LayoutKind.CROSS_LAYER, BlockOrder.NHD, self.num_blocks, 1, width, DTYPE_NAMES[dtype],
                            (group,))
        self.cache = KVCache(spec, device)
        for buf in self.cache.buffers:
            buf.normal_()
        (self.rows,) = self.cache.views[0]
        self.device, self.dtype = device, dtype
        gen = torch.Generator().manual_seed(0)
        kv_b = torch.randn(self.heads * (self.nope + self.v_dim), self.latent, generator=gen) / self.latent ** 0.5
        self.kv_b = kv_b.to(dtype).to(device)

    def expand(self, rows):
        import torch

        latent, k_rope = rows.split([self.latent, self.rope], dim=-1)
        kv = torch.nn.functional.linear(latent, self.kv_b).view(*latent.shape[:-1], self.heads,
                                                                 self.nope + self.v_dim)
        k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope)
        return torch.cat((k_nope, k_rope), dim=-1), values

    def step(self, batch: int, context: int, query: int):
        import torch

        from services.engine.attention import step_batch

        per_req = -(-context // self.block_size)
        ids = torch.randperm(self.num_blocks - 1)[: batch * per_req]
        tables = ids.view(batch, per_req).to(self.device)
        return step_batch([query] * batch, [context] * batch, self.device), tables


def mla_decode_rows(args, device, dtype, timer: Timer, peak_bw: float | None) -> list[dict]:
    import torch

    from services.engine.attention.mla import TorchMLABackend
    from services.engine.attention.triton_mla import TritonMLABackend, mla_kernel_config
    from services.engine.attention.triton_paged import KernelConfig

    pairs = [tuple(int(x) for x in p.split("x")) for p in args.decode.split(",") if p]
    if args.quick:
        pairs = [(2, 64)]
    cache = LatentCache(device, dtype, max(b * c for b, c in pairs), args.quick)
    width = cache.latent + cache.rope
    none = torch.empty(0, dtype=torch.long, device=device)
    rows = []
    for batch, context in pairs:
        step, tables = cache.step(batch, context, 1)
        q = torch.randn(batch, cache.heads, width, device=device, dtype=dtype)
        row = {"kind": "mla_decode", "batch": batch, "context": context, "heads": cache.heads, "latent": cache.latent}

        def run(backend, step=step, tables=tables, q=q):
            meta = backend.build_metadata(step, tables, none, none, None)
            return functools.partial(backend.forward_absorbed, q, cache.rows, cache.latent, step.with_groups((meta,)),
                                     meta, width ** -0.5)

        with torch.inference_mode():
            row["torch_mla_ms"] = timer(run(TorchMLABackend()))
            default = mla_kernel_config(cache.heads, 1, cache.latent, dtype)
            row["default_tile"] = [default.block_m, default.block_n, default.num_warps]
            row["triton_mla_ms"] = timer(run(TritonMLABackend()))
            # Replayed from a CUDA graph, as a decode step runs: the kernels without the host's launch cost.
            for name, backend in (("torch_mla", TorchMLABackend()), ("triton_mla", TritonMLABackend())):
                try:
                    row[f"{name}_graph_ms"] = timer.graph(run(backend))
                except RuntimeError as e:
                    row[f"{name}_graph_error"] = str(e).splitlines()[0][:120]
            sweep = {}
            if not args.quick:
                for block_m in (16, 32):
                    for block_n in (16, 32, 64):
                        for warps in (4, 8):
                            config = KernelConfig(block_m, block_n, num_warps=warps, num_stages=2)
                            try:
                                sweep[f"{block_m}x{block_n}w{warps}"] = timer.graph(
                                    run(TritonMLABackend(config=config)))
                            except Exception as e:  # noqa: BLE001 - a tile that does not compile (resources)
                                sweep[f"{block_m}x{block_n}w{warps}"] = f"error: {str(e).splitlines()[0][:80]}"
            row["tile_sweep_ms"] = sweep
            timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
            if timed:
                row["best_tile"], row["best_tile_ms"] = min(timed.items(), key=lambda kv: kv[1])
        if peak_bw:
            row["floor_ms"] = batch * context * width * cache.rows.element_size() / peak_bw * 1e3
        rows.append(row)
        print(f"# {row}", file=sys.stderr, flush=True)
    return rows


def mla_prefill_rows(args, device, dtype, timer: Timer) -> list[dict]:
    import torch

    from services.engine.attention.mla import TorchMLABackend
    from services.engine.attention.triton_mla import TritonMLABackend

    cases = [tuple(int(x) for x in p.split("@")) for p in args.prefill.split(",") if p]
    if args.quick:
        cases = [(32, 0), (16, 32)]
    cache = LatentCache(device, dtype, max(q + p for q, p in cases), args.quick)
    none = torch.empty(0, dtype=torch.long, device=device)
    rows = []
    for chunk, prefix in cases:
        step, tables = cache.step(1, chunk + prefix, chunk)
        q = torch.randn(chunk, cache.heads, cache.nope + cache.rope, device=device, dtype=dtype)
        row = {"kind": "mla_prefill", "chunk": chunk, "prefix": prefix, "heads": cache.heads}

        def run(backend, step=step, tables=tables, q=q):
            meta = backend.build_metadata(step, tables, none, none, None)
            return functools.partial(backend.forward_expanded, q, cache.rows, step.with_groups((meta,)), meta,
                                     (cache.nope + cache.rope) ** -0.5, cache.expand)

        with torch.inference_mode():
            row["torch_mla_ms"] = timer(run(TorchMLABackend()))
            row["triton_mla_ms"] = timer(run(TritonMLABackend(pad_values=False)))
            row["triton_mla_padded_ms"] = timer(run(TritonMLABackend(pad_values=True)))
        rows.append(row)
        print(f"# {row}", file=sys.stderr, flush=True)
    return rows


def _f(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def print_table(rows: list[dict]) -> None:
    print("\nmoe (routed experts of one layer; ms)")
    print("model | tokens | distinct experts | loop | grouped | grouped graph | loop/grouped | grouped/floor")
    for r in (r for r in rows if r["kind"] == "moe"):
        grouped = r.get("grouped_ms")
        print(" | ".join([r["model"], str(r["tokens"]), str(r["distinct_experts"]), _f(r["loop_ms"]), _f(grouped),
                          _f(r.get("grouped_graph_ms")),
                          _f(r["loop_ms"] / grouped, 2) if grouped else "-",
                          _f(grouped / r["floor_ms"], 2) if grouped and r.get("floor_ms") else "-"]))
    print("\nmla_decode (absorbed, one layer; ms)")
    print("batch x context | torch_mla eager / graph | triton_mla eager / graph | best tile (graph) | "
          "torch/triton (graph) | triton graph/floor")
    for r in (r for r in rows if r["kind"] == "mla_decode"):
        tg, kg = r.get("torch_mla_graph_ms"), r.get("triton_mla_graph_ms")
        print(" | ".join([f"{r['batch']}x{r['context']}", f"{_f(r['torch_mla_ms'])} / {_f(tg)}",
                          f"{_f(r['triton_mla_ms'])} / {_f(kg)}",
                          f"{r.get('best_tile', '-')} {_f(r.get('best_tile_ms'))}",
                          _f(tg / kg, 2) if tg and kg else "-",
                          _f(kg / r["floor_ms"], 2) if kg and r.get("floor_ms") else "-"]))
    print("\nmla_prefill (expanded, one layer; ms)")
    print("chunk @ prefix | torch_mla | triton_mla | triton_mla, values padded | torch/triton | torch/padded")
    for r in (r for r in rows if r["kind"] == "mla_prefill"):
        print(" | ".join([f"{r['chunk']}@{r['prefix']}", _f(r["torch_mla_ms"]), _f(r["triton_mla_ms"]),
                          _f(r["triton_mla_padded_ms"]), _f(r["torch_mla_ms"] / r["triton_mla_ms"], 2),
                          _f(r["torch_mla_ms"] / r["triton_mla_padded_ms"], 2)]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu (with --quick for a smoke run)", file=sys.stderr)
        return 2
    if args.quick:
        args.iters, args.reps = 2, 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_bw = next((p[0] for k, p in GPU_PEAKS.items() if k in name), None)
    print(f"# {name}, {dtype}, torch {torch.__version__}", flush=True)
    timer = Timer(device, args.iters, args.reps)
    rows = moe_rows(args, device, dtype, timer, peak_bw)
    rows += mla_decode_rows(args, device, dtype, timer, peak_bw)
    rows += mla_prefill_rows(args, device, dtype, timer)
    emit_json(rows, args.json_out, False)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
