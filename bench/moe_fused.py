"""The fused MoE layer (``ops.moe_fused``) beside ``RoutedExperts``' grouped path (``torch._grouped_mm``) and the
weight-read floor, side by side in one run, on the routed experts of DeepSeek-V2-Lite, Qwen3-30B-A3B and
Granite-4.0-H-Tiny (one layer, bf16, random weights; the model's own router).

    python bench/moe_fused.py                  # CUDA: the three models at 1/8/32/2048 tokens
    python bench/moe_fused.py --sweep          # ... and every tile of the sweep per projection (the fastest kept)

Per model and token count, each replayed from a CUDA graph (as decode steps run), in microseconds:

* ``route``: the router alone: its torch forward (the logits GEMM, scores, top-k, weights) and the grouped path's
  sort (argsort, counts, ends) against the fused ``route`` (the same logits GEMM, then one or two launches);
* ``experts``: the experts alone on the same routing: ``RoutedExperts`` grouped against fused (gate_up with its
  activation, down, combine);
* ``layer``: both together, as a block runs them (``rel err``: the fused layer's output against the grouped one's);

beside the floor: the distinct chosen experts' weights (3 x H x I bf16 each) plus the rows in and out, read once
at the HBM peak (``_common.GPU_PEAKS``). ``--sweep`` times ``moe_gemm_triton``'s tiles on each projection alone
(gate_up with the activation, down keeping its split partials) and prints the best beside ``config_for``'s.
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

MODELS = ("deepseek-v2-lite", "qwen3-30b-a3b", "granite-4.0-h-tiny-shape")
# (block_m, block_n, block_k, warps, stages, splits)
DECODE_TILES = [(16, n, k, w, s, sp) for n, k, w, s, sp in
                itertools.product((32, 64, 128), (64, 128), (4,), (3, 4), (1, 2, 4, 8)) if not (n == 128 and k == 128)]
PREFILL_TILES = [(m, n, 64, w, s, 1) for m, n, w, s in itertools.product((64, 128), (64, 128), (4, 8), (3, 4))]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="presets whose routed experts to run")
    p.add_argument("--tokens", default="1,8,32,2048", help="tokens per call")
    p.add_argument("--sweep", action="store_true", help="also time every tile of the sweep per projection")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def build(model: str, device):
    """(router, experts, top_k) of one of ``model``'s MoE layers in bf16, random weights of unit-ish outputs."""
    import torch

    from services.engine.model_config.hf import preset
    from services.engine.models.moe import ExpertRouter, RoutedExperts, SoftmaxTopKRouter
    from services.engine.models.qwen3_moe import Qwen3MoeRouter

    config, dtype = preset(model), torch.bfloat16
    h = config.hidden_size
    if config.moe is not None:
        spec = config.moe
        router, e, k, i = ExpertRouter(h, spec, dtype, device), spec.n_routed_experts, spec.num_experts_per_tok, \
            spec.moe_intermediate_size
    elif config.qwen3_moe is not None:
        spec = config.qwen3_moe
        router, e, k, i = Qwen3MoeRouter(h, spec, dtype, device), spec.num_experts, spec.num_experts_per_tok, \
            spec.moe_intermediate_size
    else:
        spec = config.granite.experts
        e, k, i = spec.num_local_experts, spec.num_experts_per_tok, spec.intermediate_size
        router = SoftmaxTopKRouter(h, e, k, dtype, device)
    experts = RoutedExperts(e, h, i, dtype, device, path="fused")
    with torch.no_grad():
        for p in (*router.parameters(), *experts.parameters()):
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.01)
    return router, experts, k


