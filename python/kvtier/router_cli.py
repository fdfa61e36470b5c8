"""``kvtier router --workers URL,...``: the OpenAI-compatible router (see :mod:`kvtier.router`)."""

from __future__ import annotations

import argparse

from kvtier.router.policy import POLICIES


def cmd_router(args: argparse.Namespace) -> int:
    from kvtier.router.app import build_router_app, check_workers
    from kvtier.router.policy import Router
    from kvtier.serve.api.server import serve

    urls = [u.strip().rstrip("/") for u in args.workers.split(",") if u.strip()]
    if not urls or any(not u.startswith(("http://", "https://")) for u in urls):
        raise ValueError(f"--workers must be a comma-separated list of http:// URLs, got {args.workers!r}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    router = Router(urls, policy=args.policy, remote=args.remote)
    check_workers(urls)
    serve(build_router_app(router), args.host, args.port, args.log_level, name="kvtier router")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("router", help="OpenAI-compatible router in front of several kvtier serve workers")
    s.add_argument("--workers", required=True, metavar="URL,...", help="worker base URLs (http://HOST:PORT)")
    s.add_argument("--policy", default="kv-aware", choices=POLICIES, help="routing policy")
    s.add_argument("--remote", action="store_true",
                   help="the workers share a remote KV tier (a moved session loads its prefix from it)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8100, help="port (0 = a free port, printed at start)")
    s.add_argument("--log-level", default="warning", help="uvicorn log level")
    s.set_defaults(func=cmd_router)
