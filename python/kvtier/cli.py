"""The kvtier command.

Subcommands:
  bench               replay coding-agent sessions (a trace or the built-in workload) under
                      several cache configurations; prints TTFT/TPOT/throughput/hits per tier,
                      writes a TTFT plot and, with --json, the numbers with provenance
  simulate            the same replay at cluster scale in virtual time: the real scheduler and
                      tiered pool with the model's step time and every copy modelled (8x MI355X
                      running Kimi K2 by default); prints the bench table, writes a plot and JSON
  generate            offline generation over synthetic prompts that share a prefix; prints
                      TTFT / end-to-end latency / throughput and prefix-cache hits
  create-checkpoint   write a deterministic random HF-layout checkpoint (bf16, fp32 or fp8)
  serve               OpenAI-compatible HTTP server: chat (tools streamed as each call completes),
                      completions, sessions kept warm across tool waits, /metrics
  kernels             --profile DIR: every kernel op once under torch.profiler, a Chrome trace
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from kvtier import LLM, SamplingParams
from kvtier import kernels_cli, router_cli, serve_cli
from kvtier.cluster import StartupError
from kvtier.model import PRESETS, create_random_checkpoint
from kvtier.ops import resolve_backend
from kvtier.provenance import provenance
from kvtier.serve.config import SCHEDULE_POLICIES


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _synthetic_prompts(n: int, length: int, shared: int, vocab: int, seed: int) -> list[list[int]]:
    if not 0 <= shared <= length:
        raise SystemExit(f"--shared-prefix-len must be in [0, --prompt-len={length}], got {shared}")
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab, (length - shared,), generator=g).tolist() for _ in range(n)]


def cmd_generate(args: argparse.Namespace) -> int:
    console = Console()
    if args.num_prompts < 1 or args.prompt_len < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts, --prompt-len and --max-tokens must be >= 1")
    t0 = time.perf_counter()
    llm = LLM(args.model, seed=args.seed, page_size=args.page_size, num_device_pages=args.num_device_pages,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              host_cache_bytes=args.host_cache_bytes)
    load_s = time.perf_counter() - t0
    prompts = _synthetic_prompts(args.num_prompts, args.prompt_len, args.shared_prefix_len,
                                 llm.config.vocab_size, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
    # The first prompt warms the prefix cache alone, as a returning agent turn would find it.
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    outs += llm.generate(prompt_token_ids=prompts[1:], sampling_params=params) if len(prompts) > 1 else []
    wall = time.perf_counter() - t0
    ttft = [o.metrics.ttft_s * 1e3 for o in outs]
    e2e = [o.metrics.e2e_s * 1e3 for o in outs]
    generated = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(o.num_cached_tokens for o in outs)
    by_tier = {t: sum(o.cached_tokens_by_tier.get(t, 0) for o in outs) for t in ("device", "host", "disk")}
    result = {
        "provenance": provenance(model=args.model, backend=resolve_backend(
            "mla_decode", "auto", llm.engine.runner.device, llm.engine.runner.model.dtype),
            dtype=str(llm.engine.runner.model.dtype), args=vars(args) | {"func": None}),
        "requests": len(outs), "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached,
        "hit_tokens": by_tier, "copy_errors": llm.engine.pool.stats.copy_errors,
        "generated_tokens": generated, "wall_s": wall, "load_s": load_s,
        "ttft_ms": {"p50": statistics.median(ttft), "p99": _percentile(ttft, 99)},
        "e2e_ms": {"p50": statistics.median(e2e), "p99": _percentile(e2e, 99)},
        "throughput_tok_s": (prompt_tokens - cached + generated) / wall,
        "output_tok_s": generated / wall,
    }
    table = Table(title=f"kvtier generate — {args.model}, {len(outs)} requests")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("prompt tokens (served from cache)", f"{prompt_tokens} ({cached}, {cached / prompt_tokens:.0%})"),
        ("  of which device / host / disk", " / ".join(str(by_tier[t]) for t in ("device", "host", "disk"))),
        ("generated tokens", str(generated)),
        ("TTFT p50 / p99 (ms)", f"{result['ttft_ms']['p50']:.1f} / {result['ttft_ms']['p99']:.1f}"),
        ("end-to-end p50 / p99 (ms)", f"{result['e2e_ms']['p50']:.1f} / {result['e2e_ms']['p99']:.1f}"),
        ("throughput, computed tokens/s", f"{result['throughput_tok_s']:.1f}"),
        ("output tokens/s", f"{result['output_tok_s']:.1f}"),
        ("wall / model load (s)", f"{wall:.2f} / {load_s:.2f}"),
        ("backend", result["provenance"]["backend"]),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        console.print(f"wrote {args.json}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kvtier.bench import report
    from kvtier.bench.run import BenchOptions
    from kvtier.bench.sweep import parse_loads

    if args.json_records and not args.json:
        raise ValueError("--json-records adds the per-request records to --json PATH; give --json too")
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
        schedule_policy=args.schedule_policy, device=args.device)
    for path in (args.json, args.plot):  # fail now, not after a long run
        if path:
            report.check_writable(path)
    console = Console()
    if args.repeat is not None:
        from kvtier.bench.repeat import bench_repeat
        return bench_repeat(opts, args.repeat, console, json_path=args.json, records=args.json_records)
    if args.endpoint:
        if loads:
            raise ValueError("--load-sweep replays the workload in-process; it cannot be combined with --endpoint")
        return _bench_endpoint(args, opts, console)
    if loads:
        return _bench_sweep(args, opts, loads, console)
    return _bench_once(args, opts, console)


@contextlib.contextmanager
def _progress(console: Console):
    """``(on_start, on_finish)`` callbacks that show one progress bar per replay."""
    from kvtier.bench import report

    with contextlib.ExitStack() as stack:
        bars: list = []

        def on_start(name: str, total: int) -> None:
            stack.close()
            bars.append(stack.enter_context(report.replay_progress(total, name, console=console)))

        yield on_start, lambda r: bars[-1].advance()


def _describe(console: Console, opts, workload, sizing) -> None:
    if sizing.device_floor_applied:
        console.print(f"[yellow]note:[/] the device tier was raised to {sizing.device_pages} pages so that the largest "
                      f"turn fits; it is {sizing.device_pages / sizing.working_set_pages:.2f} of the working set, "
                      f"not --device-fraction {opts.device_fraction}")
    console.print(f"workload {workload.name}: {len(workload.sessions)} sessions, {workload.num_requests()} requests, "
                  f"{workload.block_size}-token blocks; device tier {sizing.device_pages} pages = "
                  f"{sizing.device_pages / sizing.working_set_pages:.2f} of the working set "
                  f"({sizing.working_set_pages} pages); host tier {sizing.host_cache_bytes / 2**20:.1f} MiB; "
                  f"{opts.schedule_policy} admission")


def _bench_once(args: argparse.Namespace, opts, console: Console) -> int:
    from kvtier.bench import report
    from kvtier.bench.run import run_all
    from kvtier.bench.tail import tail_json, tail_lines

    with _progress(console) as (on_start, on_finish):
        workload, sizing, runs, prov = run_all(opts, on_start=on_start, on_finish=on_finish)
    _describe(console, opts, workload, sizing)
    report.render_table(runs, console=console)
    tails = tail_json(runs)
    for line in tail_lines(tails):
        console.print(line, markup=False, highlight=False)
    if args.plot:
        console.print(f"wrote {report.plot_ttft(runs, args.plot)}")
    if args.json:
        report.write_json(args.json, report.bench_json(runs, prov, records=args.json_records) | {"tail": tails})
        console.print(f"wrote {args.json}")
    return _report_errors(runs, console)


def _bench_sweep(args: argparse.Namespace, opts, loads: tuple[float, ...], console: Console) -> int:
    from kvtier.bench import report
    from kvtier.bench.run import run_sweep
    from kvtier.bench.sweep import plot_sweep, sweep_json, sweep_lines

    with _progress(console) as (on_start, on_finish):
        workload, sizing, points, prov = run_sweep(opts, loads, on_start=on_start, on_finish=on_finish)
    _describe(console, opts, workload, sizing)
    data = sweep_json(points, args.ttft_slo)
    for line in sweep_lines(data):
        console.print(line, markup=False, highlight=False)
    if args.plot:
        console.print(f"wrote {plot_sweep(data, args.plot)}")
    if args.json:
        doc = {"provenance": prov, "load_sweep": data}
        if args.json_records:
            doc["records"] = {f"{run.name}@x{load:g}": [report.record_json(r) for r in run.records]
                              for load, runs in points for run in runs}
        report.write_json(args.json, doc)
        console.print(f"wrote {args.json}")
    return _report_errors([run for _, runs in points for run in runs], console)


def _report_errors(runs, console: Console) -> int:
    """Print each run's failed requests; 1 when every request of some run failed, else 0."""
    failed = False
    for run in runs:
        errors = sorted({r.error for r in run.records if r.error})
        if errors:
            console.print(f"[red]{run.name}[/]: {sum(1 for r in run.records if r.error)} request(s) failed, e.g. "
                          + "; ".join(errors[:3]), markup=True, highlight=False)
        failed = failed or (bool(run.records) and all(r.error for r in run.records))
    if failed:
        print("kvtier bench: error: every request of a configuration failed (see above)", file=sys.stderr)
        return 1
    return 0