def _grouped_route(router, experts, x):
    """The torch router and the grouped path's sort (what its forward runs before the GEMMs)."""
    import torch

    weights, ids = router(x)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(experts.num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return weights, order, counts.cumsum(0, dtype=torch.int32)


def _layer(router, experts, x, path: str):
    experts.path = path
    return experts(x, *router.route(x, path == "fused"))


def _tile_name(tile) -> str:
    return "x".join(str(v) for v in (tile.block_m, tile.block_n, tile.block_k, tile.warps, tile.stages, tile.splits))


def _rel(got, want) -> float:
    """The fused layer's largest difference from the grouped one, relative to the output's largest value."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _time_us(fn, samples: int) -> float:
    return cuda_graph_ms(fn, samples, replays=20, warmup_replays=3) * 1e3


def _floor_us(distinct: int, tokens: int, top_k: int, h: int, i: int, bandwidth: float) -> float:
    weights = distinct * 3 * h * i * 2
    rows = 2 * (tokens * h * 2 + tokens * top_k * (2 * i + i + h))  # x in, gate_up out / act in, down out; bf16
    return (weights + rows) / bandwidth * 1e6


def _sweep(row: dict, experts, x, order, num_rows: int, samples: int) -> None:
    """The best tile of each projection alone (gate_up with the activation, down keeping its partials)."""
    import torch

    from services.engine.ops.moe_gemm_triton import MoeTile, moe_gemm

    hidden = torch.empty(num_rows, experts.intermediate, dtype=x.dtype, device=x.device).normal_()
    cases = {"gate_up": lambda tile: moe_gemm(x, order.sorted_pairs, order.top_k, experts.gate_up, None, order.ends,
                                              act=True, config=tile),
             "down": lambda tile: moe_gemm(hidden, None, order.top_k, experts.down, None, order.ends,
                                           keep_splits=True, config=tile)}
    for proj, run in cases.items():
        row[f"{proj}_default_us"] = _time_us(functools.partial(run, None), samples)
        best = None
        for tile in DECODE_TILES if num_rows <= 16 * experts.num_experts else PREFILL_TILES:
            try:
                us = _time_us(functools.partial(run, MoeTile(*tile)), samples)
            except Exception as exc:  # noqa: BLE001 -- a tile past the shared memory: skipped
                print(f"# {row['model']} {proj} {row['tokens']} {tile}: {type(exc).__name__}", file=sys.stderr)
                continue
            best = min(best or (us, tile), (us, tile))
        if best is not None:
            row[f"{proj}_best_tile"], row[f"{proj}_best_us"] = "x".join(map(str, best[1])), best[0]


def rows_for(model: str, tokens_list: list[int], sweep: bool, samples: int, device, peaks) -> list[dict]:
    import torch

    from services.engine.ops.moe_gemm_triton import config_for

    router, experts, k = build(model, device)
    h, i, e = experts.gate_up.shape[2], experts.intermediate, experts.num_experts
    out = []
    for tokens in tokens_list:
        x = torch.randn(tokens, h, dtype=torch.bfloat16, device=device, generator=torch.Generator(device).manual_seed(
            tokens))
        with torch.inference_mode():
            weights, ids, order = router.route(x, True)
            distinct = int(ids.unique().numel())
            row = {"model": model, "tokens": tokens, "rows": tokens * k, "distinct_experts": distinct,
                   "gate_up_tile": _tile_name(config_for(tokens * k, e, i, h, True)),
                   "down_tile": _tile_name(config_for(tokens * k, e, h, i)),
                   "rel_err": _rel(_layer(router, experts, x, "fused"), _layer(router, experts, x, "grouped"))}
            row["route_torch_us"] = _time_us(functools.partial(_grouped_route, router, experts, x), samples)
            row["route_fused_us"] = _time_us(functools.partial(router.route, x, True), samples)
            experts.path = "grouped"
            row["experts_grouped_us"] = _time_us(functools.partial(experts, x, weights, ids), samples)
            experts.path = "fused"
            row["experts_fused_us"] = _time_us(functools.partial(experts, x, weights, ids, order), samples)
            row["layer_grouped_us"] = _time_us(functools.partial(_layer, router, experts, x, "grouped"), samples)
            row["layer_fused_us"] = _time_us(functools.partial(_layer, router, experts, x, "fused"), samples)
            experts.path = "fused"
            if sweep:
                _sweep(row, experts, x, order, tokens * k, samples)
        if peaks:
            row["floor_us"] = _floor_us(distinct, tokens, k, h, i, peaks[0])
        out.append(row)
        print(f"# {row}", file=sys.stderr, flush=True)
    del router, experts
    torch.cuda.empty_cache()
    return out


def _over(floor: float, us: float) -> float:
    return us / floor if floor else 0.0


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<25} {'tokens':>6} {'floor':>7} {'layer fused':>11} {'x floor':>7} {'layer grouped':>13} "
          f"{'x floor':>7} {'experts f/g':>11} {'x floor':>7} {'route f/t':>13} {'grouped/fused':>13} {'rel err':>8}")
    for r in rows:
        floor = r.get("floor_us") or 0.0
        ratio = functools.partial(_over, floor)
        print(f"{r['model']:<25} {r['tokens']:>6} {floor:>7.1f} {r['layer_fused_us']:>11.1f} "
              f"{ratio(r['layer_fused_us']):>7.2f} {r['layer_grouped_us']:>13.1f} {ratio(r['layer_grouped_us']):>7.2f} "
              f"{r['experts_fused_us']:>5.1f}/{r['experts_grouped_us']:<5.1f} {ratio(r['experts_fused_us']):>7.2f} "
              f"{r['route_fused_us']:>6.1f}/{r['route_torch_us']:<6.1f} "
              f"{r['layer_grouped_us'] / r['layer_fused_us']:>13.2f} {r['rel_err']:>8.1e}")
    swept = [r for r in rows if "gate_up_best_tile" in r]
    if swept:
        print(f"\n{'model':<25} {'tokens':>6} {'proj':<8} {'default us':>10} {'tile':<20} {'best us':>8} best tile")
        for r in swept:
            for proj in ("gate_up", "down"):
                print(f"{r['model']:<25} {r['tokens']:>6} {proj:<8} {r[f'{proj}_default_us']:>10.1f} "
                      f"{r[f'{proj}_tile']:<20} {r[f'{proj}_best_us']:>8.1f} {r[f'{proj}_best_tile']:<20}")


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/moe_fused.py needs CUDA (the kernels are Triton's; the interpreter is not a measurement)")
        return 2
    name = torch.cuda.get_device_name()
    peaks = next((v for k, v in GPU_PEAKS.items() if k in name), None)
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"# {name}, torch {torch.__version__}; us per call, CUDA-graph replays; floor: chosen experts' bf16 "
          "weights + rows at the HBM peak", flush=True)
    rows = []
    for model in args.models.split(","):  # a table and the JSON after each model: a timed-out run keeps what it had
        done = rows_for(model, tokens, args.sweep, args.samples, torch.device("cuda"), peaks)
        rows += done
        emit_json(rows, args.json_out, False)
        print_table(done)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
