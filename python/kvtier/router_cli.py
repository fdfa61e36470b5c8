"""``kvtier router --workers URL,...``: the OpenAI-compatible router (see :mod:`kvtier.router`)."""

from __future__ import annotations

import argparse

from kvtier.router.policy import POLICIES


def cmd_router(args: argparse.Namespace) -> int:
    from kvtier.router.app import build_router_app, check_workers, subscribe_events
    from kvtier.router.policy import Router
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


def prefill_stage(prefill_urls: list[str], decode_urls: list[str], policy: str, remote: bool):
    """The router's :class:`kvtier.router.pd.PrefillStage` after checking every worker's role.

    Raises:
        ValueError: a prefill worker that does not answer or is not ``--role prefill``, or a
            decode worker that is not ``--role decode`` or ``both`` (named).
    """
    from kvtier.router.pd import PrefillStage, check_roles
    from kvtier.router.policy import Router

    check_roles(prefill_urls, decode_urls)  # prefill workers are placed by where a session's last prefill ran
    return PrefillStage(Router(prefill_urls, policy=policy, remote=remote))


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


def cmd_cluster(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.host_cache_bytes <= 0 and (args.store != "none" or args.store_url):
        raise ValueError(f"--store {args.store} needs --host-cache-bytes > 0, got {args.host_cache_bytes}")
    if args.store_url:
        from kvtier.cache.remote import check_remote_url

        check_remote_url("--store-url", args.store_url)
    if args.ray_address and args.launcher != "ray":
        raise ValueError(f"--ray-address needs --launcher ray, got --launcher {args.launcher}")
    worker_args = ["--host-cache-bytes", str(args.host_cache_bytes), "--num-device-pages", str(args.num_device_pages),
                   "--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads)]
    if args.tokenizer:
        worker_args += ["--tokenizer", args.tokenizer]
    if args.prefill_workers or args.decode_workers:
        if args.launcher != "process" or args.store_url:
            raise SystemExit("kvtier cluster: --prefill-workers/--decode-workers start processes on this machine "
                             "with their own store; --launcher ray and --store-url are not supported with them")
        from kvtier.cluster.pd import run_pd_cluster

        return run_pd_cluster(args.model, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                              store=args.store, policy=args.policy, host=args.host, port=args.port,
                              worker_args=worker_args, log_level=args.log_level)
    common = dict(workers=args.workers, store=args.store, store_url=args.store_url, policy=args.policy,
                  host=args.host, port=args.port, worker_args=worker_args)
    if args.launcher == "ray":
        from kvtier.cluster.ray_launch import run_ray_cluster

        return run_ray_cluster(args.model, worker_cpus=args.threads, ray_address=args.ray_address, **common)
    from kvtier.cluster.launch import run_cluster

    return run_cluster(args.model, log_level=args.log_level, **common)


def add_cluster_parser(sub) -> None:
    s = sub.add_parser("cluster", help="a store, N kvtier serve workers and a router: processes on this machine, "
                                       "or placed by Ray (--launcher ray)")
    s.add_argument("model", help="checkpoint directory or preset")
    s.add_argument("--tokenizer", metavar="DIR", help="Kimi tokenizer files (default: the model directory)")
    s.add_argument("--workers", type=int, default=2, help="kvtier serve workers to start")
    s.add_argument("--prefill-workers", type=int, default=0,
                   help="prefill/decode disaggregation: --role prefill workers to start (with --decode-workers; "
                   "--workers is then ignored)")
    s.add_argument("--decode-workers", type=int, default=0, help="with --prefill-workers: --role decode workers")
    s.add_argument("--store", default="redis", choices=["redis", "mooncake", "none"],
                   help="shared remote KV tier (none: each worker keeps its own cache)")
    s.add_argument("--store-url", metavar="URL", default=None,
                   help="use this running store (redis://HOST:PORT or mooncake://HOST:PORT) instead of starting one")
    s.add_argument("--policy", default="kv-aware", choices=POLICIES, help="routing policy")
    s.add_argument("--launcher", default="process", choices=["process", "ray"],
                   help="process: every role a process on this machine; ray: workers (and the router) started "
                        "by Ray actors, placed by Ray (pip install 'kvtier[ray]')")
    s.add_argument("--ray-address", metavar="ADDR", default=None,
                   help="with --launcher ray: join this Ray cluster (default: start one on this machine)")
    s.add_argument("--host", default="127.0.0.1", help="router address")
    s.add_argument("--port", type=int, default=8100, help="router port (0 = a free port, printed at start)")
    s.add_argument("--host-cache-bytes", type=int, default=256 << 20, help="each worker's host tier budget")
    s.add_argument("--num-device-pages", type=int, default=1024, help="each worker's device KV pages")
    s.add_argument("--max-num-seqs", type=int, default=64, help="each worker's requests running at once")
    s.add_argument("--threads", type=int, default=1, help="torch threads per worker (with Ray: its CPUs)")
    s.add_argument("--log-level", default="warning", help="uvicorn log level")
    s.set_defaults(func=cmd_cluster)