def _bench_endpoint(args: argparse.Namespace, opts, console: Console) -> int:
    """``kvtier bench --endpoint URL``: the workload replayed over HTTP (see kvtier.bench.endpoint)."""
    from kvtier.bench import report
    from kvtier.bench.endpoint import run_endpoint

    with _progress(console) as (on_start, on_finish):
        workload, run, prov = run_endpoint(opts, args.endpoint, on_start=on_start, on_finish=on_finish)
    console.print(f"workload {workload.name}: {len(workload.sessions)} sessions, {workload.num_requests()} requests, "
                  f"{workload.block_size}-token blocks; replayed against {args.endpoint} (model {opts.model})")
    report.render_table([run], console=console, baseline=run.name)
    if args.plot:
        console.print(f"wrote {report.plot_ttft([run], args.plot)}")
    if args.json:
        report.write_json(args.json, report.bench_json([run], prov, baseline=run.name, records=args.json_records))
        console.print(f"wrote {args.json}")
    return _report_errors([run], console)


def _list_scenarios(console: Console) -> None:
    from kvtier.bench.sim.scenarios import SCENARIOS

    table = Table(title="kvtier simulate scenarios")
    for col in ("scenario", "workers x node", "configurations", "description"):
        table.add_column(col)
    for s in SCENARIOS.values():
        table.add_row(s.name, f"{s.workers} x {s.node}", ", ".join(v.name for v in s.variants), s.description)
    console.print(table)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def cmd_simulate(args: argparse.Namespace) -> int:
    from kvtier.bench import report
    from kvtier.bench.sim.run import SimOptions, run_scenario

    console = Console()
    if args.list:
        _list_scenarios(console)
        return 0
    opts = SimOptions(
        scenario=args.scenario, trace=args.trace, sessions=args.sessions, concurrency=args.concurrency,
        max_turns=args.max_turns, time_scale=args.time_scale, max_think_s=args.max_think_s,
        ramp_s=args.ramp_s, duration_s=args.duration_s, warmup_s=args.warmup_s, seed=args.seed,
        truncate_input_tokens=args.truncate_input_tokens, warm_prefix_fraction=args.warm_prefix_fraction,
        kv_dtype_bytes=args.kv_dtype_bytes, configs=args.configs, node=args.node,
        matrix_efficiency=args.matrix_efficiency, kernel_csv=tuple(args.kernel_csv or ()),
        kernel_device=args.kernel_device, schedule_policy=args.schedule_policy)
    opts.resolve()  # bad options fail before anything runs
    for path in (args.json, args.plot):
        if path:
            report.check_writable(path)
    t0 = time.perf_counter()
    scn, workload, sizing, runs, prov = run_scenario(
        opts, on_start=lambda name: console.print(f"simulating {name} ({time.perf_counter() - t0:.0f} s)"))
    elapsed = time.perf_counter() - t0
    r = scn.replay
    console.print(f"{scn.name}: {scn.description}")
    if scn.calibration:
        console.print(f"calibration: {scn.calibration}")
    console.print(f"workload {workload.name}: {len(workload.sessions)} sessions, {workload.num_requests()} requests, "
                  f"{r.concurrency} at a time, the first {r.concurrency} started over {r.ramp_s:g} s; "
                  f"think times x{r.time_scale:g} (cap {r.max_think_s:g} s); "
                  f"turns due in [{r.warmup_s:g}, {r.duration_s:g}) s reported")
    console.print(f"per worker: {sizing.device_pages} device pages of {sizing.page_size} tokens "
                  f"({sizing.device_pages * sizing.page_size / 1e6:.2f}M tokens, "
                  f"{scn.workers * sizing.device_pages / sizing.working_set_pages:.2f} of the working set), "
                  f"{sizing.host_slots} host and {sizing.store_slots} {scn.store} blocks; "
                  f"prefill {prov['prefill_tok_s_16k']:.0f} tok/s at 16K-token chunks")
    report.render_table([sr.run for sr in runs], console=console, baseline=scn.baseline,
                        title=f"kvtier simulate {scn.name}: per-configuration results (virtual time)")
    console.print("TTFT p99 of returning turns (after a session's first; the turns a cache can serve): "
                  + ", ".join(f"{name} {_ms(v['ttft_p99_returning_s'])}" for name, v in prov["per_variant"].items()))
    if scn.workers > 1:
        console.print("migrations (turns served by another worker than the previous turn): "
                      + ", ".join(f"{sr.run.name} {sr.migrations}" for sr in runs))
    console.print(f"simulated in {elapsed:.1f} s")
    if args.plot:
        console.print(f"wrote {report.plot_ttft([sr.run for sr in runs], args.plot)}")
    if args.json:
        report.write_json(args.json, report.bench_json([sr.run for sr in runs], prov, baseline=scn.baseline))
        console.print(f"wrote {args.json}")
    return 0


