"""FP8 projections against bf16 on the same shapes: the block-scaled Triton GEMM, torch's scaled matmul, cuBLAS bf16.

For each projection of a model and each row count it times, inside CUDA graphs over ``--copies`` distinct
weights (so no weight is still in L2 when it is read again):

* ``bf16``: ``torch.nn.functional.linear`` on bf16 weights (cuBLAS), the reference speed;
* ``scaled_mm``: per-token activation quantization + ``torch._scaled_mm`` with row-wise scales (the per-tensor and
  per-channel checkpoints' path, ``fp8_gemm.row_scaled_linear``);
* ``block``: ``fp8_gemm.block_scaled_linear`` as the engine calls it (1x128 group quantization + the block-scaled
  Triton GEMM or cuBLASLt), and the Triton GEMM alone on pre-quantized activations (``block_gemm``); with
  ``--sweep``, every tile of ``sweep_tiles`` for the GEMM alone, the best printed per shape.

Each row prints microseconds, the ratio to bf16, the weight-read floor (e4m3 bytes over the HBM peak) at decode
sizes and TFLOP/s against the FP8 peak (twice the bf16 one) at prefill sizes. The block GEMM's output is checked
against the dequantized product before it is timed.

    python3 bench/fp8_gemm.py --rows 1,8,32,2048,8192 --sweep
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench._common import GPU_PEAKS, cuda_graph_ms, emit_json, int_list

# (name, out_features, in_features): Llama-3.1-8B's fused projections and DeepSeek-V3's dense-MLP and MLA shapes.
SHAPES = {
    "llama-3.1-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "deepseek-v3": [("q_a", 1536, 7168), ("kv_a", 576, 7168), ("q_b", 24576, 1536), ("o", 7168, 16384),
                    ("gate_up", 36864, 7168), ("down", 7168, 18432)],
}
BLOCK = (128, 128)


def sweep_tiles():
    from services.engine.ops.fp8_gemm_triton import Fp8Tile

    small = [Fp8Tile(bm, bn, w, s) for bm in (16, 32, 64) for bn in (32, 64, 128) for w in (4, 8) for s in (3, 4)
             if not (bm <= 32 and w == 8)]
    large = [Fp8Tile(bm, bn, 8, s) for bm, bn in ((128, 128), (128, 256), (256, 128)) for s in (3, 4)]
    split = [Fp8Tile(16, bn, 4, 4, split_k=sk) for bn in (32, 64) for sk in (1, 2, 4, 8)]
    return small + large + split + [Fp8Tile(128, 128, 4, 4), Fp8Tile(64, 256, 8, 3)]


def torch_blockwise(want: torch.Tensor, xq, xs, wq, ws):
    """torch's own block-scaled FP8 matmul (``F.scaled_mm`` with 1x128 / 128x128 recipes, cuBLASLt) as a function of
    (xq, xs, wq, ws), in the first scale layout that reproduces ``want``; None where torch has none or all fail."""
    F = torch.nn.functional
    if not hasattr(F, "scaled_mm"):
        return None, "no F.scaled_mm"
    st = F.ScalingType
    layouts = {"a_outer_b_t": lambda xs, ws: (xs.t().contiguous().t(), ws.t()),
               "a_outer_b": lambda xs, ws: (xs.t().contiguous().t(), ws),
               "plain": lambda xs, ws: (xs, ws), "a_outer_b_tc": lambda xs, ws: (xs.t().contiguous().t(),
                                                                               ws.t().contiguous())}
    errors = []
    for name, layout in layouts.items():
        def fn(xq, xs, wq, ws, layout=layout):
            sa, sb = layout(xs, ws)
            return F.scaled_mm(xq, wq.T, sa, st.BlockWise1x128, sb, st.BlockWise128x128, output_dtype=torch.bfloat16)
        try:
            got = fn(xq, xs, wq, ws).float()
        except Exception as e:  # noqa: BLE001 (report why torch refused, try the next layout)
            errors.append(f"{name}: {str(e).splitlines()[0][:80]}")
            continue
        err = ((got - want).abs().max() / want.abs().max()).item()
        if err < 2e-2:
            return fn, name
        errors.append(f"{name}: error {err:.2e}")
    return None, "; ".join(errors)


def graph_us(fn, copies: int) -> float:
    def every_copy() -> None:
        for i in range(copies):
            fn(i)

    return cuda_graph_ms(every_copy, 15, median=statistics.median_high) * 1e3 / copies


def measure(model: str, proj: str, n: int, k: int, rows: int, copies: int, sweep: bool, peaks) -> dict:
    from services.engine.ops import fp8_gemm, fp8_gemm_triton

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
    blocks = [_block_quantize(w) for w in w16]
    rowq = [fp8_gemm.quantize_rows(w) for w in w16]  # per-channel scales: [n, 1]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = fp8_gemm_triton.quantize_groups(x, BLOCK[1])
    got = fp8_gemm_triton.block_scaled_mm(xq, xs, *blocks[0], BLOCK, torch.float32)
    want = fp8_gemm.block_scaled_mm_reference(xq, xs, *blocks[0], BLOCK, torch.float32)
    error = ((got - want).abs().max() / want.abs().max()).item()
    times = {
        "bf16": graph_us(lambda i: torch.nn.functional.linear(x, w16[i]), copies),
        "scaled_mm": graph_us(lambda i: fp8_gemm.row_scaled_linear(x, rowq[i][0], rowq[i][1].view(-1)), copies),
        "block": graph_us(lambda i: fp8_gemm.block_scaled_linear(x, *blocks[i], BLOCK), copies),
        "block_gemm": graph_us(lambda i: fp8_gemm_triton.block_scaled_mm(xq, xs, *blocks[i], BLOCK, x.dtype), copies),
    }
    blockwise, how = torch_blockwise(want, xq, xs, *blocks[0])
    if blockwise is not None:
        times["torch_block"] = graph_us(lambda i: blockwise(xq, xs, *blocks[i]), copies)
    row = {"model": model, "proj": proj, "n": n, "k": k, "rows": rows, "rel_error": error, "torch_block_how": how,
           **{f"{name}_us": t for name, t in times.items()}}
    if sweep:
        best = min((graph_us(lambda i, t=t: fp8_gemm_triton.block_scaled_mm(xq, xs, *blocks[i], BLOCK, x.dtype,
                                                                            tile=t), copies), t)
                   for t in sweep_tiles())
        row["sweep_best_us"], row["sweep_best_tile"] = best[0], list(best[1])
    bw, flops16 = peaks
    row["floor_us"] = n * k / bw * 1e6  # e4m3 weight bytes
    row["tflops_block"] = 2 * rows * n * k / times["block"] / 1e6
    row["mfu_fp8_block"] = row["tflops_block"] * 1e12 / (2 * flops16)
    return row


def _block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 blocks of a weight with one scale per 128x128 block (the DeepSeek-V3 checkpoints' format)."""
    from services.engine.loading.quant.quantize import quantize_weight
    from services.engine.loading.quant.scheme import ScaleGranularity, WeightFormat

    return quantize_weight(w, WeightFormat(ScaleGranularity.BLOCK, BLOCK))


