"""Profile engine steps (torch.profiler) to see where a step's time goes: kernels by GPU time, host by CPU time.

    python bench/profile_step.py --batch 32             # decode steps at 512 tokens of context
    python bench/profile_step.py --batch 32 --context 2048
    python bench/profile_step.py --prefill 8192         # one prefill of an 8192-token prompt
    python bench/profile_step.py --batch 32 --eager     # decode steps without CUDA graphs

Besides torch.profiler's tables, a decode run prints GPU time per step by kind of kernel (projections,
attention, norms, ...), the breakdown RESULTS gives for what limits a step. With programmatic dependent
launch (``PDSERVE_PDL``, on by default on Hopper) a kernel starts before the one ahead of it ends and waits
inside, so its measured time includes that wait and the kinds add up to more than the step: profile with
``PDSERVE_PDL=0`` for times that add up.
"""


from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

import services  # noqa: E402,F401
from bench.step_kernels import kernel_kinds_table  # noqa: E402
from services.contract.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine_config import EngineConfig  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--context", type=int, default=512, help="decode: prompt tokens per request")
    ap.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens instead")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--eager", action="store_true", help="decode without CUDA graphs (the engine's --enforce-eager)")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
                                    max_num_batched_tokens=max(8192, args.prefill),
                                    attention_backend=args.attention_backend, enforce_eager=args.eager))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    if args.prefill:
        for warm in range(2):  # the same length once before, so nothing is compiled or allocated first inside
            engine.add_request(f"w{warm}", list(range(100 + warm, 100 + warm + args.prefill)),
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
        engine.add_request("p", list(range(200, 200 + args.prefill)), params)
    else:
        for i in range(args.batch):
            engine.add_request(f"r{i}", list(range(100 + i, 100 + i + args.context)), params)
        decoding: set[str] = set()
        while len(decoding) < args.batch:  # every prompt prefilled (a long batch takes several chunks) ...
            decoding.update(o.request_id for o in engine.step() if o.new_token_ids)
        for _ in range(5):  # ... and its decode graphs captured: only decode steps are profiled
            engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(1 if args.prefill else args.steps):
            engine.step()
    sort = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25))
    print(averages.table(sort_by=sort, row_limit=15))
    if engine.device.type == "cuda" and not args.prefill:
        print(kernel_kinds_table(averages, args.steps))


if __name__ == "__main__":
    main()
