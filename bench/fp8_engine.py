"""The engine on an FP8 checkpoint against the same model in bf16, in one run (one device call).

    python bench/fp8_engine.py                       # dummy:llama-3.1-8b (bf16) vs dummy:llama-3.1-8b-fp8, CUDA

Both engines load the same dummy weights (``dummy:*-fp8`` quantizes them per 128 x 128 block at load), one after
the other (each loaded once, freed before the next). For each: prefill of one prompt (2k, 8k: ms, and MFU against
the peak of its GEMMs' type -- bf16 989 TFLOP/s, FP8 twice that on an H100/H200; attention and the LM head stay
bf16 in both, so the FP8 run's MFU understates its GEMMs'), decode steps at batch 1/8/32 over 2k contexts against
the floor (the bytes of the model's own weights -- e4m3 projections with their scales, bf16 embeddings, norms and
head for the FP8 run -- plus the KV, over HBM bandwidth), and the ratio FP8/bf16 of each. Then greedy agreement:
the tokens until the first difference between the two over a few prompts, and the largest relative error (max abs
difference / max abs value) of the FP8 logits at the first step; and the same between the FP8 engine and the FP8
checkpoint dequantized to bf16 at load (``--quantization none``: the same weights exactly, so only the FP8
compute differs -- the activations' e4m3 rounding and the FP8 GEMMs' sums).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import services  # noqa: E402,F401,I001  (oneDNN ISA cap before torch)
import torch  # noqa: E402

from bench._common import emit_json, int_list  # noqa: E402
from bench.engine import bench_decode, bench_prefill, machine_peaks  # noqa: E402
from bench.floors import decode_floor_bytes, prefill_flops  # noqa: E402
from services.contract.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine_config import EngineConfig  # noqa: E402
from services.engine.kv_cache.buffers import TORCH_DTYPES  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.engine.models.fp8_linear import Fp8Linear  # noqa: E402


def _engine(model: str, args, quantization: str) -> LLMEngine:
    batch = max(args.batch_sizes)
    tokens = max(batch * (args.context + args.decode_steps + 16), max(args.prefill_lens)) + 4096
    return LLMEngine(EngineConfig(model=model, device=args.device, dtype="bfloat16", quantization=quantization,
                                  max_num_seqs=batch, max_num_batched_tokens=max(8192, max(args.prefill_lens)),
                                  enable_prefix_caching=False, num_kv_blocks=tokens // 16 + 1))


def _timings(engine: LLMEngine, args) -> list[dict]:
    """Prefill and decode rows of one engine, beside their floors (the FP8 peak when it keeps FP8 projections)."""
    dtype = TORCH_DTYPES[engine.dtype]
    bandwidth, flops, _ = machine_peaks(engine.device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kept = sum(isinstance(m, Fp8Linear) for m in engine.model.modules())
    flops *= 2 if kept else 1  # FP8 tensor cores: twice the bf16 rate
    common = dict(model=engine.source.name, fp8_projections=kept,
                  weight_gb=weight_bytes / 1e9, peak_tflops=flops / 1e12, peak_bandwidth_gbs=bandwidth / 1e9)
    mc, rows = engine.model_config, []
    bench_prefill(engine, 1, 512, 1)  # warm-up
    for n in args.prefill_lens:
        bench_prefill(engine, 1, n, 1)
        seconds = bench_prefill(engine, 1, n, args.rounds)
        rows.append(dict(common, case="prefill", prompt_len=n, ms=seconds * 1e3,
                         mfu=prefill_flops(mc, n) / flops / seconds))
    for batch in args.batch_sizes:
        seconds = bench_decode(engine, batch, args.context, args.decode_steps)
        floor = decode_floor_bytes(engine, weight_bytes, batch, args.context, dtype.itemsize) / bandwidth
        rows.append(dict(common, case="decode", batch=batch, context=args.context, ms=seconds * 1e3,
                         floor_ms=floor * 1e3, x_floor=seconds / floor))
    return rows


def _greedy(engine: LLMEngine, args) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of a few seeded prompts, and each one's logits at the first step (its last prompt position)."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(100, 30000, (args.greedy_prompt_len,), generator=gen).tolist()
               for _ in range(args.greedy_prompts)]
    params = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True, return_logits=True)
    outputs = engine.generate(prompts, params)
    firsts = []
    for prompt, out in zip(prompts, outputs, strict=True):
        last = len(prompt) - 1
        firsts.append(next(chunk[last - start] for start, chunk in out.logits if start <= last < start + len(chunk)))
    return [out.token_ids for out in outputs], firsts


def _run(model: str, args, quantization: str, timed: bool = True
         ) -> tuple[list[dict], list[list[int]], list[torch.Tensor]]:
    """One engine loaded, timed (unless not ``timed``) and run greedily, then freed before the next loads."""
    engine = _engine(model, args, quantization)
    try:
        rows = _timings(engine, args) if timed else []
        tokens, logits = _greedy(engine, args)
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return rows, tokens, [t.float().cpu() for t in logits]


def _agreement(fp8: list[list[int]], ref: list[list[int]]) -> list[int]:
    return [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
            for x, y in zip(fp8, ref, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3.1-8b", help="the bf16 model")
    ap.add_argument("--fp8-model", default="dummy:llama-3.1-8b-fp8", help="the same weights in FP8")
    ap.add_argument("--quantization", default="auto", help="the FP8 engine's --quantization (auto: FP8 on sm_89+)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefill-lens", type=int_list, default=[2048, 8192])
    ap.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--greedy-prompts", type=int, default=4)
    ap.add_argument("--greedy-prompt-len", type=int, default=128)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    bf16_rows, bf16_tokens, bf16_logits = _run(args.model, args, "auto")
    fp8_rows, fp8_tokens, fp8_logits = _run(args.fp8_model, args, args.quantization)
    for bf16, fp8 in zip(bf16_rows, fp8_rows, strict=True):
        fp8["vs_bf16"] = fp8["ms"] / bf16["ms"]
    _, deq_tokens, deq_logits = _run(args.fp8_model, args, "none", timed=False)  # the same weights, dequantized

    def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))

    greedy = dict(case="greedy", prompts=args.greedy_prompts, tokens=args.greedy_tokens,
                  agree_until=_agreement(fp8_tokens, bf16_tokens), first_step_logits_max_rel_err=rel(fp8_logits,
                                                                                                      bf16_logits),
                  dequantized_agree_until=_agreement(fp8_tokens, deq_tokens),
                  dequantized_first_step_logits_max_rel_err=rel(fp8_logits, deq_logits))
    if emit_json([*bf16_rows, *fp8_rows, greedy], args.json_out, args.json):
        return
    _print(bf16_rows, fp8_rows, greedy)


def _print(bf16_rows: list[dict], fp8_rows: list[dict], greedy: dict) -> None:
    for rows in (bf16_rows, fp8_rows):
        r = rows[0]
        print(f"# {r['model']}: weights {r['weight_gb']:.2f} GB, {r['fp8_projections']} FP8 projections, peaks "
              f"{r['peak_tflops']:.0f} TFLOP/s, {r['peak_bandwidth_gbs']:.0f} GB/s")
    print(f"{'case':>18} {'bf16 ms':>9} {'MFU/xfloor':>10} {'fp8 ms':>9} {'MFU/xfloor':>10} {'fp8/bf16':>9}")
    for b, f in zip(bf16_rows, fp8_rows, strict=True):
        if b["case"] == "prefill":
            name, qb, qf = f"prefill {b['prompt_len']}", f"{b['mfu']:.2f}", f"{f['mfu']:.2f}"
        else:
            name = f"decode bs{b['batch']} @{b['context']}"
            qb, qf = f"{b['x_floor']:.2f}x", f"{f['x_floor']:.2f}x"
        print(f"{name:>18} {b['ms']:>9.2f} {qb:>10} {f['ms']:>9.2f} {qf:>10} {f['vs_bf16']:>9.2f}")
    print(f"# greedy FP8 vs bf16 (same dummy weights): tokens until the first difference {greedy['agree_until']} of "
          f"{greedy['tokens']}; first-step logits max rel error {greedy['first_step_logits_max_rel_err']:.3e}")
    print(f"# greedy FP8 vs the FP8 checkpoint dequantized to bf16: tokens until the first difference "
          f"{greedy['dequantized_agree_until']}; first-step logits max rel error "
          f"{greedy['dequantized_first_step_logits_max_rel_err']:.3e}")


if __name__ == "__main__":
    main()