def summary(r: dict) -> str:
    """One printed line per measured row: times, the ratios to bf16, the floor and the FP8 MFU."""
    best = f"; best {r['sweep_best_us']:.1f} {r['sweep_best_tile']}" if "sweep_best_us" in r else ""
    if "torch_block_us" in r:
        best += f"; torch block {r['torch_block_us']:.1f}"
    return (f"{r['model']:13s} {r['proj']:8s} {r['rows']:5d} bf16 {r['bf16_us']:8.1f} scaled_mm "
            f"{r['scaled_mm_us']:8.1f} ({r['bf16_us'] / r['scaled_mm_us']:.2f}x) block {r['block_us']:8.1f} "
            f"({r['bf16_us'] / r['block_us']:.2f}x; gemm {r['block_gemm_us']:.1f}{best}) floor {r['floor_us']:.1f} "
            f"mfu8 {r['mfu_fp8_block']:.2f} err {r['rel_error']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-3.1-8b,deepseek-v3")
    parser.add_argument("--rows", type=int_list, default=[1, 8, 32, 2048, 8192])
    parser.add_argument("--copies", type=int, default=4, help="distinct weights per graph (L2 cold)")
    parser.add_argument("--sweep", action="store_true", help="time every tile of the block GEMM per shape")
    parser.add_argument("--sweep-rows", type=int_list, default=[1, 8, 32, 2048, 8192])
    parser.add_argument("--json-out")
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    peaks = next((v for key, v in GPU_PEAKS.items() if key in name), (3.35e12, 989e12))
    rows_out = []
    for model in args.models.split(","):
        for proj, n, k in SHAPES[model]:
            for rows in args.rows:
                copies = args.copies if rows <= 64 else 1
                rows_out.append(measure(model, proj, n, k, rows, copies, args.sweep and rows in args.sweep_rows,
                                        peaks))
                print(summary(rows_out[-1]), flush=True)
    emit_json(rows_out, args.json_out, False)


if __name__ == "__main__":
    main()
