"""Start a store, N ``kvtier serve`` workers and the router on one machine, as processes.

Every process listens on 127.0.0.1 (the router on ``--host:--port``); all are stopped by PID
(SIGTERM, then SIGKILL) when the router stops. Logs go to a fresh temporary directory, printed
at start.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtier.cluster import StartupError
from kvtier.cluster.stores import StoreProcess, check_store_url, start_store

START_TIMEOUT_S = 300.0


@dataclass
class WorkerProcess:
    url: str
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def spawn_kvtier(argv: list[str], log: Path, **popen_kw) -> subprocess.Popen:
    """``kvtier ARGV`` (this interpreter's kvtier) as a child process with its output to ``log``."""
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "kvtier.cli", *argv], stdout=f, stderr=subprocess.STDOUT,
                                **popen_kw)


def spawn_worker(model: str, args: list[str], log: Path, host: str = "127.0.0.1") -> subprocess.Popen:
    """``kvtier serve MODEL --host HOST --port 0 ARGS`` with output to ``log``."""
    return spawn_kvtier(["serve", model, "--host", host, "--port", "0", *args], log)


def wait_worker(proc: subprocess.Popen, log: Path, timeout_s: float = START_TIMEOUT_S) -> WorkerProcess:
    """Wait until a ``kvtier serve`` (or ``kvtier router``) process prints its URL and answers
    ``/health``.

    Raises:
        StartupError: it exited or did not answer within ``timeout_s`` (with its log's tail).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(rb"listening on (http://[^\s/]+:\d+)", log.read_bytes())
        if m:
            url = m.group(1).decode()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return WorkerProcess(url, proc, log)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    raise StartupError(f"kvtier {' '.join(map(str, proc.args[3:5]))} did not start (log {log}): "
                       f"{log.read_text(errors='replace')[-2000:]}")


def start_workers(model: str, args: list[str], n: int, workdir: Path, name: str,
                  procs: list[WorkerProcess]) -> list[WorkerProcess]:
    """Start ``n`` workers ``kvtier serve MODEL ARGS`` at once (logs ``workdir/NAME-i.log``) and
    wait for each; they are appended to ``procs`` as they answer (the caller stops them). Returns
    the new ones.

    Raises:
        StartupError: one did not start (those not yet waited for are stopped).
    """
    spawned = [(spawn_worker(model, args, workdir / f"{name}-{i}.log"), workdir / f"{name}-{i}.log") for i in range(n)]
    first = len(procs)
    try:
        for proc, log in spawned:
            procs.append(wait_worker(proc, log))
            print(f"kvtier cluster: {name} {procs[-1].url} (pid {proc.pid})", flush=True)
    except BaseException:
        for proc, log in spawned[len(procs) - first:]:
            WorkerProcess("", proc, log).stop()
        raise
    return procs[first:]


def start_store_for_workers(store: str, workdir: Path) -> StoreProcess:
    """Start the ``store`` server (logs in ``workdir``) and say where it listens."""
    st = start_store(store, workdir)
    print(f"kvtier cluster: {store} store {st.url} (pid {st.proc.pid})", flush=True)
    return st


def cluster_worker_args(worker_args: list[str], store_url: str | None) -> list[str]:
    """``kvtier serve`` arguments of a cluster's workers: ``worker_args``, KV events on a free
    port (the router subscribes to them) and the remote tier at ``store_url`` when one is set."""
    args = list(worker_args) + ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
    return args + ["--remote-cache-url", store_url] if store_url else args


def exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def run_cluster(model: str, *, workers: int, store: str, policy: str, host: str, port: int,
                worker_args: list[str], log_level: str = "warning", store_url: str | None = None) -> int:
    """Start everything, serve the router until SIGINT/SIGTERM, then stop every process.

    ``store_url`` (a ``remote_cache_url``): use that running store instead of starting one
    of ``store``.

    Raises:
        StoreUnreachableError: ``store_url`` does not answer (names it); StartupError: a store
            or worker did not start (names it, with its log's tail).
    """
    from kvtier.cluster.router.app import build_router_app, check_workers, subscribe_events
    from kvtier.cluster.router.routing import Router

    workdir = Path(tempfile.mkdtemp(prefix="kvtier-cluster-"))
    print(f"kvtier cluster: logs in {workdir}", flush=True)
    st: StoreProcess | None = None
    procs: list[WorkerProcess] = []
    try:
        url = check_store_url(store_url) if store_url else None
        if url is None and store != "none":
            st = start_store_for_workers(store, workdir)
            url = st.url
        args = cluster_worker_args(worker_args, url)
        start_workers(model, args, workers, workdir, "worker", procs)
        router = Router([w.url for w in procs], policy=policy, remote=bool(url))
        events = subscribe_events(router, check_workers(router.urls))
        return serve_router(build_router_app(router, events=events), host, port, log_level)
    finally:
        stop_all(procs, st)


def serve_router(app, host: str, port: int, log_level: str) -> int:
    """Serve a cluster's router ``app`` until SIGINT/SIGTERM; returns 0. uvicorn re-raises the
    signal it stopped on once it is done: SIGTERM becomes SystemExit, so the caller's cleanup runs."""
    from kvtier.serve.api.server import serve

    signal.signal(signal.SIGTERM, exit_on_signal)
    serve(app, host, port, log_level, name="kvtier cluster: router")
    return 0


def stop_all(procs: list[WorkerProcess], st: StoreProcess | None) -> None:
    """Stop a cluster's workers (by PID), then its store if it started one."""
    for w in procs:
        w.stop()
    if st is not None:
        st.stop(signal.SIGTERM)
