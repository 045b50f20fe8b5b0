"""``pdserve router ...``: its flags, and running the app under uvicorn.

``services/cli.py`` wires it in with ``add_router_parser(sub)``; the subcommand's ``func`` is
:func:`run_router`.
"""

from __future__ import annotations

import argparse
import logging
import os

from services.common.tls import add_tls_arguments, tls_from_args
from services.router.config import DEFAULT_MAX_REQUEST_BYTES, RouterConfig

log = logging.getLogger(__name__)


def _addresses(text: str) -> tuple[str, ...]:
    """``a:1,b:2`` as a tuple; repeated flags are concatenated by ``action="extend"``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_router_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``router`` subcommand to the CLI's subparsers and return its parser."""
    p = sub.add_parser("router", help="run the HTTP router (OpenAI-compatible API) in front of the workers")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--model", default=None,
                   help="the workers' --model (HF directory, .gguf file or dummy:<preset>), for the tokenizer "
                        "and the model name (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients name in requests and /v1/models lists (default: from --model)")
    p.add_argument("--prefill", type=_addresses, action="extend", default=[], metavar="HOST:PORT,...",
                   help="prefill worker addresses")
    p.add_argument("--decode", type=_addresses, action="extend", default=[], metavar="HOST:PORT,...",
                   help="decode worker addresses")
    p.add_argument("--prefill-dns", type=_addresses, action="extend", default=[], metavar="NAME:PORT,...",
                   help="DNS names whose addresses are prefill workers (e.g. a Kubernetes headless Service)")
    p.add_argument("--decode-dns", type=_addresses, action="extend", default=[], metavar="NAME:PORT,...",
                   help="DNS names whose addresses are decode workers")
    p.add_argument("--dns-refresh-s", type=float, default=10.0, help="re-resolve DNS names this often")
    p.add_argument("--health-interval-s", type=float, default=2.0, help="probe each worker's Info this often")
    p.add_argument("--health-timeout-s", type=float, default=1.0, help="a probe slower than this fails")
    p.add_argument("--direct-decode-threshold", type=int, default=0, metavar="TOKENS",
                   help="prompts shorter than this go straight to a decode worker (default 0: never)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length to check prompts against (default: the smallest the workers report)")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="deadline for a whole request")
    p.add_argument("--max-inflight-requests", type=int, default=None,
                   help="beyond this many requests in flight, answer 429 (default: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help=f"longer request bodies get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY") or None,
                   help="require 'Authorization: Bearer <key>' on /v1/*, /tokenize and /detokenize (default: "
                        "$PDSERVE_API_KEY, which keeps it out of the process list; unset: no key needed)")
    p.add_argument("--kv-auth-token", default=os.environ.get("PDSERVE_KV_AUTH_TOKEN") or None,
                   help="the workers' cluster token, sent with every call to them (default: "
                        "$PDSERVE_KV_AUTH_TOKEN; workers started with one refuse calls without it)")
    add_tls_arguments(p)
    p.set_defaults(func=run_router)
    return p


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    config = RouterConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        prefill_dns=tuple(args.prefill_dns),
        decode_dns=tuple(args.decode_dns),
        dns_refresh_s=args.dns_refresh_s,
        health_interval_s=args.health_interval_s,
        health_timeout_s=args.health_timeout_s,
        direct_decode_threshold=args.direct_decode_threshold,
        max_model_len=args.max_model_len,
        request_timeout_s=args.request_timeout_s,
        max_inflight_requests=args.max_inflight_requests,
        max_request_bytes=args.max_request_bytes,
        api_key=args.api_key,
        kv_auth_token=args.kv_auth_token,
        tls=tls_from_args(args),
    )
    if not (config.decode or config.decode_dns):
        raise ValueError("the router needs decode workers: give --decode or --decode-dns")
    return config


def run_router(args: argparse.Namespace) -> int:
    """Build the app and serve it until interrupted; ValueError/FileNotFoundError for bad flags."""
    import uvicorn

    from services.router.app import create_app

    # create_app checks every address (a typo stops the start) and loads the tokenizer.
    app = create_app(router_config_from_args(args))
    log.info("router for %s on http://%s:%d", app.state.runtime.model_name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=getattr(args, "log_level", "WARNING").lower(),
                access_log=False, timeout_graceful_shutdown=30)
    return 0
