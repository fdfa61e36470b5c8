"""``kvtier simulate``: the bench replay at cluster scale, in virtual time (see :mod:`kvtier.sim`)."""

from __future__ import annotations

import argparse

from rich.console import Console

from kvtier.serve.config import SCHEDULE_POLICIES


def cmd_simulate(args: argparse.Namespace) -> int:
    from kvtier.sim.console import list_scenarios, simulate, simulate_sweep
    from kvtier.sim.run import SimOptions

    console = Console()
    if args.list:
        list_scenarios(console)
        return 0
    opts = SimOptions(
        scenario=args.scenario, trace=args.trace, sessions=args.sessions, concurrency=args.concurrency,
        max_turns=args.max_turns, time_scale=args.time_scale, max_think_s=args.max_think_s,
        ramp_s=args.ramp_s, duration_s=args.duration_s, warmup_s=args.warmup_s,
        warmup_turns=args.warmup_turns, seed=args.seed,
        truncate_input_tokens=args.truncate_input_tokens, warm_prefix_fraction=args.warm_prefix_fraction,
        kv_dtype_bytes=args.kv_dtype_bytes, configs=args.configs, node=args.node,
        matrix_efficiency=args.matrix_efficiency, kernel_csv=tuple(args.kernel_csv or ()),
        kernel_device=args.kernel_device, schedule_policy=args.schedule_policy,
        resume_ttft_s=args.resume_ttft_s, declared_waits=args.declared_waits)
    if args.sweep is not None:
        from kvtier.sim.sweep import parse_sweep

        if args.concurrency is not None or args.sessions is not None:
            raise ValueError("--sweep sets the sessions at once per point; give no --concurrency or --sessions")
        return simulate_sweep(opts, parse_sweep(args.sweep), args.ttft_target_s, console, json_path=args.json)
    return simulate(opts, console, json_path=args.json, plot=args.plot)


def add_parser(sub) -> None:
    """Register ``kvtier simulate`` on the CLI's subparsers."""
    m = sub.add_parser("simulate", help="the bench replay at cluster scale, in virtual time")
    m.add_argument("--scenario", default="kimi-mi355x-128", help="scenario name (--list shows them)")
    m.add_argument("--list", action="store_true", help="list the scenarios and exit")
    m.add_argument("--trace", metavar="PATH", help="kv-cache-tester or Mooncake trace file or folder (default: the "
                   "built-in workload generator)")
    m.add_argument("--configs", help="comma-separated subset of the scenario's configurations")
    m.add_argument("--sessions", type=int, help="sessions taken from the workload")
    m.add_argument("--concurrency", type=int, help="sessions active at once")
    m.add_argument("--max-turns", type=int, help="turns kept per session")
    m.add_argument("--time-scale", type=float, help="factor on think times")
    m.add_argument("--max-think-s", type=float, help="cap on a scaled think time (s)")
    m.add_argument("--ramp-s", type=float, help="seconds over which the first --concurrency sessions start")
    m.add_argument("--warmup-s", type=float, help="turns due before this (virtual s) are not reported")
    m.add_argument("--warmup-turns", type=int, help="each session's first N turns run before the window and are "
                   "not reported; the window (--warmup-s, --duration-s) starts when all active sessions ran them")
    m.add_argument("--duration-s", type=float, help="no turn is submitted from this virtual time on")
    m.add_argument("--truncate-input-tokens", type=int, help="each session stops before its first longer "
                   "prompt (kv-cache-tester's --max-context; 0 = off)")
    m.add_argument("--warm-prefix-fraction", type=float, help="share of the largest tool + system prompt every "
                   "trace session starts with (kv-cache-tester's --warm-prefix-pct)")
    m.add_argument("--kv-dtype-bytes", type=float, help="bytes per cached KV value: 2 = bf16, 1 = FP8")
    m.add_argument("--node", help="hardware of each worker: mi355x or h200")
    m.add_argument("--matrix-efficiency", type=float, help="fraction of the matrix peak kernels reach")
    m.add_argument("--kernel-csv", nargs="*", metavar="CSV", help="perf/bench_mla.py or bench_moe.py CSVs measured "
                   "on a GPU: their best rates replace peak x efficiency")
    m.add_argument("--kernel-device", help="device name in the CSVs' device column (default: the node's GPU)")
    m.add_argument("--seed", type=int, help="seed of the built-in workload")
    m.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES,
                   help="admission order of the engines (default: the scenario's, fcfs, as calibrated)")
    m.add_argument("--resume-ttft-s", type=float, metavar="S", help="resume target: every worker's pool plans tool "
                   "waits for it (as kvtier serve --resume-ttft-s); resumes and misses by why are shown and written")
    m.add_argument("--declared-waits", action="store_true", help="tool-aware configurations hear each tool wait's "
                   "recorded length (a client sending expected_tool_wait_s) instead of the learned median")
    m.add_argument("--sweep", nargs="?", const="8,16,32,64,128", metavar="SESSIONS",
                   help="run the scenario at each of these concurrencies (comma-separated sessions at once; "
                        "default 8,16,32,64,128) and report the sessions each configuration holds under "
                        "--ttft-target-s, its throughput there, and tiered / device-only (see kvtier.sim.sweep)")
    m.add_argument("--ttft-target-s", type=float, default=30.0, metavar="S",
                   help="with --sweep: the p99 TTFT target in seconds (default 30)")
    m.add_argument("--plot", metavar="PATH", default="kvtier-simulate-ttft.png", help="TTFT plot PNG ('' = none)")
    m.add_argument("--json", metavar="PATH", help="write the results with provenance here (kvtier bench's shape)")
    m.set_defaults(func=cmd_simulate)
