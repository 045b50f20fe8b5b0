"""``pdserve router ...``: its flags, and running the app under uvicorn.

``services/cli.py`` wires it in with ``add_router_parser(sub)``; the subcommand's ``func`` is
:func:`run_router`.
"""

from __future__ import annotations

import argparse
import logging

from services.common.config_flags import add_flags, config_from_args
from services.common.tls import add_tls_arguments, tls_from_args
from services.router.config import RouterConfig

log = logging.getLogger(__name__)


def add_router_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``router`` subcommand to the CLI's subparsers and return its parser."""
    p = sub.add_parser("router", help="run the HTTP router (OpenAI-compatible API) in front of the workers")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    add_flags(p, RouterConfig)
    add_tls_arguments(p)
    p.set_defaults(func=run_router)
    return p


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    config = config_from_args(RouterConfig, args, tls=tls_from_args(args))
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
