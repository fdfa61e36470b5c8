"""``kvtier cluster --launcher ray``: the same roles as :mod:`.launch`, placed by Ray.

Each ``kvtier serve`` worker is started by a Ray actor (:class:`KvtierProcess`) that Ray places
on a node with ``worker_cpus`` free CPUs (``SPREAD``: across nodes when there are several); the
actor runs the worker as a child process on its node, listening on that node's address, and
stops it by PID. The router is started the same way by an actor pinned to the node this
command runs on, so ``--host:--port`` is on this machine. Ray carries only control (start,
stop, addresses): requests go over HTTP to the router and from it to the workers, KV bytes
through the shared store (``--remote-cache-url``), never through Ray's object store.

The store: ``store_url`` names a running one (for several machines it must listen on an address
every node reaches); otherwise one of ``store`` is started on this machine on 127.0.0.1, which
only workers on this machine reach.

Ray: ``ray_address`` joins a running cluster (``ray start --head ...`` on each machine, see
docs/cluster.md); without it, a Ray instance is started on this machine on 127.0.0.1 and shut down
at the end; when the caller already called ``ray.init``, that one is used and left running.
"""

from __future__ import annotations

import functools
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.cluster import StartupError
from kvtier.cluster.launch import START_TIMEOUT_S, WorkerProcess, exit_on_signal, spawn_kvtier, wait_worker
from kvtier.cluster.stores import StoreProcess, check_store_url, start_store

# A local Ray on loopback without usage reporting or token files (see docs/cluster.md). Ray reads
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is first imported: without it "127.0.0.1" is
# replaced by the machine's routable address and Ray listens on every interface.
RAY_LOCAL_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
STOP_TIMEOUT_S = 60.0


