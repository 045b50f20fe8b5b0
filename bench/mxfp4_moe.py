"""The MXFP4 grouped expert GEMM (``ops.mxfp4_moe_triton``) against the same experts dequantized at load and run
through ``torch._grouped_mm`` (bf16), side by side in one run: how ``config_for``'s tiles were chosen and what
keeping gpt-oss's experts in MXFP4 costs or saves per projection.

    python bench/mxfp4_moe.py                  # CUDA: gpt-oss-20b's and -120b's expert shapes, default tiles
    python bench/mxfp4_moe.py --sweep          # ... and every tile of the sweep per shape (the fastest marked)

For each model (its experts, top-k, hidden and intermediate widths), token count and projection (``gate_up``:
N = 2I, K = H; ``down``: N = H, K = I) with a uniform random top-k per token: the kernel at ``config_for``'s tile
and the bf16 grouped GEMM, each replayed from a CUDA graph (as decode steps run), in microseconds, beside the
floor of reading the distinct chosen experts' bytes once at the HBM peak (MXFP4: 4.25 bits a weight; bf16: 16)
and, for the prefill counts, the TFLOP/s of the active FLOPs. The last lines are the table.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import GPU_PEAKS, cuda_graph_ms, emit_json  # noqa: E402

# (block_m, block_n, block_k, warps, stages, splits): decode's tiles split K (a few rows per expert leave the
# GPU's SMs idle otherwise); prefill's fill the SMs by rows
DECODE_TILES = [(16, n, k, 4, 3, sp) for n, k, sp in itertools.product((32, 64), (64, 128), (1, 2, 4, 8))]
PREFILL_TILES = [(m, n, 64, w, 3, 1) for m, n, w in itertools.product((64, 128), (64, 128), (4, 8))]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt-oss-20b,gpt-oss-120b", help="presets whose expert shapes to run")
    p.add_argument("--tokens", default="1,8,32,512,2048", help="tokens per call (each picks top-k experts)")
    p.add_argument("--sweep", action="store_true", help="also time every tile of the sweep")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def _problem(config, tokens: int, device):
    """Random MXFP4 experts of ``config``'s shapes, a routing of ``tokens`` and its sorted rows."""
    import torch

    spec = config.gpt_oss
    gen = torch.Generator().manual_seed(tokens)
    chosen = torch.stack([torch.randperm(spec.num_experts, generator=gen)[:spec.num_experts_per_tok]
                          for _ in range(tokens)])
    order = chosen.flatten().argsort(stable=True)
    row_of = (order // spec.num_experts_per_tok).to(device)
    counts = torch.bincount(chosen.flatten(), minlength=spec.num_experts)
    ends = counts.cumsum(0).to(torch.int32).to(device)
    return chosen, row_of, ends


def _weights(e: int, n: int, k: int, device):
    import torch

    blocks = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(118, 124, (e, n, k // 32), dtype=torch.uint8, device=device)
    return blocks, scales


def _time_us(fn, samples: int) -> float:
    return cuda_graph_ms(fn, samples, replays=20, warmup_replays=3) * 1e3


def _bf16_grouped(a, row_of, dense_t, bias, ends, by_expert):
    """What ``RoutedExperts.project`` runs on bf16 experts: gather, grouped GEMM, the experts' biases."""
    import torch

    return torch._grouped_mm(a[row_of], dense_t, offs=ends) + bias[by_expert]


def rows_for(model: str, tokens_list: list[int], sweep: bool, samples: int, device, peaks) -> list[dict]:
    import torch

    from services.engine.model_config.hf import preset
    from services.engine.ops.mxfp4_format import GROUP, dequantize_mxfp4
    from services.engine.ops.mxfp4_moe_triton import MxConfig, config_for, mxfp4_grouped_mm

    config = preset(model)
    spec = config.gpt_oss
    hidden, inter, e = config.hidden_size, config.intermediate_size, spec.num_experts
    out = []
    for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
        blocks, scales = _weights(e, n, k, device)
        dense = torch.empty(e, n, k, dtype=torch.bfloat16, device=device)
        for i in range(e):  # one expert at a time: the float32 intermediate of all of them would not fit
            dense[i] = dequantize_mxfp4(blocks[i].view(n, -1, GROUP // 2), scales[i], torch.bfloat16)
        dense_t = dense.transpose(1, 2)
        bias = torch.randn(e, n, dtype=torch.bfloat16, device=device)
        for tokens in tokens_list:
            chosen, row_of, ends = _problem(config, tokens, device)
            a = torch.randn(tokens, k, dtype=torch.bfloat16, device=device)
            num_rows, distinct = row_of.numel(), int(chosen.unique().numel())
            row = {"model": model, "proj": proj, "tokens": tokens, "rows": num_rows, "n": n, "k": k,
                   "distinct_experts": distinct, "config": str(config_for(num_rows, e))}

            mx = functools.partial(mxfp4_grouped_mm, a, row_of, blocks, scales, bias, ends)
            with torch.inference_mode():
                row["mxfp4_us"] = _time_us(mx, samples)
                row["bf16_us"] = _time_us(functools.partial(_bf16_grouped, a, row_of, dense_t, bias, ends,
                                                             chosen.flatten().sort().values.to(device)), samples)
                if sweep:
                    tiles = DECODE_TILES if num_rows <= 16 * e else PREFILL_TILES
                    best = None
                    for tile in tiles:
                        cfg = MxConfig(*tile)
                        try:
                            us = _time_us(functools.partial(mx, config=cfg), samples)
                        except Exception as exc:  # noqa: BLE001 -- a tile past the shared memory: skipped
                            print(f"# {model} {proj} {tokens} {tile}: {type(exc).__name__}", file=sys.stderr)
                            continue
                        row[f"tile_{'x'.join(map(str, tile))}_us"] = round(us, 2)
                        best = min(best or (us, tile), (us, tile))
                    row["best_tile"], row["best_us"] = "x".join(map(str, best[1])), best[0]
            if peaks:
                bw, flops = peaks
                weight_bytes = distinct * n * k
                row["floor_mxfp4_us"] = (weight_bytes * 17 / 32 + 2 * (num_rows * (k + n))) / bw * 1e6
                row["floor_bf16_us"] = (weight_bytes * 2 + 2 * (num_rows * (k + n))) / bw * 1e6
                row["mxfp4_tflops"] = 2 * num_rows * n * k / row["mxfp4_us"] / 1e6
                row["bf16_tflops"] = 2 * num_rows * n * k / row["bf16_us"] / 1e6
            out.append(row)
            print(f"# {row}", file=sys.stderr, flush=True)
        del dense, dense_t
        torch.cuda.empty_cache()
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<13} {'proj':<8} {'tokens':>6} {'rows':>6} {'mxfp4 us':>9} {'floor':>7} {'x floor':>8} "
          f"{'bf16 us':>8} {'floor':>7} {'x floor':>8} {'mx/bf16':>8} {'mx TF/s':>8} {'best tile':>16} {'best':>7}")
    for r in rows:
        fm, fb = r.get("floor_mxfp4_us"), r.get("floor_bf16_us")
        print(f"{r['model']:<13} {r['proj']:<8} {r['tokens']:>6} {r['rows']:>6} {r['mxfp4_us']:>9.2f} "
              f"{fm or 0:>7.2f} {r['mxfp4_us'] / fm if fm else 0:>8.2f} {r['bf16_us']:>8.2f} {fb or 0:>7.2f} "
              f"{r['bf16_us'] / fb if fb else 0:>8.2f} {r['mxfp4_us'] / r['bf16_us']:>8.2f} "
              f"{r.get('mxfp4_tflops', 0):>8.1f} {r.get('best_tile', '-'):>16} {r.get('best_us', 0):>7.2f}")


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/mxfp4_moe.py needs CUDA (the kernel is Triton's; the interpreter is not a measurement)")
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
