"""The one entry point: ``pdserve generate|...``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

import services  # noqa: F401  (sets the oneDNN ISA cap before torch loads)
from services.common.tls import add_tls_arguments

if TYPE_CHECKING:
    from services.contract.sampling_params import SamplingParams
    from services.engine.engine_config import EngineConfig
    from services.engine.llm_engine import LLMEngine


def _positive_int(text: str) -> int:
    """An argparse type: a bad value is a usage error before any worker starts."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _gpu_list(text: str) -> list[int]:
    """An argparse type for ``--prefill-gpus 0,1``."""
    from services.placement import parse_gpu_list

    try:
        return parse_gpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model directory, .gguf file or dummy:<preset> (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda[:N] (rank r on cuda:N+r) or a comma list with one entry per TP rank")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size: ranks, one process each")
    p.add_argument("--kv-layout", default="cross_layer", choices=["cross_layer", "per_layer"])
    p.add_argument("--kv-block-order", default=None, choices=["NHD", "HND"],
                   help="token-major (NHD, default) or head-major (HND) KV blocks; HND keeps a head's slice of a "
                        "block contiguous, which pairs of different TP sizes read far faster (pdserve up picks it "
                        "for them)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: from memory)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="run decode steps eagerly (no CUDA graphs)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each decode step's tokens before launching the next (default: pipelined)")
    p.add_argument("--no-kv-shared-prefill-skip", action="store_true",
                   help="run every prompt token through KV-shared layers (Gemma-4) instead of only the sampled ones")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch_sdpa", "triton_paged"],
                   help="attention kernels: triton_paged reads the paged KV cache in place (CUDA), torch_sdpa "
                        "gathers it and runs masked SDPA (any device); auto: triton_paged on CUDA when Triton "
                        "imports, else torch_sdpa")
    p.add_argument("--kv-offload-gib", type=float, default=0.0,
                   help="host (CPU) KV tier size in GiB, pinned on CUDA: full blocks are copied there as they are "
                        "computed, and a later prompt with the same prefix loads them back instead of recomputing "
                        "(default 0: off)")
    p.add_argument("--kv-offload-block-factor", type=_positive_int, default=1,
                   help="device blocks per host-tier span, the unit the tier stores, looks up and evicts")
    p.add_argument("--seed", type=int, default=0, help="seed for dummy weights")


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as a command line, to start workers with the same engine."""
    argv = []
    for flag, value in (("--model", args.model), ("--dtype", args.dtype), ("--device", args.device),
                        ("--tp", args.tp), ("--block-size", args.block_size), ("--kv-layout", args.kv_layout),
                        ("--kv-block-order", args.kv_block_order), ("--num-kv-blocks", args.num_kv_blocks),
                        ("--max-model-len", args.max_model_len), ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens), ("--seed", args.seed),
                        ("--attention-backend", args.attention_backend),
                        ("--kv-offload-gib", args.kv_offload_gib or None),
                        ("--kv-offload-block-factor", args.kv_offload_block_factor)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--no-prefix-caching"] * args.no_prefix_caching + ["--enforce-eager"] * args.enforce_eager
    argv += ["--no-async-scheduling"] * args.no_async_scheduling
    argv += ["--no-kv-shared-prefill-skip"] * args.no_kv_shared_prefill_skip
    return argv


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from services.engine.engine_config import EngineConfig
    from services.engine.tp.parallel import ParallelConfig
    from services.kv.layout import BlockOrder, LayoutKind

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        block_size=args.block_size,
        kv_layout=LayoutKind(args.kv_layout),
        kv_block_order=BlockOrder(args.kv_block_order or "NHD"),
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        async_scheduling=not args.no_async_scheduling,
        kv_shared_prefill_skip=not args.no_kv_shared_prefill_skip,
        attention_backend=args.attention_backend,
        kv_offload_bytes=int(args.kv_offload_gib * 2**30) if args.kv_offload_gib else None,
        kv_offload_block_factor=args.kv_offload_block_factor,
        parallel=ParallelConfig(args.tp, 0),
    )


def start_engine_from_args(args: argparse.Namespace) -> LLMEngine:
    """The engine of ``args`` on its devices: rank 0 here and, with ``--tp`` > 1, one process per other rank."""
    from services.engine.tp.launch import start_engine
    from services.placement import rank_devices

    return start_engine(engine_config_from_args(args), rank_devices(args.device, args.tp), args.log_level)


def cmd_generate(args: argparse.Namespace) -> int:
    """Offline, one process: print the completion text and nothing else on stdout."""
    from services.contract.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed, stop=tuple(args.stop or ()),
    )
    engine = start_engine_from_args(args)
    try:
        return _generate(engine, args, params)
    finally:
        engine.close()


def _generate(engine: LLMEngine, args: argparse.Namespace, params: SamplingParams) -> int:
    prompt = args.prompt
    if args.chat:
        if engine.tokenizer is None:
            raise ValueError("--chat needs a model with a tokenizer and chat template")
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = engine.tokenizer.encode(prompt, add_special_tokens=False)
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: pick a free one, printed on the ready line)")
    p.add_argument("--advertise-host", default=None,
                   help="host peers should dial (default: --host; for 0.0.0.0 or ::, the IP this machine's name "
                        "resolves to, i.e. the container's or pod's own address)")
    p.add_argument("--engine-id", default=None, help=f"stable id of this engine (default: {role}@host:port)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: a free one)")
    p.add_argument("--kv-auth-token", default=os.environ.get("PDSERVE_KV_AUTH_TOKEN") or None,
                   help="shared token: KV agent metadata is only exchanged with peers presenting it (default: "
                        "$PDSERVE_KV_AUTH_TOKEN, which keeps it out of the process list)")
    add_tls_arguments(p)
    p.add_argument("--drain-timeout-s", type=float, default=30.0, help="SIGTERM: how long in-flight work may finish")
    if role == "prefill":
        p.add_argument("--kv-lease-s", type=float, default=30.0,
                       help="free pinned KV that no decode worker pulled within this time")
    else:
        p.add_argument("--kv-transfer-timeout-s", type=float, default=30.0, help="give up on a KV pull after this")


def cmd_worker(args: argparse.Namespace) -> int:
    """Run a prefill or decode daemon until SIGTERM/SIGINT drains it."""
    import asyncio

    engine = start_engine_from_args(args)
    if args.command == "prefill":
        from services.prefill.server import serve
    else:
        from services.decode.server import serve
    try:
        failure = asyncio.run(serve(args, engine))
    finally:
        engine.close()
    if failure:
        print(f"pdserve {args.command}: stopped: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from services.launcher import run_up

    return run_up(args, engine_argv(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion offline in this process")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)

    from services.router.cli_args import add_router_parser

    add_router_parser(sub)

    up = sub.add_parser("up", help="start a router, N prefill and M decode workers here; Ctrl-C stops all")
    up.add_argument("--host", default="127.0.0.1", help="router address (default 127.0.0.1)")
    up.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    up.add_argument("--num-prefill", type=int, default=1)
    up.add_argument("--num-decode", type=int, default=1)
    for role in ("prefill", "decode"):
        up.add_argument(f"--{role}-tp", type=_positive_int, default=None,
                        help=f"tensor-parallel size of each {role} worker (default: --tp)")
        up.add_argument(f"--{role}-block-size", type=int, default=None,
                        help=f"KV block size of the {role} workers (default: --block-size)")
        up.add_argument(f"--{role}-gpus", type=_gpu_list, default=None, metavar="I,J,...",
                        help=f"GPU indices for the {role} workers' ranks, handed out in order "
                             "(default: placed automatically)")
    up.add_argument("--served-model-name", default=None)
    up.add_argument("--direct-decode-threshold", type=int, default=0, metavar="TOKENS")
    up.add_argument("--metrics-port", type=int, default=0,
                    help="the supervisor's /metrics port (worker restarts; default: a free one, on the ready line)")
    up.add_argument("--prometheus-sd-file", default=None, metavar="PATH",
                    help="write every process's metrics address here as Prometheus file_sd targets")
    _add_engine_args(up)
    up.set_defaults(func=cmd_up)

    for role in ("prefill", "decode"):
        worker = sub.add_parser(role, help=f"run a {role} worker daemon (gRPC)")
        _add_engine_args(worker)
        _add_worker_args(worker, role)
        worker.set_defaults(func=cmd_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
