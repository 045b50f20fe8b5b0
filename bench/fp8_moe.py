"""The FP8 block-scaled grouped expert GEMM (``ops.fp8_moe``) against the same experts dequantized at load and run
through ``torch._grouped_mm`` (bf16), side by side in one run: what keeping DeepSeek's and Qwen3-MoE's FP8 routed
experts as stored costs or saves per projection, and how ``fp8_moe_triton.config_for``'s tiles hold up.

    python bench/fp8_moe.py                  # CUDA: DeepSeek-V2-Lite's and Qwen3-30B-A3B's expert shapes
    python bench/fp8_moe.py --sweep          # ... and every tile of the sweep per shape (the fastest marked)

For each model (its experts, top-k, hidden and expert widths), token count and projection (``gate_up``: N = 2I,
K = H, rows gathered from the tokens; ``down``: N = H, K = I, rows already sorted) with a uniform random top-k per
token: what ``RoutedExperts.project`` runs on FP8 experts (the 1 x 128 activation quantization, then the kernel)
and on bf16 experts (the gather, then the grouped GEMM), each replayed from a CUDA graph (as decode steps run), in
microseconds, beside the floor of reading the distinct chosen experts' weights once at the HBM peak (e4m3: a byte
a weight plus its 128 x 128 block scales; bf16: two) and the rows in and out; for prefill counts the TFLOP/s.
The last lines are the table: ``fp8/bf16`` is the ratio of the two measured in this run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import GPU_PEAKS, cuda_graph_ms, emit_json  # noqa: E402

BLOCK = (128, 128)
# (block_m, block_n, warps, stages, splits): decode's tiles split K; prefill's fill the SMs by rows
DECODE_TILES = [(16, n, 4, s, sp) for n, s, sp in itertools.product((32, 64, 128), (3, 4), (1, 2, 4, 8))
                if s == 3 or n == 64]
PREFILL_TILES = [(m, n, w, 3, 1) for m, n, w in itertools.product((64, 128), (64, 128), (4, 8))]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="deepseek-v2-lite,qwen3-30b-a3b", help="presets whose expert shapes to run")
    p.add_argument("--tokens", default="1,8,32,2048", help="tokens per call (each picks top-k experts)")
    p.add_argument("--sweep", action="store_true", help="also time every tile of the sweep")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def expert_shape(model: str) -> tuple[int, int, int, int]:
    """(experts, top-k, hidden, expert width) of a DeepSeek or Qwen3-MoE preset."""
    from services.engine.model_config.hf import preset

    config = preset(model)
    spec = config.moe if config.moe is not None else config.qwen3_moe
    if config.moe is not None:
        return spec.n_routed_experts, spec.num_experts_per_tok, config.hidden_size, spec.moe_intermediate_size
    return spec.num_experts, spec.num_experts_per_tok, config.hidden_size, spec.moe_intermediate_size


def _routing(experts: int, top_k: int, tokens: int, device):
    """A uniform random top-k per token: each (token, slot) pair's token in expert order, the experts' end rows,
    how many distinct experts were chosen."""
    import torch

    gen = torch.Generator().manual_seed(tokens)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).flatten()
    row_of = (chosen.argsort(stable=True) // top_k).to(device)
    ends = torch.bincount(chosen, minlength=experts).cumsum(0).to(torch.int32).to(device)
    return row_of, ends, int(chosen.unique().numel())


def _weights(e: int, n: int, k: int, device):
    """Random e4m3 experts with their block scales, and the same experts dequantized to bf16 ([E, K, N] view)."""
    import torch

    from services.engine.ops.fp8_format import FP8_DTYPE, expand_block_scales

    wq = (torch.randn(e, n, k, device=device) * 64).clamp(-448, 448).to(FP8_DTYPE)
    scales = torch.rand(e, math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1]), device=device) * 1e-4 + 1e-5
    dense = torch.empty(e, n, k, dtype=torch.bfloat16, device=device)
    for i in range(e):  # one expert at a time: the float32 intermediate of all of them would not fit
        dense[i] = (wq[i].float() * expand_block_scales(scales[i], n, k, BLOCK)).to(torch.bfloat16)
    return wq, scales, dense.transpose(1, 2)


def _time_us(fn, samples: int) -> float:
    return cuda_graph_ms(fn, samples, replays=20, warmup_replays=3) * 1e3


def _fp8_grouped(x, row_of, wq, scales, ends, config=None):
    """What ``RoutedExperts.project`` runs on FP8 experts (``config``: a tile of the sweep instead of the default)."""
    from services.engine.ops import fp8_gemm_triton, fp8_moe_triton

    xq, xs = fp8_gemm_triton.quantize_groups(x, BLOCK[1])
    return fp8_moe_triton.fp8_grouped_mm(xq, xs, row_of, wq, scales, BLOCK, ends, x.dtype, config)


def _bf16_grouped(x, row_of, dense_t, ends):
    """What ``RoutedExperts.project`` runs on bf16 experts: the gather (when rows come from tokens), the GEMM."""
    import torch

    return torch._grouped_mm(x if row_of is None else x[row_of], dense_t, offs=ends)


def _sweep(row: dict, fp8, num_rows: int, experts: int, samples: int) -> None:
    from services.engine.ops.fp8_moe_triton import Fp8MoeConfig

    best = None
    for tile in DECODE_TILES if num_rows <= 16 * experts else PREFILL_TILES:
        try:
            us = _time_us(functools.partial(fp8, config=Fp8MoeConfig(*tile)), samples)
        except Exception as exc:  # noqa: BLE001 -- a tile past the shared memory: skipped
            print(f"# {row['model']} {row['proj']} {row['tokens']} {tile}: {type(exc).__name__}", file=sys.stderr)
            continue
        row[f"tile_{'x'.join(map(str, tile))}_us"] = round(us, 2)
        best = min(best or (us, tile), (us, tile))
    if best is not None:
        row["best_tile"], row["best_us"] = "x".join(map(str, best[1])), best[0]


def _floors(row: dict, distinct: int, num_rows: int, n: int, k: int, peaks) -> None:
    bw, _ = peaks
    weights = distinct * n * k
    scale_bytes = distinct * math.ceil(n / BLOCK[0]) * math.ceil(k / BLOCK[1]) * 4
    rows_bytes = 2 * num_rows * (k + n)  # bf16 rows in and out
    row["floor_fp8_us"] = (weights + scale_bytes + rows_bytes) / bw * 1e6
    row["floor_bf16_us"] = (2 * weights + rows_bytes) / bw * 1e6
    row["fp8_tflops"] = 2 * num_rows * n * k / row["fp8_us"] / 1e6
    row["bf16_tflops"] = 2 * num_rows * n * k / row["bf16_us"] / 1e6


def rows_for(model: str, tokens_list: list[int], sweep: bool, samples: int, device, peaks) -> list[dict]:
    import torch

    from services.engine.ops.fp8_moe_triton import config_for

    e, top_k, hidden, inter = expert_shape(model)
    out = []
    for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
        wq, scales, dense_t = _weights(e, n, k, device)
        for tokens in tokens_list:
            row_of, ends, distinct = _routing(e, top_k, tokens, device)
            num_rows = row_of.numel()
            x = torch.randn(tokens if proj == "gate_up" else num_rows, k, dtype=torch.bfloat16, device=device)
            rows = row_of if proj == "gate_up" else None
            row = {"model": model, "proj": proj, "tokens": tokens, "rows": num_rows, "n": n, "k": k,
                   "distinct_experts": distinct, "config": str(config_for(num_rows, e))}
            fp8 = functools.partial(_fp8_grouped, x, rows, wq, scales, ends)
            with torch.inference_mode():
                row["fp8_us"] = _time_us(fp8, samples)
                row["bf16_us"] = _time_us(functools.partial(_bf16_grouped, x, rows, dense_t, ends), samples)
                if sweep:
                    _sweep(row, fp8, num_rows, e, samples)
            if peaks:
                _floors(row, distinct, num_rows, n, k, peaks)
            out.append(row)
            print(f"# {row}", file=sys.stderr, flush=True)
        del wq, scales, dense_t
        torch.cuda.empty_cache()
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<16} {'proj':<8} {'tokens':>6} {'rows':>6} {'fp8 us':>8} {'floor':>7} {'x floor':>8} "
          f"{'bf16 us':>8} {'floor':>7} {'x floor':>8} {'fp8/bf16':>8} {'fp8 TF/s':>8} {'best tile':>16} {'best':>7}")
    for r in rows:
        f8, fb = r.get("floor_fp8_us"), r.get("floor_bf16_us")
        print(f"{r['model']:<16} {r['proj']:<8} {r['tokens']:>6} {r['rows']:>6} {r['fp8_us']:>8.2f} "
              f"{f8 or 0:>7.2f} {r['fp8_us'] / f8 if f8 else 0:>8.2f} {r['bf16_us']:>8.2f} {fb or 0:>7.2f} "
              f"{r['bf16_us'] / fb if fb else 0:>8.2f} {r['fp8_us'] / r['bf16_us']:>8.2f} "
              f"{r.get('fp8_tflops', 0):>8.1f} {r.get('best_tile', '-'):>16} {r.get('best_us', 0):>7.2f}")


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/fp8_moe.py needs CUDA (the kernel is Triton's; the interpreter is not a measurement)")
        return 2
    name = torch.cuda.get_device_name()
    peaks = next((v for k, v in GPU_PEAKS.items() if k in name), None)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for model in args.models.split(","):
        rows += rows_for(model, tokens, args.sweep, args.samples, torch.device("cuda"), peaks)
    emit_json(rows, args.json_out, False)
    print(f"# {name}, torch {torch.__version__}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
