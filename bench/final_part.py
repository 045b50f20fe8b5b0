"""What a short final prefill chunk costs: a long prompt's prefill with ``--kv-final-part-tokens`` and without.

    python3 bench/final_part.py --model dummy:llama-3.1-8b --dtype bfloat16 --device cuda --prompt-len 32768
    python bench/final_part.py --quick                       # CPU smoke: tiny model, short prompt

A prefill worker sending KV per chunk ends a prompt of several chunks with one of at most N tokens, so the KV
left to pull after the first token is small (``Request.final_chunk_cap``); the price is one more prefill step.
This times that price where nothing else runs: one engine, the same prompt length prefilled with the cap and
without it, alternating (fresh prompts, prefix cache off), the median of ``--rounds`` each, and prints the
ratio. Time to the second token is measured in service by ``bench/serve.py`` (``--worker-args`` with
``--kv-final-part-tokens``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import services  # noqa: E402,F401,I001  (oneDNN ISA cap before torch)
import torch  # noqa: E402

from services.contract.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine_config import EngineConfig  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402


def prefill_ms(engine: LLMEngine, prompt: list[int], cap: tuple[int, int] | None) -> tuple[float, int]:
    """ms from adding the prompt to its first token, and the steps it took."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started, steps = time.perf_counter(), 0
    engine.add_request(f"p{started}", prompt, params, final_chunk_cap=cap)
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return (time.perf_counter() - started) * 1e3, steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:qwen3-0.6b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=2048, help="the token budget per step")
    ap.add_argument("--final-part-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="CPU smoke: 96-token prompt, chunks of 32, cap 16")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.chunk, args.final_part_tokens, args.rounds = 96, 32, 16, 1
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
                                    max_model_len=args.prompt_len + 16))
    cap = (args.final_part_tokens, engine.kv_layout.groups[0].block_size)
    times: dict[str, list[float]] = {"capped": [], "uncapped": []}
    steps: dict[str, int] = {}
    for c in (cap, None):  # warm-up: both ways' chunk shapes compiled, memory allocated
        prefill_ms(engine, [7 + (c is None)] * args.prompt_len, c)
    for r in range(args.rounds):
        for name, c in (("capped", cap), ("uncapped", None)):
            prompt = [(r * 7919 + i * 31 + (name == "capped")) % 1000 + 3 for i in range(args.prompt_len)]
            ms, steps[name] = prefill_ms(engine, prompt, c)
            times[name].append(ms)
    capped, uncapped = (statistics.median(times[k]) for k in ("capped", "uncapped"))
    print(f"# {engine.source.name} on {engine.device}, {args.prompt_len}-token prompt, chunks of {args.chunk}, "
          f"final chunk <= {args.final_part_tokens} tokens; median of {args.rounds}, alternating")
    print(f"capped   {capped:10.2f} ms  {steps['capped']} steps   runs {[round(t, 2) for t in times['capped']]}")
    print(f"uncapped {uncapped:10.2f} ms  {steps['uncapped']} steps   runs {[round(t, 2) for t in times['uncapped']]}")
    print(f"capped / uncapped {capped / uncapped:.4f} (+{capped - uncapped:.2f} ms)")


if __name__ == "__main__":
    main()
