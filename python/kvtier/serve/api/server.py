"""Start ``kvtier serve``: the model and engine, the engine thread, uvicorn on one socket."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from kvtier.serve.api.app import ServerOptions, build_app
from kvtier.serve.api.metrics import ServerMetrics
from kvtier.serve.api.worker import EngineWorker


def make_app(model: str, *, tokenizer: str | None, served_model_name: str | None = None, max_queue: int = 256,
             session_ttl_s: float = 600.0, dtype: str = "auto", device: str = "cpu", seed: int = 0,
             kv_events_endpoint: str | None = None, role: str = "both", decode_workers: list[str] = (),
             transfer_timeout_s: float = 5.0, resume_ttft_s: float | None = None, **engine_args):
    """The application over a fresh engine for ``model`` (a checkpoint directory or a preset).

    ``kv_events_endpoint`` (e.g. ``tcp://127.0.0.1:0``): publish the pool's KV events there
    (:mod:`kvtier.cache.kv_events`; the bound endpoint is the events' worker id and is reported
    by ``/health``).

    ``resume_ttft_s``: the TTFT target of a session's turn after a tool wait; resumes and misses
    (by why) are counted in ``/metrics`` (:mod:`kvtier.serve.api.resume`).

    ``role`` (:mod:`kvtier.disagg`): ``both`` (colocated, the default), ``decode`` (also takes
    blocks from prefill workers) or ``prefill`` (sends each turn's blocks to one of
    ``decode_workers``, base URLs checked at start-up; ``transfer_timeout_s`` bounds each call).

    Raises:
        ValueError: no tokenizer (a preset needs ``tokenizer``), a bad engine argument or limit,
            a KV events endpoint that cannot be bound, an unknown ``role``, or a prefill worker
            without a reachable, compatible decode worker.
    """
    from kvtier.disagg import check_compatible, check_role, reach_decode_workers
    from kvtier.llm import LLM

    check_role(role)
    if role != "both" and not engine_args.get("enable_prefix_caching", True):
        raise ValueError(f"--role {role} needs prefix caching (blocks are sent and found by their hash); "
                         "drop --no-prefix-caching")
    decoders = reach_decode_workers(list(decode_workers), transfer_timeout_s) if role == "prefill" else {}
    if tokenizer is None and not Path(model).is_dir():
        raise ValueError(f"--tokenizer DIR is required for the preset {model!r} (it has no tokenizer files)")
    options = ServerOptions(served_model_name or str(model), max_queue)  # checks max_queue first
    llm = LLM(model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed, **engine_args)
    llm.engine.attach_tokenizer(llm.tokenizer)
    warm_up(llm)
    options.max_model_len = llm.config.max_position_embeddings
    if kv_events_endpoint is not None:
        from kvtier.cache.kv_events import KVEventPublisher

        publisher = KVEventPublisher(kv_events_endpoint, worker_id="")
        publisher.worker_id = options.kv_events = publisher.endpoint
        llm.engine.pool.publish_events_to(publisher)  # called on the engine thread (pool.poll)
    holder: dict = {}
    metrics = ServerMetrics(lambda: holder["worker"].snapshot)
    if role == "prefill":
        from kvtier.disagg.routes import worker_info
        from kvtier.disagg.worker import PrefillWorker

        check_compatible(decoders, worker_info(llm.engine, role))
        worker = PrefillWorker(llm.engine, llm.tokenizer, session_ttl_s, metrics, transfer_timeout_s=transfer_timeout_s)
    else:
        worker = EngineWorker(llm.engine, llm.tokenizer, session_ttl_s, metrics)
    worker.sessions.resumes.set_target(resume_ttft_s)  # counted in /metrics (kvtier_resume_slo_misses)
    holder["worker"] = worker
    app = build_app(worker, options, metrics)
    from kvtier.disagg.routes import add_role_routes
    from kvtier.disagg.worker import DisaggMetrics

    add_role_routes(app, worker, role, DisaggMetrics(metrics.registry, role), list(decode_workers))
    return app


def warm_up(llm) -> None:
    """One uncached prefill of up to a step's token budget and a few decodes, so that the first
    client does not pay one-time costs (allocator growth, lazy initialisation)."""
    from kvtier.serve.params import SamplingParams

    cfg, model = llm.engine.config, llm.config
    n = max(1, min(cfg.max_num_batched_tokens, model.max_position_embeddings - 8,
                   (cfg.pool.num_device_pages - 1) * cfg.pool.page_size - 4, 1024))
    llm.generate(prompt_token_ids=[list(range(300, 300 + n))],
                 sampling_params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free port the OS picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
          name: str = "kvtier serve") -> None:
    """Run ``app`` with uvicorn until interrupted. Prints ``NAME: listening on http://HOST:PORT``
    (the real port when ``port`` is 0) once the socket is open."""
    import uvicorn

    sock = listen(host, port)
    print(f"{name}: listening on http://{host}:{sock.getsockname()[1]}", flush=True, file=sys.stdout)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
