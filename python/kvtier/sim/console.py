"""What ``kvtier simulate`` shows on the console: the scenario list, and one scenario's tables,
plot and JSON (the CLI only parses)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from kvtier.serve.api.resume import REASONS


def list_scenarios(console: Console) -> None:
    """Print the table of ``kvtier simulate`` scenarios."""
    from kvtier.sim.scenarios import SCENARIOS

    table = Table(title="kvtier simulate scenarios")
    for col in ("scenario", "workers x node", "configurations", "description"):
        table.add_column(col)
    for s in SCENARIOS.values():
        table.add_row(s.name, f"{s.workers} x {s.node}", ", ".join(v.name for v in s.variants), s.description)
    console.print(table)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def simulate_sweep(opts, concurrencies: tuple[int, ...], target_s: float, console: Console, *,
                   json_path: str | None = None) -> int:
    """``kvtier simulate --sweep``: the scenario of ``opts`` at each concurrency
    (:mod:`kvtier.sim.sweep`); print the table, the sessions held and the headline, write the
    JSON; 0."""
    from kvtier.bench import report
    from kvtier.provenance import provenance
    from kvtier.sim.sweep import run_sweep, sweep_json, sweep_lines

    scn = opts.resolve()  # bad options fail before anything runs
    if json_path:
        report.check_writable(json_path)
    from dataclasses import asdict

    t0 = time.perf_counter()
    compared = "tiered" if any(v.name == "tiered" for v in scn.variants) else scn.variants[-1].name
    prov = provenance(kind="simulation-sweep", scenario=scn.name, model=scn.model, node=scn.node,
                      sweep=list(concurrencies), options=asdict(opts))

    def save(points: list[dict]) -> None:  # after each point: a long sweep keeps what it ran
        if json_path:
            report.write_json(json_path, {"provenance": prov, "sweep": sweep_json(points, target_s, scn.baseline,
                                                                                   compared)})

    points = run_sweep(opts, concurrencies,
                       on_start=lambda text: console.print(f"simulating {text} ({time.perf_counter() - t0:.0f} s)"),
                       on_point=save)
    doc = sweep_json(points, target_s, scn.baseline, compared)
    console.print(f"{scn.name}: {scn.description}")
    for line in sweep_lines(doc):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print(f"simulated in {time.perf_counter() - t0:.1f} s")
    if json_path:
        save(points)
        console.print(f"wrote {json_path}")
    return 0


def simulate(opts, console: Console, *, json_path: str | None = None, plot: str | None = None) -> int:
    """Run the scenario of ``opts`` (:class:`kvtier.sim.run.SimOptions`); print its tables,
    write the plot and JSON; 0."""
    from kvtier.bench import report
    from kvtier.sim.run import run_scenario

    opts.resolve()  # bad options fail before anything runs
    for path in (json_path, plot):
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
                  f"turns due in [{r.warmup_s:g}, {r.duration_s:g}) s reported"
                  + (f" after each session's first {r.warmup_turns} turn(s), from when the sessions active had run "
                     "them (" + ", ".join(f"{sr.run.name} {sr.window_s:.0f} s, {sr.window_sessions} sessions"
                                          for sr in runs) + "; counters of the window)" if r.warmup_turns else ""))
    console.print(f"per worker: {sizing.device_pages} device pages of {sizing.page_size} tokens "
                  f"({sizing.device_pages * sizing.page_size / 1e6:.2f}M tokens, "
                  f"{scn.workers * sizing.device_pages / sizing.working_set_pages:.2f} of the working set), "
                  f"{sizing.host_slots} host and {sizing.store_slots} {scn.store} blocks; "
                  f"prefill {prov['prefill_tok_s_16k']:.0f} tok/s at 16K-token chunks")
    report.render_table([sr.run for sr in runs], console=console, baseline=scn.baseline,
                        title=f"kvtier simulate {scn.name}: per-configuration results (virtual time)")
    console.print("TTFT p99 of returning turns (after a session's first; the turns a cache can serve): "
                  + ", ".join(f"{name} {_ms(v['ttft_p99_returning_s'])}" for name, v in prov["per_variant"].items()))
    resumed = {name: v["resume"] for name, v in prov["per_variant"].items() if "resume" in v}
    if resumed:
        table = Table(title=f"resumes after a tool wait against the {opts.resume_ttft_s:g} s target"
                      + (" (declared waits)" if opts.declared_waits else " (learned median wait)"))
        for col in ("configuration", "resumes", "misses", *(r.replace("_", " ") for r in REASONS)):
            table.add_column(col, justify="left" if col == "configuration" else "right")
        for name, got in resumed.items():
            m = got["misses"]
            table.add_row(name, str(got["resumes"]), str(sum(m.values())), *(str(m[r]) for r in REASONS))
        console.print(table)
    if scn.workers > 1:
        console.print("migrations (turns served by another worker than the previous turn): "
                      + ", ".join(f"{sr.run.name} {sr.migrations}" for sr in runs))
    console.print(f"simulated in {elapsed:.1f} s")
    if plot:
        console.print(f"wrote {report.plot_ttft([sr.run for sr in runs], plot)}")
    if json_path:
        report.write_json(json_path, report.bench_json([sr.run for sr in runs], prov, baseline=scn.baseline))
        console.print(f"wrote {json_path}")
    return 0


