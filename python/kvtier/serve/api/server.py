"""Start ``kvtier serve``: the model and engine, the engine thread, uvicorn on one socket."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from kvtier.serve.api.app import ServerOptions, build_app
from kvtier.serve.api.metrics import ServerMetrics
from kvtier.serve.api.protocol import DEFAULT_MAX_REQUEST_BYTES
from kvtier.serve.api.worker import EngineWorker


def make_app(model: str, *, tokenizer: str | None, served_model_name: str | None = None, max_queue: int = 256,
             session_ttl_s: float = 600.0, dtype: str = "auto", device: str = "cpu", seed: int = 0,
             kv_events_endpoint: str | None = None, health_stall_s: float = 30.0, grammar_limits=None,
             resume_ttft_s: float | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
             session_store_tokens: int | None = None, worker_factory=EngineWorker, on_engine=None, extend_app=None, **engine_args):
    """The application over a fresh engine for ``model`` (a weights directory or a preset).

    ``kv_events_endpoint`` (e.g. ``tcp://127.0.0.1:0``): publish the pool's KV events there
    (:mod:`kvtier.cache.kv_events`; the bound endpoint is the events' worker id and is reported
    by ``/health``).

    Seams for roles built above this room (:func:`kvtier.cluster.disagg.app.make_worker_app`):
    ``worker_factory(engine, tokenizer, session_ttl_s, metrics)`` makes the engine thread's
    worker (default :class:`EngineWorker`); ``on_engine(engine)`` is called once the engine is
    built, before the worker (a check that may raise); ``extend_app(app, worker, metrics)`` adds
    routes to the finished application.

    ``health_stall_s``: ``/health`` answers 503 once the engine thread has not completed a step
    for this long while requests wait. ``grammar_limits``: a :class:`kvtier.toolcall.GrammarLimits`
    (or a dict of its fields) bounding each request's tool grammar (None: the defaults).

    ``session_store_tokens``: the ids the session store's encoders may hold before the least
    recently used idle sessions are evicted (None: ``DEFAULT_SESSION_STORE_TOKENS``).

    ``max_request_bytes``: a larger request body is a 413 before it is decoded (default 32 MiB,
    room for a 1M-token prompt).

    ``resume_ttft_s``: the TTFT target of a session's turn after a tool wait; the pool plans its
    tool waits for it and the scheduler keeps the steps around a first token or an expected
    return short (``Engine.set_resume_target``), and resumes and misses (by why) are counted in
    ``/metrics`` (:mod:`kvtier.serve.api.resume`).

    Raises:
        ValueError: a model that is neither a weights directory nor a preset, no tokenizer (a
            preset needs ``tokenizer``), a bad engine argument or limit,
            a KV events endpoint that cannot be bound, or what ``on_engine`` raises.
    """
    from kvtier.serve.builder import build_engine, check_model
    from kvtier.tokenize import load_tokenizer

    check_model(model)  # first: a mistyped preset or a missing path is not a missing tokenizer
    if tokenizer is None and not Path(model).is_dir():
        raise ValueError(f"--tokenizer DIR is required for the preset {model!r} (it has no tokenizer files)")
    from kvtier.tokenize import has_tokenizer

    if tokenizer is None and not has_tokenizer(model):
        raise ValueError(f"{model}: the weights directory has no Kimi tokenizer (tiktoken.model); pass "
                         "--tokenizer DIR, or write one into it with kvtier create-checkpoint --tokenizer DIR")
    from kvtier.toolcall import GrammarLimits

    options = ServerOptions(served_model_name or str(model), max_queue,  # checks the limits first
                            health_stall_s=health_stall_s, max_request_bytes=max_request_bytes)
    if isinstance(grammar_limits, dict):
        grammar_limits = GrammarLimits.from_dict(grammar_limits)
    if grammar_limits is not None and not isinstance(grammar_limits, GrammarLimits):
        raise ValueError(f"grammar_limits must be a GrammarLimits or a dict, got {type(grammar_limits).__name__}")
    built = build_engine(model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed, **engine_args)
    from kvtier.tokenize.formats import model_chat_format

    # the model's config.json says which chat format it speaks (K3: XTML over K2's BPE vocabulary)
    engine, tok = built.engine, load_tokenizer(built.tokenizer_dir, model_chat_format(built.config.model_type))
    engine.attach_tokenizer(tok)
    engine.grammar.limits = grammar_limits
    engine.grammar.compiler()  # built now (about a second), not by the first request with tools
    probe_prefill_tokens = warm_up(engine)
    # the longest sequence a request can have: the context, or what the device pages hold
    pool = engine.config.pool
    options.max_model_len = min(built.config.max_position_embeddings, pool.num_device_pages * pool.page_size)
    if kv_events_endpoint is not None:
        from kvtier.cache.kv_events import KVEventPublisher

        publisher = KVEventPublisher(kv_events_endpoint, worker_id="")
        publisher.worker_id = options.kv_events = publisher.endpoint
        engine.pool.publish_events_to(publisher)  # called on the engine thread (pool.poll)
    holder: dict = {}
    metrics = ServerMetrics(lambda: holder["worker"].snapshot, probe_prefill_tokens)
    if on_engine is not None:
        on_engine(engine)
    worker = holder["worker"] = worker_factory(engine, tok, session_ttl_s, metrics)
    if session_store_tokens is not None:
        worker.sessions.set_max_tokens(session_store_tokens)
    worker.sessions.resumes.set_target(resume_ttft_s)  # counted in /metrics (kvtier_resume_slo_misses)
    engine.set_resume_target(resume_ttft_s)  # the pool keeps or prefetches for it, the steps stay short
    app = build_app(worker, options, metrics)
    if extend_app is not None:
        extend_app(app, worker, metrics)
    return app


def warm_up(engine) -> int:
    """One uncached prefill of up to a step's token budget and a few decodes, so that the first
    client does not pay one-time costs (allocator growth, lazy initialisation). Returns the
    tokens it prefilled (``/metrics`` leaves them out of ``kvtier_prefill_tokens``)."""
    from kvtier.serve.params import SamplingParams

    cfg, model = engine.config, engine.runner.model.config
    n = max(1, min(cfg.max_num_batched_tokens, model.max_position_embeddings - 8,
                   (cfg.pool.num_device_pages - 1) * cfg.pool.page_size - 4, 1024))
    rid = engine.add_request(list(range(300, 300 + n)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                             0)
    before = engine.stats().prefill_tokens
    while not any(out.request_id == rid for out in engine.step()):
        pass
    return engine.stats().prefill_tokens - before


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
