"""What ``kvtier bench`` shows on the console: one replay, a load sweep or an endpoint replay,
each printed as tables and tail lines, plotted and written as JSON (the CLI only parses)."""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console


@contextlib.contextmanager
def progress(console: Console):
    """``(on_start, on_finish)`` callbacks that show one progress bar per replay."""
    from kvtier.bench import report

    with contextlib.ExitStack() as stack:
        bars: list = []

        def on_start(name: str, total: int) -> None:
            stack.close()
            bars.append(stack.enter_context(report.replay_progress(total, name, console=console)))

        yield on_start, lambda r: bars[-1].advance()


def describe(console: Console, opts, workload, sizing) -> None:
    if sizing.device_floor_applied:
        console.print(f"[yellow]note:[/] the device tier was raised to {sizing.device_pages} pages so that the largest "
                      f"turn fits; it is {sizing.device_pages / sizing.working_set_pages:.2f} of the working set, "
                      f"not --device-fraction {opts.device_fraction}")
    console.print(f"workload {workload.name}: {len(workload.sessions)} sessions, {workload.num_requests()} requests, "
                  f"{workload.block_size}-token blocks; device tier {sizing.device_pages} pages = "
                  f"{sizing.device_pages / sizing.working_set_pages:.2f} of the working set "
                  f"({sizing.working_set_pages} pages); host tier {sizing.host_cache_bytes / 2**20:.1f} MiB; "
                  f"{opts.schedule_policy} admission")
    if sizing.checkpoint_bytes:
        budgets = ", ".join(f"{t} {'the KV budget' if v is None else f'{v / 2**20:.1f} MiB'}"
                            for t, v in opts.checkpoints.budgets().items())
        console.print(f"hybrid model: {sizing.checkpoint_bytes / 2**10:.1f} KiB recurrent-state checkpoints at prompt "
                      f"and turn ends and every {sizing.checkpoint_tokens} tokens; checkpoint budgets {budgets}")


def bench_once(opts, console: Console, *, json_path: str | None = None, plot: str | None = None,
               json_records: bool = False) -> int:
    """Replay ``opts`` (:class:`kvtier.bench.run.BenchOptions`) under each configuration; print the
    table and tail lines, write the plot and JSON; the exit status (:func:`report_errors`)."""
    from kvtier.bench import report
    from kvtier.bench.run import run_all
    from kvtier.bench.tail import tail_json, tail_lines

    with progress(console) as (on_start, on_finish):
        workload, sizing, runs, prov = run_all(opts, on_start=on_start, on_finish=on_finish)
    describe(console, opts, workload, sizing)
    report.render_table(runs, console=console)
    tails = tail_json(runs)
    for line in tail_lines(tails):
        console.print(line, markup=False, highlight=False)
    if plot:
        console.print(f"wrote {report.plot_ttft(runs, plot)}")
    if json_path:
        report.write_json(json_path, report.bench_json(runs, prov, records=json_records) | {"tail": tails})
        console.print(f"wrote {json_path}")
    return report_errors(runs, console)


def bench_sweep(opts, loads: tuple[float, ...], console: Console, *, json_path: str | None = None,
                plot: str | None = None, json_records: bool = False, ttft_slo: float | None = None) -> int:
    """Replay ``opts`` at each offered load in ``loads``; print, plot and write the load sweep."""
    from kvtier.bench import report
    from kvtier.bench.run import run_sweep
    from kvtier.bench.sweep import plot_sweep, sweep_json, sweep_lines

    with progress(console) as (on_start, on_finish):
        workload, sizing, points, prov = run_sweep(opts, loads, on_start=on_start, on_finish=on_finish)
    describe(console, opts, workload, sizing)
    data = sweep_json(points, ttft_slo)
    for line in sweep_lines(data):
        console.print(line, markup=False, highlight=False)
    if plot:
        console.print(f"wrote {plot_sweep(data, plot)}")
    if json_path:
        doc = {"provenance": prov, "load_sweep": data}
        if json_records:
            doc["records"] = {f"{run.name}@x{load:g}": [report.record_json(r) for r in run.records]
                              for load, runs in points for run in runs}
        report.write_json(json_path, doc)
        console.print(f"wrote {json_path}")
    return report_errors([run for _, runs in points for run in runs], console)


def report_errors(runs, console: Console) -> int:
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


def bench_endpoint(opts, endpoint: str, console: Console, *, json_path: str | None = None,
                   plot: str | None = None, json_records: bool = False) -> int:
    """``kvtier bench --endpoint URL``: the workload replayed over HTTP (see kvtier.bench.endpoint)."""
    from kvtier.bench import report
    from kvtier.bench.endpoint import run_endpoint

    with progress(console) as (on_start, on_finish):
        workload, run, prov = run_endpoint(opts, endpoint, on_start=on_start, on_finish=on_finish)
    console.print(f"workload {workload.name}: {len(workload.sessions)} sessions, {workload.num_requests()} requests, "
                  f"{workload.block_size}-token blocks; replayed against {endpoint} (model {opts.model})")
    report.render_table([run], console=console, baseline=run.name)
    slo = prov.get("resume_slo")
    if slo is not None and slo.get("target_s") is None:
        console.print(f"resume target (server): none set (kvtier serve --resume-ttft-s S); {slo['resumes']} "
                      "resumes, misses not counted", soft_wrap=True)
    elif slo is not None:
        console.print(f"resume target (server): {slo['target_s']:g} s; {slo['resumes']} resumes, {slo['missed']} "
                      "missed (" + ", ".join(f"{k} {v}" for k, v in slo["misses"].items()) + ")", soft_wrap=True)
    if plot:
        console.print(f"wrote {report.plot_ttft([run], plot)}")
    if json_path:
        report.write_json(json_path, report.bench_json([run], prov, baseline=run.name, records=json_records))
        console.print(f"wrote {json_path}")
    return report_errors([run], console)


