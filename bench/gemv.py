"""Small-batch decode projections (a few rows of activations against a whole weight): cuBLAS against a Triton GEMV.

At a small batch a decode step's projections read each weight once and do little arithmetic, so their
time is the weight's bytes over the memory's rate. This bench times ``torch.nn.functional.linear``
(cuBLAS) and the Triton kernels of ``services.engine.ops.gemv_triton`` side by side on the projections of a
model at ``--rows`` rows (one row: the CUDA-core GEMV; several: the tensor-core one), each inside a
CUDA graph that runs ``--copies`` distinct weights one after another (so no weight is still in L2 when
it is read again), with and without programmatic dependent launch, and
prints the fraction of the HBM peak each reaches. The down projection is timed with its input's
``silu(gate) * up`` at one row (a kernel of its own before cuBLAS, the GEMV's prologue in Triton), the
gate/up projection with it at several rows (a kernel after cuBLAS, the kernel's epilogue). ``--sweep``
(or ``--sweep-rows``, for some row counts) times every tile in the kernel's search space and prints the best
per shape.

    python3 bench/gemv.py --sweep
    python3 bench/gemv.py --rows 1,8,16 --sweep-rows 8,16
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from bench._common import GPU_PEAKS, cuda_graph_ms, emit_json, int_list

# (name, out_features, in_features) of Llama-3.1-8B's fused projections and its LM head.
LLAMA_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
            ("lm_head", 128256, 4096)]


def graph_time_us(fn, copies: int, replays: int = 20) -> float:
    """Median microseconds per call of ``fn(i)`` for i in range(copies), captured once as a graph."""
    def every_copy() -> None:
        for i in range(copies):
            fn(i)

    return cuda_graph_ms(every_copy, replays, median=statistics.median_high) * 1e3 / copies


def measure(proj: str, n: int, k: int, rows: int, dtype: torch.dtype, copies: int, sweep: bool,
            peak_bw: float | None) -> dict:
    """One projection at ``rows`` rows: cuBLAS, the GEMV without and with PDL, and (``sweep``) its best tile."""
    from services.engine import ops
    from services.engine.ops import gemv_triton

    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    # The MLP's activation: the down projection's prologue at one row, the gate/up one's epilogue at several.
    gated = proj == "down" and rows == 1
    gated_out = proj == "gate_up" and rows > 1
    x = torch.randn(rows, 2 * k if gated else k, device="cuda", dtype=dtype)
    out = torch.empty(rows, n // 2 if gated_out else n, device="cuda", dtype=dtype)

    def cublas(i: int) -> torch.Tensor:
        y = torch.nn.functional.linear(ops.silu_and_mul(x) if gated else x, weights[i])
        return ops.silu_and_mul(y) if gated_out else y

    def triton_gemv(i: int, pdl: bool, tile: gemv_triton.Tile | None = None) -> torch.Tensor:
        return gemv_triton.gemv(x, weights[i], out=out, gated="silu" if gated else None,
                                gated_out="silu" if gated_out else None, pdl=pdl, tile=tile)

    err = (triton_gemv(0, True).float() - cublas(0).float()).abs().max().item()
    label = " (silu-and-mul first)" if gated else " (silu-and-mul after)" if gated_out else ""
    row = {"proj": proj + label, "n": n, "k": k, "rows": rows, "max_abs_err": err,
           "cublas_us": graph_time_us(cublas, copies),
           "triton_us": graph_time_us(lambda i: triton_gemv(i, False), copies),
           "pdl_us": graph_time_us(lambda i: triton_gemv(i, True), copies)}
    if sweep:
        best = None
        for tile in gemv_triton.search_space(rows):
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
    parser.add_argument("--rows", type=int_list, default=[1], help="rows of x (a decode batch), comma-separated")
    parser.add_argument("--sweep", action="store_true", help="time every tile of the search space, every row count")
    parser.add_argument("--sweep-rows", type=int_list, default=[], help="row counts to sweep the tiles of")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    peak_bw = next((bw for key, (bw, _) in GPU_PEAKS.items() if key in name), None)
    rows_out = [measure(proj, n, k, rows, dtype, args.copies, args.sweep or rows in args.sweep_rows, peak_bw)
                for rows in args.rows for proj, n, k in LLAMA_8B]
    emit_json(rows_out, args.json_out, to_stdout=False)
    print(f"{name}: rows of x against a weight, {args.copies} distinct weights per shape in one CUDA graph (us, "
          "fraction of the HBM peak)")
    print("| rows | proj (N x K) | cuBLAS | Triton | Triton + PDL | cuBLAS / Triton + PDL | best tile (PDL) | its us |")
    for r in rows_out:
        line = (f"| {r['rows']} | {r['proj']} ({r['n']}x{r['k']}) | {r['cublas_us']:.1f}"
                f" ({r.get('cublas_of_peak', 0):.2f}) | {r['triton_us']:.1f} ({r.get('triton_of_peak', 0):.2f})"
                f" | {r['pdl_us']:.1f} ({r.get('pdl_of_peak', 0):.2f}) | {r['cublas_us'] / r['pdl_us']:.2f} |")
        if "best_us" in r:
            line += f" {r['best_tile']} | {r['best_us']:.1f} ({r.get('best_of_peak', 0):.2f}) |"
        else:
            line += " | |"
        print(line)
    print(json.dumps({"max_abs_err": max(r["max_abs_err"] for r in rows_out)}))


if __name__ == "__main__":
    main()
