"""``kvtier serve MODEL``: the OpenAI-compatible server (see :mod:`kvtier.serve.api`; a P/D role's
worker is :func:`kvtier.cluster.disagg.app.make_worker_app`)."""

from __future__ import annotations

import argparse

from kvtier.model import PRESETS


def cmd_serve(args: argparse.Namespace) -> int:
    # The options are checked before the server's modules load (a bad value is refused in the
    # time ``import kvtier`` takes: torch, whose ops it registers).
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.session_store_tokens is not None and args.session_store_tokens < 1:
        raise ValueError(f"--session-store-tokens must be >= 1, got {args.session_store_tokens}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not 0 < args.session_ttl_s < float("inf"):
        raise ValueError(f"--session-ttl-s must be a finite number > 0, got {args.session_ttl_s}")
    if args.resume_ttft_s is not None and not 0 < args.resume_ttft_s < float("inf"):
        raise ValueError(f"--resume-ttft-s must be a finite number > 0, got {args.resume_ttft_s}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    checkpoints = state_options(args, f"--page-size {args.page_size}")
    from kvtier.cluster.disagg import check_role

    check_role(args.role)
    decode_workers = [u.strip().rstrip("/") for u in (args.decode_workers or "").split(",") if u.strip()]
    if any(not u.startswith(("http://", "https://")) for u in decode_workers):
        raise ValueError(f"--decode-workers must be a comma-separated list of http:// URLs, got {args.decode_workers!r}")
    if decode_workers and args.role != "prefill":
        raise ValueError(f"--decode-workers is for --role prefill, got --role {args.role}")
    if not 0 < args.transfer_timeout_s < float("inf"):
        raise ValueError(f"--transfer-timeout-s must be a finite number > 0, got {args.transfer_timeout_s}")
    grammar_limits = parse_grammar_limits(args.grammar_limits)
    import torch

    from kvtier.cluster.disagg.app import make_worker_app
    from kvtier.serve.api.server import serve

    torch.set_num_threads(args.threads)
    engine_args = dict(page_size=args.page_size, num_device_pages=args.num_device_pages,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                       enable_prefix_caching=not args.no_prefix_caching, host_cache_bytes=args.host_cache_bytes,
                       disk_cache_dir=args.disk_cache_dir, disk_cache_bytes=args.disk_cache_bytes,
                       cache_policy=args.cache_policy, write_policy=args.cache_write_policy,
                       salt=args.cache_salt.encode(), remote_cache_url=args.remote_cache_url,
                       remote_timeout_s=args.remote_timeout_s, **checkpoints.pool_fields())
    app = make_worker_app(args.model, tokenizer=args.tokenizer, served_model_name=args.served_model_name,
                          max_queue=args.max_queue, session_ttl_s=args.session_ttl_s, dtype=args.dtype, device=args.device,
                          seed=args.seed, kv_events_endpoint=args.kv_events_endpoint, role=args.role,
                          decode_workers=decode_workers, transfer_timeout_s=args.transfer_timeout_s,
                          health_stall_s=args.health_stall_s, grammar_limits=grammar_limits,
                          resume_ttft_s=args.resume_ttft_s, max_request_bytes=args.max_request_bytes,
                          session_store_tokens=args.session_store_tokens, **engine_args)
    serve(app, args.host, args.port, args.log_level)
    return 0


def add_state_options(p: argparse.ArgumentParser) -> None:
    """The recurrent-state checkpoint options of a hybrid KDA + MLA model (``kvtier serve`` and
    ``kvtier bench``), read back as one record by :func:`state_options`."""
    p.add_argument("--state-checkpoint-tokens", type=int, default=None, metavar="N",
                   help="hybrid models: tokens between the grid checkpoints of the recurrent state a prefill saves "
                        "beside those at prompt and turn ends; a positive multiple of the page size (default: the "
                        "tokens whose MLA KV is as large as one checkpoint, rounded up to a page)")
    for tier in ("device", "host", "disk"):
        p.add_argument(f"--state-{tier}-bytes", type=int, default=None, metavar="BYTES",
                       help=f"hybrid models: recurrent-state checkpoint budget of the {tier} tier, beside its KV "
                            f"budget (default: the {tier} tier's KV budget; 0 = no checkpoints there)")


def state_options(args: argparse.Namespace, page_size_name: str | None = None):
    """The options :func:`add_state_options` adds, as one checked
    :class:`kvtier.cache.checkpoints.options.CheckpointOptions`, before any model loads (the grid
    against ``args.page_size`` where ``page_size_name`` names it). Budgets smaller than one
    checkpoint depend on the model: the pool refuses them at start, naming the option.

    Raises:
        ValueError: an option out of range, naming it and what was expected.
    """
    from kvtier.cache.checkpoints.options import CheckpointOptions

    return CheckpointOptions.from_args(args, args.page_size if page_size_name else None, page_size_name)


def parse_grammar_limits(text: str | None):
    """``--grammar-limits`` JSON as a :class:`kvtier.toolcall.GrammarLimits` (None: the defaults).

    Raises:
        ValueError: not a JSON object of GrammarLimits fields with valid values (named).
    """
    if text is None:
        return None
    import json

    from kvtier.toolcall import GrammarLimits

    try:
        values = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--grammar-limits must be a JSON object, got {text!r:.80}: {e}") from None
    try:
        return GrammarLimits.from_dict(values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--grammar-limits: {e}") from None


def add_parser(sub) -> None:
    """Register ``kvtier serve`` on the CLI's subparsers."""
    from kvtier.cache.config import CACHE_POLICIES, WRITE_POLICIES
    from kvtier.cluster.disagg.routes import ROLES
    from kvtier.serve.builder import COMPUTE_DTYPES

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, tools, sessions, metrics)")
    s.add_argument("model", help=f"weights directory or preset {sorted(PRESETS)}")
    s.add_argument("--tokenizer", metavar="DIR", help="Kimi tokenizer files (default: the model directory)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port (0 = a free port, printed at start)")
    s.add_argument("--served-model-name", help="the model name clients send (default: MODEL as given)")
    s.add_argument("--max-queue", type=int, default=256, help="requests in flight at once; more get 503")
    s.add_argument("--max-request-bytes", type=int, default=32 << 20,
                   help="larger request bodies get 413 before they are decoded (default 32 MiB: a 1M-token prompt)")
    s.add_argument("--session-ttl-s", type=float, default=600.0, help="idle seconds before a session is dropped")
    s.add_argument("--session-store-tokens", type=int, default=None,
                   help="ids all sessions' encoders may hold (with the ids each turn sampled, kept for the next "
                        "turn); past it the least recently used idle sessions are evicted (kvtier_sessions_evicted; "
                        "default 2**25)")
    s.add_argument("--resume-ttft-s", type=float, default=None, metavar="S",
                   help="TTFT target of a session's turn after a tool wait; misses are counted by why in /metrics")
    s.add_argument("--dtype", default="auto", choices=COMPUTE_DTYPES,
                   help="compute dtype of weights and KV: auto = float32 on a CPU, bfloat16 on a GPU "
                        "(default: %(default)s)")
    s.add_argument("--device", default="cpu", help="torch device of weights and KV cache")
    s.add_argument("--seed", type=int, default=0, help="preset weights and the engine's sampler")
    s.add_argument("--page-size", type=int, default=16, help="tokens per KV page (power of two)")
    s.add_argument("--num-device-pages", type=int, default=1024, help="device KV pages per layer")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    s.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    s.add_argument("--no-prefix-caching", action="store_true", help="never reuse cached blocks")
    s.add_argument("--host-cache-bytes", type=int, default=0, help="host-memory KV tier budget (0 = none)")
    s.add_argument("--disk-cache-dir", default=None, help="disk KV tier directory (default: none)")
    s.add_argument("--disk-cache-bytes", type=int, default=0, help="disk KV tier budget")
    s.add_argument("--cache-policy", default="lru", choices=CACHE_POLICIES,
                   help="eviction policy: lru, or tool-aware (a session waiting on a tool keeps its device blocks "
                        "for a while, then they are demoted and prefetched back before it returns) "
                        "(default: %(default)s)")
    s.add_argument("--cache-write-policy", default="write-through", choices=WRITE_POLICIES,
                   help="write-through: each full block is copied down to the lower tiers at once; write-back: "
                        "only when evicted (default: %(default)s)")
    s.add_argument("--cache-salt", default="", help="tenant salt of every cached block")
    s.add_argument("--remote-cache-url", default=None,
                   help="shared remote KV tier: redis://HOST:PORT or mooncake://HOST:PORT (needs --host-cache-bytes)")
    add_state_options(s)
    s.add_argument("--remote-timeout-s", type=float, default=1.0, help="seconds before a remote call is a miss")
    s.add_argument("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="publish KV events (blocks stored/removed per tier) on this ZeroMQ PUB endpoint; port 0 = free")
    s.add_argument("--role", default="both", choices=ROLES,
                   help="prefill, decode or both (colocated): a prefill worker sends each turn's KV blocks to a "
                        "decode worker (see kvtier router --prefill-workers/--decode-workers) (default: %(default)s)")
    s.add_argument("--decode-workers", default=None, metavar="URL,...",
                   help="--role prefill: the decode workers it may send blocks to (at least one must answer at start)")
    s.add_argument("--transfer-timeout-s", type=float, default=5.0,
                   help="--role prefill: seconds a decode worker may take per call before its turn's blocks are "
                   "given up (it recomputes them)")
    s.add_argument("--health-stall-s", type=float, default=30.0,
                   help="/health answers 503 once the engine thread has not completed a step for this many "
                        "seconds while requests wait")
    s.add_argument("--grammar-limits", default=None, metavar="JSON",
                   help="tool-grammar limits as a JSON object of kvtier.toolcall.GrammarLimits fields (llguidance's "
                        "max_items_in_row, step_lexer_fuel, max_grammar_size, ...; compile_timeout_s, "
                        "mask_deadline_s, closing_fuel)")
    s.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    s.add_argument("--log-level", default="warning", help="uvicorn log level")
    s.set_defaults(func=cmd_serve)
