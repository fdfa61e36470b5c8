"""``kvtier bench``: replay coding-agent sessions under several cache configurations (see
:mod:`kvtier.bench`; the console output is :mod:`kvtier.bench.console`)."""

from __future__ import annotations

import argparse
import math

from rich.console import Console

from kvtier.cli.serve import add_state_options, state_options
from kvtier.model import PRESETS
from kvtier.serve.config import ADMISSION_WATERMARK, PREEMPTION_MODE, PREEMPTION_MODES, SCHEDULE_POLICIES


def cmd_bench(args: argparse.Namespace) -> int:
    from kvtier.bench import console as bench_console
    from kvtier.bench import report
    from kvtier.bench.run import BenchOptions
    from kvtier.bench.sweep import parse_loads

    if args.workload == "sdk-agents":
        return cmd_bench_agents(args)
    if args.json_records and not args.json:
        raise ValueError("--json-records adds the per-request records to --json PATH; give --json too")
    checkpoints = state_options(args)  # the page size comes from the workload: checked once it is loaded
    loads = parse_loads(args.load_sweep) if args.load_sweep is not None else None
    if args.ttft_slo is not None and (loads is None or not 0 < args.ttft_slo < math.inf):
        raise ValueError(f"--ttft-slo needs --load-sweep and a finite number of seconds > 0, got {args.ttft_slo}")
    if args.repeat is not None and (args.endpoint or loads or args.plot):
        raise ValueError("--repeat runs the in-process bench N times; it takes no --endpoint, --load-sweep or --plot")
    if args.plot is None:
        args.plot = "kvtier-bench-load.png" if loads else "kvtier-bench-ttft.png"
    opts = BenchOptions(
        model=args.model, trace=args.trace, conversations=args.conversations, tokenizer=args.tokenizer,
        page_size=args.page_size, max_output_tokens=args.max_output_tokens, sessions=args.sessions, concurrency=args.concurrency,
        configs=args.configs, token_scale=args.token_scale, time_scale=args.time_scale,
        max_think_s=args.max_think_s, max_turns=args.max_turns or None, ramp_s=args.ramp_s, device_fraction=args.device_fraction,
        num_device_pages=args.num_device_pages, host_fraction=args.host_fraction,
        host_cache_bytes=args.host_cache_bytes, disk_cache_dir=args.disk_cache_dir,
        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, threads=args.threads,
        schedule_policy=args.schedule_policy, preemption_mode=args.preemption_mode,
        admission_watermark=args.admission_watermark, device=args.device, checkpoints=checkpoints)
    for path in (args.json, args.plot):  # fail now, not after a long run
        if path:
            report.check_writable(path)
    console = Console()
    if args.repeat is not None:
        from kvtier.bench.repeat import bench_repeat
        return bench_repeat(opts, args.repeat, console, json_path=args.json, records=args.json_records)
    out = dict(json_path=args.json, plot=args.plot, json_records=args.json_records)
    if args.endpoint:
        if loads:
            raise ValueError("--load-sweep replays the workload in-process; it cannot be combined with --endpoint")
        return bench_console.bench_endpoint(opts, args.endpoint, console, **out)
    if loads:
        return bench_console.bench_sweep(opts, loads, console, ttft_slo=args.ttft_slo, **out)
    return bench_console.bench_once(opts, console, **out)


def cmd_bench_agents(args: argparse.Namespace) -> int:
    """``--workload sdk-agents``: agent sessions through the server's HTTP APIs with the official
    SDKs (:mod:`kvtier.bench.agent_sessions`), reuse per turn (:mod:`kvtier.bench.agent_reuse`)."""
    from kvtier.bench import report
    from kvtier.bench.agent_sessions import AgentWorkload, bench_agents

    if args.trace or args.conversations or args.load_sweep or args.repeat is not None:
        raise ValueError("--workload sdk-agents makes its own sessions; it takes no --trace, --conversations, "
                         "--load-sweep or --repeat")
    apis = tuple(a.strip() for a in args.agent_apis.split(","))
    workload = AgentWorkload(sessions=args.agent_sessions, turns=args.agent_turns, apis=apis,
                             tool_share=args.agent_tool_share, max_tokens=args.max_output_tokens or 64,
                             concurrency=args.concurrency, seed=args.seed)
    if args.json:
        report.check_writable(args.json)
    server_args = ["--seed", str(args.seed), "--device", args.device, "--threads", str(args.threads)]
    if args.num_device_pages is not None:
        server_args += ["--num-device-pages", str(args.num_device_pages)]
    server_args += state_options(args).args()
    bench_agents(workload, model=args.model, tokenizer=args.tokenizer, page_size=args.page_size or 16,
                 endpoint=args.endpoint, server_args=tuple(server_args), console=Console(), json_path=args.json)
    return 0


