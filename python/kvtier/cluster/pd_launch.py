"""``kvtier cluster MODEL --prefill-workers N --decode-workers M``: decode workers, then prefill
workers that send to them, then the P/D router, as processes on this machine (see
:mod:`kvtier.cluster.launch`; all stopped by PID when the router stops)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from kvtier.cluster.launch import (WorkerProcess, cluster_worker_args, serve_router, start_store_for_workers,
                                   start_workers, stop_all)
from kvtier.cluster.stores import StoreProcess


def run_pd_cluster(model: str, *, prefill_workers: int, decode_workers: int, store: str, policy: str, host: str,
                   port: int, worker_args: list[str], log_level: str = "warning") -> int:
    """Start everything, serve the router until SIGINT/SIGTERM, then stop every process.

    Raises:
        ValueError: fewer than one prefill or decode worker.
    """
    from kvtier.cluster.router.app import build_router_app, check_workers, subscribe_events
    from kvtier.cluster.router.routing import Router
    from kvtier.cluster.router.pd import prefill_stage

    if prefill_workers < 1 or decode_workers < 1:
        raise ValueError(f"--prefill-workers and --decode-workers must both be >= 1, got {prefill_workers} and "
                         f"{decode_workers}")
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-cluster-"))
    print(f"kvtier cluster: logs in {workdir}", flush=True)
    st: StoreProcess | None = None
    procs: list[WorkerProcess] = []
    try:
        if store != "none":
            st = start_store_for_workers(store, workdir)
        args = cluster_worker_args(worker_args, st.url if st is not None else None)
        decoders = start_workers(model, [*args, "--role", "decode"], decode_workers, workdir, "decode", procs)
        urls = [w.url for w in decoders]
        prefills = start_workers(model, [*args, "--role", "prefill", "--decode-workers", ",".join(urls)],
                                 prefill_workers, workdir, "prefill", procs)
        router = Router(urls, policy=policy, remote=st is not None)
        events = subscribe_events(router, check_workers(urls))
        stage = prefill_stage([w.url for w in prefills], urls, policy, st is not None)
        return serve_router(build_router_app(router, events=events, prefill=stage), host, port, log_level)
    finally:
        stop_all(procs, st)
