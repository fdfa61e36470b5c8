"""``kvtier cluster MODEL``: a store, N ``kvtier serve`` workers and a router, as processes on this
machine or placed by Ray (see :mod:`kvtier.cluster`)."""

from __future__ import annotations

import argparse

from kvtier.cluster.router.routing import POLICIES


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
        from kvtier.cluster.pd_launch import run_pd_cluster

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


def add_parser(sub) -> None:
    """Register ``kvtier cluster`` on the CLI's subparsers."""
    s = sub.add_parser("cluster", help="a store, N kvtier serve workers and a router: processes on this machine, "
                                       "or placed by Ray (--launcher ray)")
    s.add_argument("model", help="weights directory or preset")
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
