"""``pdserve router ...``: its flags, and running the app under uvicorn.

The HTTP door's timeouts and connection limit (``http_door.py``) are flags here, not ``RouterConfig`` fields:
they shape the server, not the app. ``services/cli.py`` wires it in with ``add_router_parser(sub)``; the
subcommand's ``func`` is :func:`run_router`.
"""

from __future__ import annotations

import argparse
import logging

from services.common.config_flags import add_flags, config_from_args
from services.common.tls import add_tls_arguments, tls_from_args
from services.router.config import RouterConfig
from services.router.http_door import DoorLimits, room_for_connections, uvicorn_config

log = logging.getLogger(__name__)


def add_router_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``router`` subcommand to the CLI's subparsers and return its parser."""
    p = sub.add_parser("router", help="run the HTTP router (OpenAI-compatible API) in front of the workers")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    add_flags(p, RouterConfig)
    add_flags(p, DoorLimits)  # the HTTP door's bounds: uvicorn's, not the app's (http_door.py)
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
    limits = config_from_args(DoorLimits, args)
    room_for_connections(limits.max_connections)
    config = uvicorn_config(app, limits, host=args.host, port=args.port, access_log=False,
                            log_level=getattr(args, "log_level", "WARNING").lower(), timeout_graceful_shutdown=30)
    uvicorn.Server(config).run()
    return 0
