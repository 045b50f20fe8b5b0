"""The one entry point: ``pdserve generate|prefill|decode|router|up|drain|health``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

import services  # noqa: F401  (sets the oneDNN ISA cap before torch loads)
from services.common.config_flags import add_flags, argv_from_args, config_from_args
from services.common.tls import add_tls_arguments, tls_from_args
from services.engine.engine_config import EngineConfig
from services.worker.config import CONFIG_OF_ROLE, SwitchableConfig

if TYPE_CHECKING:
    from services.contract.sampling_params import SamplingParams
    from services.engine.llm_engine import LLMEngine


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as a command line, to start workers with the same engine."""
    return argv_from_args(EngineConfig, args)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, args)


def start_engine_from_args(args: argparse.Namespace) -> LLMEngine:
    """The engine of ``args`` on its devices: rank 0 here and, with ``--tp`` > 1, one process per other rank."""
    from services.engine.start import start_engine
    from services.launch.placement import rank_devices

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


def cmd_worker(args: argparse.Namespace) -> int:
    """Run a prefill or decode daemon until SIGTERM/SIGINT drains it (with ``--role-switching``: one that
    starts in that role and can switch to the other in place)."""
    import asyncio

    switching = args.role_switching
    config = config_from_args(SwitchableConfig if switching else CONFIG_OF_ROLE[args.command], args,
                              tls=tls_from_args(args))
    engine = start_engine_from_args(args)
    if switching:
        from services.launch.switchable import serve_switchable

        serving = serve_switchable(config, engine, args.command)
    elif args.command == "prefill":
        from services.prefill.server import serve

        serving = serve(config, engine)
    else:
        from services.decode.server import serve

        serving = serve(config, engine)
    try:
        failure = asyncio.run(serving)
    finally:
        engine.close()
    if failure:
        print(f"pdserve {args.command}: stopped: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from services.launch.up import run_up

    return run_up(args, engine_argv(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion offline in this process")
    add_flags(gen, EngineConfig)
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

    from services.launch.drain import add_drain_parser

    add_drain_parser(sub)

    from services.launch.health import add_health_parser

    add_health_parser(sub)

    from services.launch.up_flags import add_up_parser

    up = add_up_parser(sub)
    up.set_defaults(func=cmd_up)

    for role in ("prefill", "decode"):
        worker = sub.add_parser(role, help=f"run a {role} worker daemon (gRPC)")
        add_flags(worker, EngineConfig)
        add_flags(worker, SwitchableConfig)  # the other role's settings matter with --role-switching
        add_tls_arguments(worker)
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