def _parent_death_signal():
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent (the actor) dies, so a
    killed actor leaves no worker behind (Linux ``prctl``; None elsewhere). ``prctl`` is looked
    up here, in the parent: the child only calls it between fork and exec."""
    if not os.uname().sysname == "Linux":
        return None
    import ctypes

    prctl, PR_SET_PDEATHSIG = ctypes.CDLL(None, use_errno=True).prctl, 1
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class KvtierProcess:
    """A Ray actor's body: one ``kvtier`` command (``serve`` or ``router``) as a child process
    on the node Ray placed the actor on (use through :func:`start_ray_cluster`)."""

    def __init__(self, name: str):
        self.name = name
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvtier-{name}-"))
        self.proc: WorkerProcess | None = None

    def node_ip(self) -> str:
        """The address this node joined Ray with (what other nodes reach it by)."""
        import ray

        me = ray.get_runtime_context().get_node_id()
        return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == me)

    def start(self, argv: list[str], timeout_s: float = START_TIMEOUT_S) -> dict:
        """Run ``kvtier ARGV`` (``{node_ip}`` in an argument is this node's address) until it
        answers ``/health``; returns its ``url``, ``pid``, ``node_ip`` and ``log``.

        Raises:
            StartupError: it exited or did not answer (with the node and its log's tail).
        """
        ip = self.node_ip()
        argv = [a.replace("{node_ip}", ip) for a in argv]
        log = self.workdir / f"{self.name}.log"
        proc = spawn_kvtier(argv, log, preexec_fn=_parent_death_signal())
        try:
            self.proc = wait_worker(proc, log, timeout_s)
        except StartupError as e:
            raise StartupError(f"{self.name} on node {ip}: {e}") from None
        return {"url": self.proc.url, "pid": proc.pid, "node_ip": ip, "log": str(log)}

    def stop(self) -> bool:
        """Stop the child (SIGTERM, then SIGKILL); True once it is gone."""
        if self.proc is not None:
            self.proc.stop()
        return True


@dataclass
class RayCluster:
    """A running cluster started by :func:`start_ray_cluster`.

    Attributes:
        router_url: the router's ``http://HOST:PORT``.
        workers: each worker's ``url``, ``pid``, ``node_ip`` and ``log`` (as the actor reported).
        router: the same for the router.
    """

    router_url: str = ""
    workers: list[dict] = field(default_factory=list)
    router: dict = field(default_factory=dict)
    store: StoreProcess | None = None
    actors: list = field(default_factory=list)
    owns_ray: bool = False

    def stop(self) -> None:
        """Stop the router and the workers (by their actors, then the actors), the store this
        cluster started, and Ray when this cluster started it."""
        try:
            if self.actors:
                import ray

                try:
                    ray.get([a.stop.remote() for a in self.actors], timeout=STOP_TIMEOUT_S)
                except Exception:  # an actor already dead: its child got SIGTERM with it
                    pass
                for a in self.actors:
                    ray.kill(a)
                self.actors = []
        finally:
            if self.store is not None:
                self.store.stop(signal.SIGTERM)
                self.store = None
            if self.owns_ray:
                import ray

                ray.shutdown()
                self.owns_ray = False


def connect_ray(address: str | None, num_cpus: int) -> bool:
    """Join the Ray cluster at ``address``, or the one this process already joined, or start
    one on 127.0.0.1 with ``num_cpus`` CPUs; True when this call started or joined it (the
    caller shuts it down)."""
    if not address:
        for k, v in RAY_LOCAL_ENV.items():  # before ray is first imported (see RAY_LOCAL_ENV)
            os.environ.setdefault(k, v)
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
        return True
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=128 << 20, log_to_driver=False)
    return True


@functools.cache
def _actor_class():
    import ray

    return ray.remote(KvtierProcess)


def _actor(name: str, num_cpus: float, strategy):
    return _actor_class().options(num_cpus=num_cpus, scheduling_strategy=strategy).remote(name)


def _started(refs: list, what: list[str], timeout_s: float) -> list[dict]:
    """The actors' start results; an actor that failed or died is a StartupError naming it."""
    import ray

    out = []
    for ref, name in zip(refs, what):
        try:
            out.append(ray.get(ref, timeout=timeout_s))
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise StartupError(str(cause) if isinstance(cause, StartupError) else f"{name}: {e}") from None
        except (ray.exceptions.RayError, TimeoutError) as e:
            raise StartupError(f"{name}: {type(e).__name__}: {e}") from None
    return out


def start_ray_cluster(model: str, *, workers: int, policy: str, worker_args: list[str], store: str = "redis",
                      store_url: str | None = None, host: str = "127.0.0.1", port: int = 0,
                      worker_cpus: float = 1.0, ray_address: str | None = None,
                      timeout_s: float = START_TIMEOUT_S) -> RayCluster:
    """Start the store (or check ``store_url``), ``workers`` workers and the router under Ray.

    Args:
        model: weights directory or preset, as ``kvtier serve`` takes it (on every node).
        workers: number of ``kvtier serve`` workers (>= 1).
        policy: the router's policy (``sticky``, ``least-loaded``, ``kv-aware``).
        worker_args: more ``kvtier serve`` arguments (``--tokenizer``, sizes, ``--threads``).
        store, store_url: the shared remote tier (see the module docstring); ``store="none"``
            and no ``store_url``: none.
        host, port: the router's address (port 0: a free one, in ``router_url``).
        worker_cpus: CPUs Ray reserves for each worker (its placement resource).
        ray_address: a running Ray cluster to join (``ray start --head`` address).

    Raises:
        ValueError: a bad argument, named; StoreUnreachableError: ``store_url`` does not answer
            (names it); StartupError: a role did not start (names it, its node, its log's tail).
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not worker_cpus > 0:
        raise ValueError(f"worker_cpus must be > 0, got {worker_cpus}")
    cluster = RayCluster()
    try:
        url = check_store_url(store_url) if store_url else None
        if url is None and store != "none":
            cluster.store = start_store(store, Path(tempfile.mkdtemp(prefix="kvtier-cluster-")))
            url = cluster.store.url
        cluster.owns_ray = connect_ray(ray_address, max(os.cpu_count() or 1, int(workers * worker_cpus + 0.999)))
        import ray  # after connect_ray: it sets what ray reads on its first import
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        args = ["serve", model, "--host", "{node_ip}", "--port", "0", *worker_args,
                "--kv-events-endpoint", "tcp://{node_ip}:0", *(["--remote-cache-url", url] if url else [])]
        actors = [_actor(f"worker-{i}", worker_cpus, "SPREAD") for i in range(workers)]
        cluster.actors += actors
        names = [f"worker-{i}" for i in range(workers)]
        cluster.workers = _started([a.start.remote(args, timeout_s) for a in actors], names, timeout_s + 60)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        router = _actor("router", 0, here)
        cluster.actors.append(router)
        router_args = ["router", "--workers", ",".join(w["url"] for w in cluster.workers), "--policy", policy,
                       "--host", host, "--port", str(port), *(["--remote"] if url else [])]
        cluster.router = _started([router.start.remote(router_args, timeout_s)], ["router"], timeout_s + 60)[0]
        cluster.router_url = cluster.router["url"]
        return cluster
    except BaseException:
        cluster.stop()
        raise


def run_ray_cluster(model: str, **kw) -> int:
    """:func:`start_ray_cluster`, print where everything runs, wait for SIGINT/SIGTERM, stop."""
    previous = signal.signal(signal.SIGTERM, exit_on_signal)  # also during start-up: what started is stopped
    try:
        cluster = start_ray_cluster(model, **kw)
        try:
            if cluster.store is not None:
                print(f"kvtier cluster: store {cluster.store.url} (pid {cluster.store.proc.pid})", flush=True)
            for w in cluster.workers:
                print(f"kvtier cluster: worker {w['url']} on node {w['node_ip']} (pid {w['pid']}, log {w['log']})",
                      flush=True)
            print(f"kvtier cluster: router: listening on {cluster.router_url} (pid {cluster.router['pid']}, "
                  f"log {cluster.router['log']})", flush=True)
            signal.signal(signal.SIGTERM, exit_on_signal)  # again: ray.init installs its own (it aborts)
            while True:
                time.sleep(3600)
        finally:
            cluster.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)
