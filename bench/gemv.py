"""Batch-1 decode projections (one row of activations against a whole weight): cuBLAS against a Triton GEMV.

At batch 1 a decode step's projections read each weight once and do almost no arithmetic, so their
time is the weight's bytes over the memory's rate. This bench times ``torch.nn.functional.linear``
(cuBLAS) and the Triton kernel of ``services.engine.ops.gemv_triton`` side by side on the projections of a
model at batch 1, each inside a CUDA graph that runs ``--copies`` distinct weights one after another (so
no weight is still in L2 when it is read again), with and without programmatic dependent launch, and
prints the fraction of the HBM peak each reaches. The down projection is timed with its input's
``silu(gate) * up`` (a kernel of its own before cuBLAS, the GEMV's prologue in Triton). ``--sweep``
times every tile in the kernel's search space and prints the best per shape.

    python3 bench/gemv.py --sweep
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from bench._common import GPU_PEAKS, emit_json

# (name, out_features, in_features) of Llama-3.1-8B's fused projections and its LM head.
LLAMA_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
            ("lm_head", 128256, 4096)]


def graph_time_us(fn, copies: int, replays: int = 20) -> float:
    """Median microseconds per call of ``fn(i)`` for i in range(copies), captured once as a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up: compile and autotune outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return sorted(times)[len(times) // 2]


def measure(proj: str, n: int, k: int, dtype: torch.dtype, copies: int, sweep: bool, peak_bw: float | None) -> dict:
    """One projection's row: cuBLAS, the GEMV without and with PDL, and (``sweep``) the GEMV's best tile."""
    from services.engine import ops
    from services.engine.ops import gemv_triton

    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    gated = proj == "down"
    x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=dtype)
    out = torch.empty(1, n, device="cuda", dtype=dtype)

    def cublas(i: int) -> torch.Tensor:
        return torch.nn.functional.linear(ops.silu_and_mul(x) if gated else x, weights[i])

    def triton_gemv(i: int, pdl: bool, tile: gemv_triton.Tile | None = None) -> torch.Tensor:
        return gemv_triton.gemv(x, weights[i], out=out, gated="silu" if gated else None, pdl=pdl, tile=tile)

    err = (triton_gemv(0, True).float() - cublas(0).float()).abs().max().item()
    row = {"proj": proj + (" (silu-and-mul first)" if gated else ""), "n": n, "k": k, "max_abs_err": err,
           "cublas_us": graph_time_us(cublas, copies),
           "triton_us": graph_time_us(lambda i: triton_gemv(i, False), copies),
           "pdl_us": graph_time_us(lambda i: triton_gemv(i, True), copies)}
    if sweep:
        best = None
        for tile in gemv_triton.search_space():
            try:
                us = graph_time_us(lambda i, t=tile: triton_gemv(i, True, t), copies, replays=7)
            except triton.runtime.errors.OutOfResources:
                continue  # a tile whose pipeline does not fit in shared memory
            if best is None or us < best[1]:
                best = (tile, us)
        row["best_tile"], row["best_us"] = list(best[0]), best[1]
    for key in ("cublas", "triton", "pdl", "best"):
        if f"{key}_us" in row and peak_bw:
            row[f"{key}_of_peak"] = n * k * x.element_size() / row[f"{key}_us"] * 1e6 / peak_bw
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8, help="distinct weights per shape, read in turn")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="time every tile of the search space")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    peak_bw = next((bw for key, (bw, _) in GPU_PEAKS.items() if key in name), None)
    rows_out = [measure(proj, n, k, dtype, args.copies, args.sweep, peak_bw) for proj, n, k in LLAMA_8B]
    emit_json(rows_out, args.json_out, to_stdout=False)
    print(f"{name}: one row against a weight, {args.copies} distinct weights per shape in one CUDA graph (us, "
          "fraction of the HBM peak)")
    print("| proj (N x K) | cuBLAS | Triton | Triton + PDL | cuBLAS / Triton + PDL |"
          + (" best tile (PDL) | its us |" if args.sweep else ""))
    for r in rows_out:
        line = (f"| {r['proj']} ({r['n']}x{r['k']}) | {r['cublas_us']:.1f} ({r.get('cublas_of_peak', 0):.2f})"
                f" | {r['triton_us']:.1f} ({r.get('triton_of_peak', 0):.2f}) | {r['pdl_us']:.1f}"
                f" ({r.get('pdl_of_peak', 0):.2f}) | {r['cublas_us'] / r['pdl_us']:.2f} |")
        if args.sweep:
            line += f" {r['best_tile']} | {r['best_us']:.1f} ({r.get('best_of_peak', 0):.2f}) |"
        print(line)
    print(json.dumps({"max_abs_err": max(r["max_abs_err"] for r in rows_out)}))


if __name__ == "__main__":
    main()
