"""A ``kvtier serve`` worker of a P/D role: :func:`kvtier.serve.api.server.make_app` with the
role's engine thread, start-up checks and routes plugged into its seams."""

from __future__ import annotations

import functools

from kvtier.cluster.disagg import check_compatible, check_role, reach_decode_workers
from kvtier.cluster.disagg.routes import add_role_routes, worker_info
from kvtier.cluster.disagg.worker import DisaggMetrics, PrefillWorker
from kvtier.serve.api.server import make_app


def make_worker_app(model: str, *, role: str = "both", decode_workers: list[str] = (), transfer_timeout_s: float = 5.0,
                    **app_args):
    """The application of one worker of ``role`` over a fresh engine for ``model``.

    ``role``: ``both`` (colocated, the default; it can also take blocks from prefill workers),
    ``decode`` (also takes blocks from prefill workers) or ``prefill`` (sends each turn's blocks
    to one of ``decode_workers``, base URLs checked at start-up; ``transfer_timeout_s`` bounds
    each call). ``app_args`` go to :func:`kvtier.serve.api.server.make_app`.

    Raises:
        ValueError: an unknown ``role``, a P/D role without prefix caching (asked for, or a model
            whose engine runs without it), a prefill worker
            without a reachable, compatible decode worker, or what ``make_app`` raises.
    """
    check_role(role)
    if role != "both" and not app_args.get("enable_prefix_caching", True):
        raise ValueError(f"--role {role} needs prefix caching (blocks are sent and found by their hash); "
                         "drop --no-prefix-caching")
    decoders = reach_decode_workers(list(decode_workers), transfer_timeout_s) if role == "prefill" else {}
    hooks = {}

    def on_engine(engine) -> None:
        if not engine.config.pool.enable_prefix_caching:
            raise ValueError(f"--role {role} needs prefix caching (blocks are sent and found by their hash), "
                             "which this model's engine runs without; serve it with --role both")
        if role == "prefill":
            check_compatible(decoders, worker_info(engine, role))

    if role != "both":
        hooks["on_engine"] = on_engine
    if role == "prefill":
        hooks["worker_factory"] = functools.partial(PrefillWorker, transfer_timeout_s=transfer_timeout_s)

    def extend(app, worker, metrics) -> None:
        add_role_routes(app, worker, role, DisaggMetrics(metrics.registry, role), list(decode_workers))

    return make_app(model, extend_app=extend, **hooks, **app_args)