def cmd_create_checkpoint(args: argparse.Namespace) -> int:
    path = create_random_checkpoint(args.path, args.preset, args.seed, args.dtype)
    print(f"wrote {args.dtype} checkpoint of preset {args.preset!r} (seed {args.seed}) to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="replay coding-agent sessions under several cache configurations")
    b.add_argument("--trace", metavar="PATH", help="kv-cache-tester .json/.json.gz or Mooncake .jsonl file, or a "
                   "folder of them (default: the built-in workload generator)")
    b.add_argument("--conversations", metavar="PATH",
                   help="JSONL of text chat sessions (OpenAI message lists; see kvtier.bench.conversations) "
                        "instead of a trace; needs --tokenizer with a preset model")
    b.add_argument("--tokenizer", metavar="DIR", help="Kimi tokenizer files for --conversations (default: the model dir)")
    b.add_argument("--page-size", type=int, default=None, help="tokens per KV page for --conversations (default 16)")
    b.add_argument("--max-output-tokens", type=int, default=None, help="cap on each response length for --conversations")
    b.add_argument("--sessions", type=int, default=16, help="sessions replayed")
    b.add_argument("--concurrency", type=int, default=8, help="sessions active at once")
    b.add_argument("--configs", default="device-only,tiered",
                   help="comma-separated: device-only, tiered, tiered-write-through, tiered-tool-aware, no-cache")
    b.add_argument("--model", default="tiny", help=f"checkpoint directory or preset {sorted(PRESETS)}; with "
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
    b.add_argument("--load-sweep", metavar="LOADS", default=None,
                   help="replay the sessions at each of these offered loads (comma-separated think-time divisors, "
                        "e.g. 0.5,1,2) and plot p99 TTFT against throughput per configuration")
    b.add_argument("--ttft-slo", type=float, default=None, metavar="SECONDS",
                   help="with --load-sweep: report goodput, the highest load whose p99 TTFT stays under this")
    b.set_defaults(func=cmd_bench)
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
    m.add_argument("--plot", metavar="PATH", default="kvtier-simulate-ttft.png", help="TTFT plot PNG ('' = none)")
    m.add_argument("--json", metavar="PATH", help="write the results with provenance here (kvtier bench's shape)")
    m.set_defaults(func=cmd_simulate)
    g = sub.add_parser("generate", help="offline generation over synthetic shared-prefix prompts")
    g.add_argument("--model", default="tiny", help=f"checkpoint directory or preset {sorted(PRESETS)}")
    g.add_argument("--num-prompts", type=int, default=8)
    g.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt")
    g.add_argument("--shared-prefix-len", type=int, default=448, help="tokens all prompts share")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (power of two)")
    g.add_argument("--num-device-pages", type=int, default=1024, help="pages per layer in the device KV pool")
    g.add_argument("--host-cache-bytes", type=int, default=0, help="host-memory KV tier budget (0 = none)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("create-checkpoint", help="write a deterministic random HF-layout checkpoint")
    c.add_argument("path", help="output directory (config.json, safetensors shards, index)")
    c.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape")
    c.add_argument("--seed", type=int, default=0, help="the same seed writes the same bytes")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "fp8"],
                   help="fp8 = e4m3 linear weights with 128x128 weight_scale_inv block scales")
    c.set_defaults(func=cmd_create_checkpoint)
    kernels_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    router_cli.add_parser(sub)
    router_cli.add_cluster_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, StartupError) as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
