"""``kvtier router --workers URL,...``: the OpenAI-compatible router (see :mod:`kvtier.cluster.router`)."""

from __future__ import annotations

import argparse

from kvtier.cluster.router.routing import POLICIES


def cmd_router(args: argparse.Namespace) -> int:
    from kvtier.cluster.router.app import build_router_app, check_workers, subscribe_events
    from kvtier.cluster.router.pd import prefill_stage
    from kvtier.cluster.router.routing import Router
    from kvtier.serve.api.server import serve

    if (args.workers is None) == (args.decode_workers is None) or (args.prefill_workers is None) != (
            args.decode_workers is None):
        raise ValueError("give either --workers URL,... (colocated workers) or both --prefill-workers URL,... and "
                         f"--decode-workers URL,... (got --workers {args.workers!r}, --prefill-workers "
                         f"{args.prefill_workers!r}, --decode-workers {args.decode_workers!r})")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    urls = _urls("--workers" if args.workers is not None else "--decode-workers", args.workers or args.decode_workers)
    router = Router(urls, policy=args.policy, remote=args.remote)
    events = subscribe_events(router, check_workers(urls))
    stage = None
    if args.prefill_workers is not None:
        stage = prefill_stage(_urls("--prefill-workers", args.prefill_workers), urls, args.policy, args.remote)
    serve(build_router_app(router, events=events, prefill=stage), args.host, args.port, args.log_level,
          name="kvtier router")
    return 0


def _urls(flag: str, value: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
    if not urls or any(not u.startswith(("http://", "https://")) for u in urls):
        raise ValueError(f"{flag} must be a comma-separated list of http:// URLs, got {value!r}")
    return urls


def add_parser(sub) -> None:
    s = sub.add_parser("router", help="OpenAI-compatible router in front of several kvtier serve workers")
    s.add_argument("--workers", metavar="URL,...", help="worker base URLs (http://HOST:PORT)")
    s.add_argument("--prefill-workers", metavar="URL,...", help="prefill/decode disaggregation: kvtier serve "
                   "--role prefill workers (each turn's prompt runs there; its blocks go to the decode worker)")
    s.add_argument("--decode-workers", metavar="URL,...", help="with --prefill-workers: kvtier serve --role decode "
                   "workers (chosen per turn by --policy; they decode)")
    s.add_argument("--policy", default="kv-aware", choices=POLICIES, help="routing policy")
    s.add_argument("--remote", action="store_true",
                   help="the workers share a remote KV tier (a moved session loads its prefix from it)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8100, help="port (0 = a free port, printed at start)")
    s.add_argument("--log-level", default="warning", help="uvicorn log level")
    s.set_defaults(func=cmd_router)