def add_parser(sub) -> None:
    """Register ``kvtier bench`` on the CLI's subparsers."""
    b = sub.add_parser("bench", help="replay coding-agent sessions under several cache configurations")
    b.add_argument("--trace", metavar="PATH", help="kv-cache-tester .json/.json.gz or Mooncake .jsonl file, or a "
                   "folder of them (default: the built-in workload generator)")
    b.add_argument("--conversations", metavar="PATH",
                   help="JSONL of text chat sessions (OpenAI message lists; see kvtier.bench.conversations) "
                        "instead of a trace; needs --tokenizer with a preset model")
    b.add_argument("--workload", default="replay", choices=("replay", "sdk-agents"),
                   help="replay: the sessions of --trace, --conversations or the built-in generator, in-process "
                        "or against --endpoint; sdk-agents: agent sessions through a server's chat, Messages and "
                        "Responses APIs with the official SDKs, reporting cached / reachable tokens per turn "
                        "(against --endpoint, or a kvtier serve --model started for the run)")
    b.add_argument("--agent-sessions", type=int, default=4, help="sdk-agents: sessions per API")
    b.add_argument("--agent-turns", type=int, default=6, help="sdk-agents: requests per session")
    b.add_argument("--agent-apis", default="chat,messages,responses",
                   help="sdk-agents: comma-separated APIs out of chat, messages, responses")
    b.add_argument("--agent-tool-share", type=float, default=0.5,
                   help="sdk-agents: share of turns with tool calls forced (tool_choice required / any)")
    b.add_argument("--tokenizer", metavar="DIR", help="Kimi tokenizer files for --conversations and sdk-agents "
                   "(default: the model dir)")
    b.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page for --conversations and sdk-agents (default 16)")
    b.add_argument("--max-output-tokens", type=int, default=None,
                   help="cap on each response length for --conversations; sdk-agents: max_tokens per turn (default 64)")
    b.add_argument("--sessions", type=int, default=16, help="sessions replayed")
    b.add_argument("--concurrency", type=int, default=8, help="sessions active at once")
    b.add_argument("--configs", default="device-only,tiered,ideal",
                   help="comma-separated: device-only, tiered, tiered-write-through, tiered-tool-aware, no-cache, "
                        "ideal (the bound: device pages for the whole working set; each other configuration's "
                        "distance to it is reported)")
    b.add_argument("--model", default="tiny", help=f"weights directory or preset {sorted(PRESETS)}; with "
                   "--endpoint, the served model's name")
    b.add_argument("--endpoint", metavar="URL", help="replay against this OpenAI-compatible server over HTTP "
                   "(e.g. http://127.0.0.1:8000, a running kvtier serve, vLLM or SGLang) instead of in-process; "
                   "--configs and the tier sizes do not apply")
    b.add_argument("--token-scale", type=float, default=1 / 64,
                   help="factor on every token length; block size x scale must be an integer")
    b.add_argument("--time-scale", type=float, default=0.01, help="factor on think times")
    b.add_argument("--max-think-s", type=float, default=1.0, help="cap on a scaled think time (s)")
    b.add_argument("--max-turns", type=int, default=8, help="turns kept per session (0 = all)")
    b.add_argument("--ramp-s", type=float, default=10.0,
                   help="seconds over which the first --concurrency sessions start (0 = all at once)")
    b.add_argument("--device-fraction", type=float, default=0.25,
                   help="device KV pages as a fraction of the sessions' working set")
    b.add_argument("--num-device-pages", type=int, default=None, help="device KV pages (overrides the fraction)")
    b.add_argument("--host-fraction", type=float, default=1.0,
                   help="host tier as a fraction of the working set's KV bytes")
    b.add_argument("--host-cache-bytes", type=int, default=None, help="host tier bytes (overrides the fraction)")
    b.add_argument("--disk-cache-dir", default=None, help="where the per-run disk tiers go (default: temp dir)")
    add_state_options(b)
    b.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget per step")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default="cpu", help="cpu or cuda (also ROCm): where the model and its KV pages live")
    b.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see kvtier.bench.run)")
    b.add_argument("--plot", metavar="PATH", default=None,
                   help="PNG: the TTFT distribution (default kvtier-bench-ttft.png) or, with --load-sweep, p99 TTFT "
                        "against throughput (default kvtier-bench-load.png); '' = none")
    b.add_argument("--json", metavar="PATH", help="write the results with provenance here")
    b.add_argument("--repeat", type=int, default=None, metavar="N",
                   help="run N times, workload seed --seed + i (the built-in workload drawn, or --sessions sampled "
                        "from --trace); prints each figure's median [min-max] (see kvtier.bench.repeat)")
    b.add_argument("--json-records", action="store_true",
                   help="include every request's record (times, TTFT parts, tier mix) in --json")
    b.add_argument("--schedule-policy", default="cache-aware", choices=SCHEDULE_POLICIES,
                   help="admission order: cached and cheap requests first, with aging (default), or arrival order")
    b.add_argument("--preemption-mode", default=PREEMPTION_MODE, choices=PREEMPTION_MODES,
                   help="swap: a preempted sequence's blocks go down a tier and load back, and a decode "
                        "is a victim only when its resume costs less than its end and it has more than 4 tokens "
                        "left, least harmed in its time per output token first (default); recompute: victims by "
                        "rank alone")
    b.add_argument("--admission-watermark", type=float, default=ADMISSION_WATERMARK, metavar="SHARE",
                   help=f"share of device pages a new request leaves free for the running sequences' next pages "
                        f"(default {ADMISSION_WATERMARK}; 0 = none)")
    b.add_argument("--load-sweep", metavar="LOADS", default=None,
                   help="replay the sessions at each of these offered loads (comma-separated think-time divisors, "
                        "e.g. 0.5,1,2) and plot p99 TTFT against throughput per configuration")
    b.add_argument("--ttft-slo", type=float, default=None, metavar="SECONDS",
                   help="with --load-sweep: report goodput, the highest load whose p99 TTFT stays under this")
    b.set_defaults(func=cmd_bench)
