"""``kvtier bench --repeat N``: the bench over N workload draws, and each figure's median and range.

A p99 over ~150 requests moves with the few slowest of them, so one run's tail ratio is noise
as much as signal (one 32-session trace replay gave 2.93x, 4.84x and 1.97x on one machine).
Repeat ``i`` (0-based) draws its workload with seed ``opts.seed + i``
(:attr:`~kvtier.bench.run.BenchOptions.workload_seed`): the built-in workload generated with
that seed, or ``sessions`` sessions sampled with it from the trace. The model weights, tier
policy and configurations stay the same; every configuration replays each draw, so the
ratios between configurations compare like with like within a repeat, and the summary gives,
for each figure, the median over repeats and its min and max (``spread``).
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import replace

import torch

from kvtier.bench import report
from kvtier.bench.configs import IDEAL, parse_configs
from kvtier.bench.pool_sections import figure_label, section_figures
from kvtier.bench.run import BenchOptions, bench_provenance, load_tokenizer_for, prepare_workload, run_config, warm_up
from kvtier.bench.tail import tail_json
from kvtier.llm import load_for_serving

FIGURES = ("ttft_s.p50", "ttft_s.p90", "ttft_s.p99", "tpot_s.p50", "tpot_s.p99", "queue_wait_s.p99",
           "throughput_tok_s", "hit_rate.total", "preemptions", "mean_running_batch")
"""Per-configuration figures summarized, as dotted paths into ``report.summarize``'s dict; the pool's
sections add theirs (:func:`kvtier.bench.pool_sections.section_figures`), only where some run has them."""
RATIOS = ("ttft_p99_ratio", "throughput_ratio")
"""Per-configuration ratios against the baseline (``report.bench_json``'s ``comparison``)
summarized; ``ttft_p99_ratio`` (baseline p99 TTFT / this configuration's)."""
BOUND = tuple(report.BOUND_FIGURES)
"""Per-configuration distances to the bound (``report.bench_json``'s ``bound``: each figure / the
``ideal`` run's) summarized; the headline."""


def repeat_seeds(opts: BenchOptions, repeats: int) -> list[int]:
    """The workload seed of each repeat: ``opts.seed + i`` for ``i`` in ``range(repeats)``.

    Raises:
        ValueError: ``repeats`` is not an int >= 1.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"--repeat must be an int >= 1, got {repeats!r}")
    return [opts.seed + i for i in range(repeats)]


def run_repeats(opts: BenchOptions, repeats: int, on_start=None, on_finish=None, records: bool = False,
                on_repeat=None) -> list[dict]:
    """Run every configuration of ``opts`` on ``repeats`` workload draws (see the module docstring).

    The model is loaded and warmed up once; each repeat sizes the tiers for its own workload
    (:func:`kvtier.bench.run.prepare_workload`). ``on_start(name, num_requests)`` gets
    ``name#i`` (``i`` the repeat); ``on_finish(record)`` is called per request and
    ``on_repeat(docs)`` after each repeat with the documents so far.

    Returns:
        One ``report.bench_json`` document per repeat, in order, each with ``"seed"`` (its
        workload seed) and ``"tail"`` (``kvtier.bench.tail.tail_json``) added; with ``records``
        each configuration carries its per-request records.

    Raises:
        ValueError: a bad ``repeats`` or option (``--conversations`` cannot be drawn per seed).
    """
    seeds = repeat_seeds(opts, repeats)
    replace(opts, workload_seed=seeds[0])  # validates before the model loads
    configs = parse_configs(opts.configs)
    torch.set_num_threads(opts.threads)
    tokenizer = load_tokenizer_for(opts) if opts.conversations is not None else None
    model, model_id = load_for_serving(opts.model, seed=opts.seed, device=opts.device)
    docs = []
    for i, seed in enumerate(seeds):
        o = replace(opts, workload_seed=seed)
        workload, sizing, base = prepare_workload(o, model, tokenizer)
        if i == 0:
            warm_up(model, base)
        runs = []
        for config in configs:
            if on_start is not None:
                on_start(f"{config.name}#{i}", workload.num_requests())
            runs.append(run_config(config, model, model_id, base, sizing, workload, o, on_finish, tokenizer))
        prov = bench_provenance(o, workload, sizing, model) | {"repeat": i}
        docs.append(report.bench_json(runs, prov, records=records) | {"seed": seed, "tail": tail_json(runs)})
        if on_repeat is not None:
            on_repeat(docs)
    return docs


def spread(values: list[float | None]) -> dict | None:
    """``{"median", "min", "max", "n"}`` of the values that are not None (``n``: how many); None
    when none is. The median of an even count is the mean of the middle two."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return None
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def _figure(summary: dict, path: str):
    value = summary
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def summarize_repeats(docs: list[dict]) -> dict:
    """Median and range over repeats of each figure and ratio.

    Args:
        docs: per-repeat documents as :func:`run_repeats` returns them (or as read back from
            the ``"repeats"`` of a ``--repeat --json`` file).

    Returns:
        ``{"repeats": n, "seeds": [...], "configs": {name: {figure: spread}}, "comparison":
        {name: {ratio: spread}}, "bound": {name: {figure: spread}}}`` over :data:`FIGURES`,
        :data:`RATIOS` and :data:`BOUND` (``"bound"`` empty without an ``ideal`` run); a configuration
        appears when any repeat has it, a figure's spread is over the repeats that have it.

    Raises:
        ValueError: ``docs`` is empty.
    """
    if not docs:
        raise ValueError("summarize_repeats: no repeats given")
    names = list(dict.fromkeys(n for d in docs for n in d["configs"]))
    compared = list(dict.fromkeys(n for d in docs for n in d.get("comparison", {})))
    bounded = list(dict.fromkeys(n for d in docs for n in d.get("bound", {})))
    figures = [*FIGURES, *section_figures(c for d in docs for c in d["configs"].values())]
    return {
        "repeats": len(docs),
        "seeds": [d.get("seed") for d in docs],
        "configs": {n: {f: spread([_figure(d["configs"][n], f) for d in docs if n in d["configs"]]) for f in figures}
                    for n in names},
        "comparison": {n: {r: spread([d["comparison"][n][r] for d in docs if n in d.get("comparison", {})])
                           for r in RATIOS} for n in compared},
        "bound": {n: {f: spread([d["bound"][n][f] for d in docs if n in d.get("bound", {})]) for f in BOUND}
                  for n in bounded},
    }


def repeat_json(docs: list[dict], provenance: dict | None = None) -> dict:
    """The ``kvtier bench --repeat N --json`` document: ``{"provenance", "repeats": docs,
    "summary": summarize_repeats(docs)}``; ``provenance`` defaults to the first repeat's."""
    return {"provenance": provenance if provenance is not None else docs[0]["provenance"], "repeats": docs,
            "summary": summarize_repeats(docs)}


def format_spread(s: dict | None, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    """A :func:`spread` as ``median [min-max]``, each value times ``scale`` in ``fmt``; ``n/a``
    for None."""
    if s is None:
        return "n/a"
    return f"{fmt.format(s['median'] * scale)} [{fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)}]"


_LABELS = {"ttft_s.p50": ("TTFT p50 (ms)", 1e3, "{:.0f}"), "ttft_s.p90": ("TTFT p90 (ms)", 1e3, "{:.0f}"),
           "ttft_s.p99": ("TTFT p99 (ms)", 1e3, "{:.0f}"), "tpot_s.p50": ("TPOT p50 (ms)", 1e3, "{:.1f}"),
           "tpot_s.p99": ("TPOT p99 (ms)", 1e3, "{:.1f}"), "queue_wait_s.p99": ("queue wait p99 (ms)", 1e3, "{:.0f}"),
           "throughput_tok_s": ("throughput (tok/s)", 1.0, "{:.0f}"), "hit_rate.total": ("hit rate total", 1.0, "{:.2f}"),
           "preemptions": ("preemptions", 1.0, "{:.0f}"),
           "mean_running_batch": ("mean running batch", 1.0, "{:.2f}")}


def repeat_lines(summary: dict, baseline: str = report.BASELINE) -> list[str]:
    """Plain-text lines: per figure and configuration ``median [min-max]`` over the repeats,
    then each configuration's distance to the bound (p99 and p90 TTFT, p99 TPOT, throughput, each
    / the ``ideal`` run's) and its p99 TTFT ratio and throughput ratio against ``baseline``."""
    names = list(summary["configs"])
    labels = {f: _LABELS[f] if f in _LABELS else figure_label(f) for n in names for f in summary["configs"][n]}
    width = max(len(label) for label, _, _ in [*_LABELS.values(), *labels.values()])
    lines = [f"median [min-max] over {summary['repeats']} repeats (workload seeds {summary['seeds']})",
             " " * width + "  " + "  ".join(f"{n:>24}" for n in names)]
    for f, (label, scale, fmt) in labels.items():
        lines.append(f"{label:<{width}}  " + "  ".join(f"{format_spread(summary['configs'][n][f], scale, fmt):>24}"
                                                        for n in names))
    for n, b in summary.get("bound", {}).items():
        lines.append(f"{n} vs {IDEAL} (bound): " + ", ".join(
            f"{label} {format_spread(b[f], fmt='{:.2f}x')}" for f, label in (
                ("ttft_p99", "p99 TTFT"), ("ttft_p90", "p90 TTFT"), ("tpot_p99", "p99 TPOT"),
                ("throughput", "throughput"))) + " (median [min-max])")
    for n, c in summary["comparison"].items():
        lines.append(f"{n} vs {baseline}: p99 TTFT ratio {format_spread(c['ttft_p99_ratio'], fmt='{:.2f}x')}, "
                     f"throughput ratio {format_spread(c['throughput_ratio'], fmt='{:.2f}x')} (median [min-max])")
    return lines


def bench_repeat(opts: BenchOptions, repeats: int, console, json_path: str | None = None,
                 records: bool = False) -> int:
    """What ``kvtier bench --repeat N`` does: :func:`run_repeats` with a progress bar per replay,
    one line per repeat (its seed, workload and headline ratios), :func:`repeat_lines`, and with
    ``json_path`` :func:`repeat_json` written there (checked writable first). ``console`` is a
    ``rich.console.Console``. The file is rewritten after each repeat, so an interrupted run
    keeps the repeats it finished. Returns the exit status: 1 when every request of some
    configuration in some repeat failed, else 0."""
    if json_path:
        report.check_writable(json_path)
    with contextlib.ExitStack() as stack:
        bars: list = []

        def on_start(name: str, total: int) -> None:
            stack.close()  # the previous replay's bar
            bars.append(stack.enter_context(report.replay_progress(total, name, console=console)))

        save = (lambda docs: report.write_json(json_path, repeat_json(docs))) if json_path else None
        docs = run_repeats(opts, repeats, on_start=on_start, on_finish=lambda r: bars[-1].advance(), records=records,
                           on_repeat=save)
    for i, d in enumerate(docs):
        w = d["provenance"]["workload"]
        ratios = ", ".join(f"{n} p99 TTFT ratio {c['ttft_p99_ratio']:.2f}x" for n, c in d.get("comparison", {}).items()
                           if c["ttft_p99_ratio"] is not None)
        console.print(f"repeat {i} (workload seed {d['seed']}): {w['name']}, {w['sessions']} sessions, "
                      f"{w['requests']} requests; {ratios or 'no ratio'}", markup=False, highlight=False, soft_wrap=True)
    doc = repeat_json(docs)
    for line in repeat_lines(doc["summary"]):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if json_path:
        report.write_json(json_path, doc)
        console.print(f"wrote {json_path}")
    failed = [(i, n) for i, d in enumerate(docs) for n, c in d["configs"].items() if c["requests"] and
              c["errors"] == c["requests"]]
    for i, n in failed:
        console.print(f"repeat {i}: every request of {n} failed", markup=False, highlight=False, soft_wrap=True)
    return 1 if failed else 0


__all__ = ["BOUND", "FIGURES", "RATIOS", "bench_repeat", "repeat_json", "repeat_lines", "repeat_seeds",
           "run_repeats",
           "format_spread", "spread", "summarize_repeats"]
