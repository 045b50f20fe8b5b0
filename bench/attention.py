"""One layer's attention per backend: decode and prefill on the Llama-3.1-8B shape, beside their floors.

    python bench/attention.py                         # CUDA, bf16: the table below
    python bench/attention.py --json-out att.jsonl    # + one JSON object per row
    python bench/attention.py --sweep                 # + triton_paged tile/split sweep per case
    python bench/attention.py --device cpu --quick    # CI smoke: tiny shapes, Triton interpreted
    python bench/attention.py --backends triton_paged,triton_dense,cudnn_sdpa --batches "" --contexts "" \
        --prefills 512,1024,2048,8192 --chunks 2048@6144     # prefill attention against cuDNN

Shape: 32 query heads, 8 KV heads, head dim 128, bf16, 16-token blocks, the K/V views of one layer
of a cross-layer cache (``--layout``/``--order`` for others), block tables scattered over the pool.
Cases: decode at batch 1/8/32 x context 512/2k/8k (one new token per request, the context already
cached), prefill of 512/2k/8k tokens (no prefix); ``--chunks Q@P``: a Q-token chunk after P tokens of
context already cached (a chunked prefill's later chunk, or a prefix-cache hit).

Backends: ``torch_sdpa``; ``triton_paged`` with its dense path off (every key through the paged
kernel); ``triton_dense``, the same backend with the dense path on for every chunk (the fresh tokens
through ``dense_causal``: cuDNN, the context before the chunk through the paged kernel, merged);
``cudnn_sdpa``, torch's SDPA on its cuDNN backend over the chunk's own contiguous q/k/v (prefill
without a prefix only: the reference the issue sets).

Per case and backend: ``us`` is one layer's ``forward`` (the K/V write is the same scatter for
every backend and is left out), timed on CUDA from a CUDA graph of ``--reps`` calls (what the
decode graphs run: no launch overhead), median of ``--iters`` replays; ``eager_us`` is the same
calls launched eagerly (CPU launch costs included); ``meta_us`` is the backend's per-step
metadata (once per KV group per step, shared by the layers: the mask for torch_sdpa, nothing for
triton_paged). Decode floor: the context's K/V bytes over ``--peak-bw`` (default from the device
name: H100 SXM 3.35e12, H200 4.8e12 B/s); prefill: achieved TFLOP/s (causal: 4 * heads * head_dim *
T(T+1)/2). ``rel_diff``: max |triton - sdpa| / max |sdpa| on that case.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import int_list  # noqa: E402


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" or "prefill"
    batch: int
    context: int  # tokens in context after the step (decode: cached + 1)
    query: int  # new tokens per request

    @property
    def label(self) -> str:
        if self.kind == "decode":
            return f"decode bs={self.batch} ctx={self.context}"
        prefix = self.context - self.query
        return f"prefill {self.query} tok" + (f" @{prefix}" if prefix else "")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu (Triton interpreted)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, fp32, one timed call (CI smoke)")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default), float16, float32; --quick: float32")
    ap.add_argument("--backends", default="torch_sdpa,triton_paged")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,32; --quick: 1,2)")
    ap.add_argument("--contexts", default=None, help="decode contexts (default 512,2048,8192; --quick: 40,100)")
    ap.add_argument("--prefills", default=None, help="prefill lengths (default 512,2048,8192; --quick: 24,48)")
    ap.add_argument("--chunks", default="", help="Q@P,...: a Q-token chunk after P cached tokens")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2, help="layers in the cross-layer buffer (the view is layer 1)")
    ap.add_argument("--layout", default="cross_layer", choices=["cross_layer", "per_layer"])
    ap.add_argument("--order", default="NHD", choices=["NHD", "HND"])
    ap.add_argument("--peak-bw", type=float, default=None, help="HBM bytes/s for the decode floor")
    ap.add_argument("--peak-flops", type=float, default=None, help="dense FLOP/s, to print prefill MFU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10, help="timed graph replays (or eager loops), median")
    ap.add_argument("--reps", type=int, default=10, help="forward calls per replay / eager loop")
    ap.add_argument("--splits", type=int, default=None, help="force triton_paged's split count")
    ap.add_argument("--sweep", action="store_true", help="also time triton_paged tile shapes and split counts")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row to stdout")
    ap.add_argument("--json-out", default=None, help="write the JSON rows to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.heads, args.kv_heads, args.head_dim, args.layers = 4, 2, 32, 2
        args.warmup, args.iters, args.reps = 0, 1, 1
    sizes = ("1,2", "40,100", "24,48", "float32") if args.quick else ("1,8,32", "512,2048,8192", "512,2048,8192",
                                                                       "bfloat16")
    args.batches, args.contexts, args.prefills, args.dtype = (  # "" given: none of those cases
        default if given is None else given
        for given, default in zip((args.batches, args.contexts, args.prefills, args.dtype), sizes, strict=True))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import services  # noqa: F401,I001  (oneDNN ISA cap before torch)
    import torch

    from bench._common import emit_json

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        # Triton runs on CPU tensors only interpreted, which is chosen when triton is first imported
        # (nothing has imported it yet: the backend imports its kernels on first use).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    bench = Bench(args, device, dtype)
    rows = bench.run()
    print(bench.table(rows))
    emit_json(rows, args.json_out, args.json)


class Bench:
    def __init__(self, args: argparse.Namespace, device, dtype) -> None:
        import torch

        from services.engine.kv_cache.buffers import DTYPE_NAMES, KVCache
        from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec
        from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind

        self.torch = torch
        self.args, self.device, self.dtype = args, device, dtype
        self.cases = [Case("decode", b, c, 1) for b in int_list(args.batches) for c in int_list(args.contexts)]
        self.cases += [Case("prefill", 1, t, t) for t in int_list(args.prefills)]
        for chunk in filter(None, args.chunks.split(",")):
            q_len, prefix = (int(x) for x in chunk.split("@"))
            self.cases.append(Case("prefill", 1, prefix + q_len, q_len))
        max_tokens = max(c.batch * c.context for c in self.cases)
        bs = args.block_size
        num_blocks = -(-max_tokens // bs) + len(self.cases) + 1
        group = KVCacheGroupSpec(0, AttentionKind.FULL, tuple(range(args.layers)), bs)
        spec = KVLayoutSpec(LayoutKind(args.layout), BlockOrder(args.order), num_blocks, args.kv_heads,
                            args.head_dim, DTYPE_NAMES[dtype], (group,))
        self.cache = KVCache(spec, device)
        gen = torch.Generator(device=device).manual_seed(0)
        for buf in self.cache.buffers:
            buf.normal_(generator=gen)
        self.k_cache, self.v_cache = self.cache.views[min(1, args.layers - 1)]
        self.num_blocks = num_blocks
        from bench._common import GPU_PEAKS

        peaks = next((p for k, p in GPU_PEAKS.items() if device.type == "cuda" and k in torch.cuda.get_device_name(
            device)), (None, None))
        self.peak_bw = args.peak_bw or peaks[0]
        self.peak_flops = args.peak_flops or peaks[1]
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    # ---- problems ------------------------------------------------------------------------------
    def problem(self, case: Case):
        """(step batch without groups, block tables, q, fresh (k, v)) for one case; tables scattered over
        the pool. q/k/v are views of one projection output, as a layer has them, and the fresh k/v are
        also what the cache holds at the step's positions."""
        torch = self.torch
        from services.engine.attention import step_batch

        a, bs = self.args, self.args.block_size
        per_req = -(-case.context // bs)
        gen = torch.Generator().manual_seed(case.batch * 100003 + case.context)
        ids = torch.randperm(self.num_blocks - 1, generator=gen)[: case.batch * per_req]
        tables = ids.view(case.batch, per_req).to(self.device)
        step = step_batch([case.query] * case.batch, [case.context] * case.batch, self.device)
        tokens = case.batch * case.query
        qkv = torch.randn(tokens, (a.heads + 2 * a.kv_heads) * a.head_dim, device=self.device, dtype=self.dtype)
        q, k, v = qkv.split([a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim], dim=-1)
        q = q.view(tokens, a.heads, a.head_dim)
        k, v = k.view(tokens, a.kv_heads, a.head_dim), v.view(tokens, a.kv_heads, a.head_dim)
        positions = torch.arange(case.context - case.query, case.context, device=self.device).repeat(case.batch)
        rows = torch.arange(case.batch, device=self.device).repeat_interleave(case.query)
        blocks = tables[rows, positions // bs]
        self.k_cache[blocks, positions % bs] = k
        self.v_cache[blocks, positions % bs] = v
        return step, tables, q, (k, v)

    def backend(self, name: str, splits: int | None = None, config=None):
        from services.engine.attention import BACKENDS
        from services.engine.attention.triton_paged import TritonPagedBackend

        if name in (TritonPagedBackend.name, "triton_dense"):
            backend = TritonPagedBackend(num_splits=splits or self.args.splits, config=config,
                                         dense_min_query=1 if name == "triton_dense" else 0,
                                         dense_max_prefix_ratio=float("inf"))
            backend.label = name
            return backend
        if name == "cudnn_sdpa":
            return CudnnReference()
        return BACKENDS[name]()

    # ---- timing --------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _time_eager(self, fn) -> float:
        """Median seconds per call over ``iters`` loops of ``reps`` calls."""
        torch, a = self.torch, self.args
        for _ in range(a.warmup):
            fn()
        times = []
        for _ in range(max(1, a.iters)):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(a.reps):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / a.reps)
            else:
                t = time.perf_counter()
                for _ in range(a.reps):
                    fn()
                times.append((time.perf_counter() - t) / a.reps)
        return statistics.median(times)

    def _time_graph(self, fn) -> float | None:
        """Median seconds per call from CUDA-graph replays of ``reps`` calls; None off CUDA."""
        from bench._common import cuda_graph_ms

        if self.device.type != "cuda":
            return None
        a = self.args
        return cuda_graph_ms(fn, max(1, a.iters), captures=a.reps, warmup_replays=max(1, a.warmup),
                             device=self.device) / 1e3

    def measure(self, case: Case, backend, step, tables, q, fresh) -> tuple[dict, object]:
        torch = self.torch
        none = torch.empty(0, dtype=torch.long, device=self.device)
        scale = self.args.head_dim ** -0.5

        def build():
            return backend.build_metadata(step, tables, none, none, None)

        meta = build()
        batch = step.with_groups((meta,))

        def forward():
            return backend.forward(q, self.k_cache, self.v_cache, batch, meta, scale, None, fresh)

        with torch.inference_mode():
            out = forward()
            self._sync()
            try:
                graph_s = self._time_graph(forward)
            except RuntimeError as e:  # not capturable: report the eager time, say why
                print(f"{case.label} {backend.name}: no CUDA graph ({e}); timing eagerly", file=sys.stderr)
                graph_s = None
            eager_s = self._time_eager(forward)
            meta_s = self._time_eager(build)
        seconds = graph_s if graph_s is not None else eager_s
        row = self._row(case, getattr(backend, "label", backend.name), seconds)
        row.update(eager_us=round(eager_s * 1e6, 2), meta_us=round(meta_s * 1e6, 2),
                   graph=graph_s is not None)
        if backend.name == "triton_paged" and meta.dense is None:
            config, _, splits = backend.plan(batch, self.args.heads, self.args.kv_heads, self.args.head_dim,
                                             self.dtype, self.device)
            row.update(splits=splits, block_m=config.block_m, block_n=config.block_n, num_warps=config.num_warps,
                       num_stages=config.num_stages)
        return row, out

    def _row(self, case: Case, backend: str, seconds: float) -> dict:
        a = self.args
        row = dict(backend=backend, kind=case.kind, batch=case.batch, context=case.context, query=case.query,
                   heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=a.dtype, block_size=a.block_size,
                   layout=f"{a.layout}/{a.order}", device=self.device_name, us=round(seconds * 1e6, 2))
        element = self.torch.finfo(self.dtype).bits // 8
        if case.kind == "decode":
            kv_bytes = case.batch * case.context * a.kv_heads * a.head_dim * 2 * element
            row.update(kv_bytes=kv_bytes, gbps=round(kv_bytes / seconds / 1e9, 1))
            if self.peak_bw:
                floor = kv_bytes / self.peak_bw
                row.update(floor_us=round(floor * 1e6, 2), x_floor=round(seconds / floor, 2))
        else:
            t, prefix = case.query, case.context - case.query
            flops = 4 * a.heads * a.head_dim * (t * prefix + t * (t + 1) // 2)
            row.update(flops=flops, tflops=round(flops / seconds / 1e12, 2))
            if self.peak_flops:
                row.update(mfu=round(flops / seconds / self.peak_flops, 3))
        return row

    # ---- the run -------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        from services.engine.attention.triton_paged import KernelConfig

        rows: list[dict] = []
        names = [n.strip() for n in self.args.backends.split(",") if n.strip()]
        for case in self.cases:
            step, tables, q, fresh = self.problem(case)
            outs = {}
            for name in names:
                if name == "cudnn_sdpa" and (case.kind != "prefill" or case.context != case.query):
                    continue  # the reference runs on a prompt's own contiguous q/k/v only
                if name == "triton_dense" and case.kind != "prefill":
                    continue
                row, outs[name] = self.measure(case, self.backend(name), step, tables, q, fresh)
                rows.append(row)
            ref_name = next((n for n in ("torch_sdpa", "triton_paged") if n in outs), None)
            if ref_name is not None:
                ref = outs[ref_name].float()
                for row in rows[-len(outs):]:
                    row.update(_diff(outs[row["backend"]], ref), diff_against=ref_name)
            if self.args.sweep and "triton_paged" in names:
                configs = _sweep_configs(case, self.args.head_dim, KernelConfig)
                for splits, config in configs:
                    try:
                        row, out = self.measure(case, self.backend("triton_paged", splits, config), step, tables, q,
                                                fresh)
                    except Exception as e:  # a config the GPU cannot run (shared memory): say so, go on
                        print(f"sweep {case.label} splits={splits} {config}: {type(e).__name__}: {e}",
                              file=sys.stderr)
                        continue
                    row.update(sweep=True, **(_diff(out, ref) if ref_name is not None else {}))
                    rows.append(row)
            del step, tables, q, fresh, outs
        return rows

    def table(self, rows: list[dict]) -> str:
        head = (f"attention, one layer: {self.args.heads} q heads / {self.args.kv_heads} kv heads x "
                f"{self.args.head_dim}, {self.args.dtype}, block {self.args.block_size}, "
                f"{self.args.layout}/{self.args.order}, {self.device_name}"
                + (f", floor at {self.peak_bw / 1e12:.2f} TB/s" if self.peak_bw else ""))
        lines = [head, f"{'case':<26}{'backend':<14}{'us':>10}{'eager_us':>10}{'meta_us':>9}{'floor_us':>10}"
                       f"{'x_floor':>8}{'GB/s':>8}{'TFLOP/s':>9}{'splits':>7}{'rel_diff':>10}"]
        best: dict[str, dict] = {}
        for r in rows:
            case = Case(r["kind"], r["batch"], r["context"], r["query"]).label
            if r.get("sweep"):
                if case not in best or r["us"] < best[case]["us"]:
                    best[case] = r
                continue
            lines.append(f"{case:<26}{r['backend']:<14}{r['us']:>10.1f}{r['eager_us']:>10.1f}{r['meta_us']:>9.1f}"
                         f"{_f(r.get('floor_us'), 10, 1)}{_f(r.get('x_floor'), 8, 2)}{_f(r.get('gbps'), 8, 0)}"
                         f"{_f(r.get('tflops'), 9, 1)}{_f(r.get('splits'), 7, 0)}{_f(r.get('rel_diff'), 10, 1, 'e')}")
        if best:
            lines.append("triton_paged sweep, best per case:")
            for case, r in best.items():
                lines.append(f"  {case:<24}{r['us']:>10.1f} us  splits={r['splits']} block_m={r['block_m']} "
                             f"block_n={r['block_n']} warps={r['num_warps']} stages={r['num_stages']}"
                             f"  rel_diff={r.get('rel_diff', float('nan')):.1e}")
        return "\n".join(lines)


class CudnnReference:
    """torch SDPA on its cuDNN backend over the chunk's own q/k/v (grouped heads as they are)."""

    name = "cudnn_sdpa"

    def build_metadata(self, batch, block_tables, write_blocks, write_offsets, sliding_window):
        return None

    def forward(self, q, k_cache, v_cache, batch, meta, scale, softcap, fresh):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        k, v = fresh
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2),
                is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def _sweep_configs(case: Case, head_dim: int, kernel_config_cls) -> list[tuple[int | None, object]]:
    """(splits, KernelConfig) candidates for one case: split counts x key tiles for decode, tiles for prefill."""
    out: list[tuple[int | None, object]] = []
    block_ns = [n for n in (16, 32, 64, 128) if n * head_dim <= 128 * 128]
    if case.kind == "decode":
        for splits in (1, 2, 4, 8, 16, 32, 64):
            if splits * 64 > case.context:
                continue
            for block_n in block_ns:
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        out.append((splits, kernel_config_cls(16, block_n, warps, stages)))
    else:
        for block_m in (64, 128):
            for block_n in block_ns:
                for warps, stages in ((4, 2), (8, 2), (8, 3)):
                    out.append((1, kernel_config_cls(block_m, block_n, warps, stages)))
    return out


def _diff(out, ref) -> dict:
    diff = (out.float() - ref).abs().max().item()
    return dict(max_abs_diff=diff, rel_diff=diff / max(ref.abs().max().item(), 1e-30))




def _f(value, width: int, digits: int, kind: str = "f") -> str:
    if value is None:
        return " " * (width - 1) + "-"
    return f"{value:>{width}.{digits}{kind}}"


if __name__ == "__main__":
    main()
