"""Latency-load curves: the same sessions replayed at several offered loads.

Offered load is set through think time: at load factor ``f`` every think time, and its cap,
is divided by ``f`` (``f`` = 2 sends each turn twice as soon after the previous one finished;
the closed loop and the concurrency stay as they are). Each point reports every
configuration's p99 TTFT and achieved throughput (``kvtier.bench.report.summarize``).
Goodput under a TTFT SLO is, per configuration, the highest load factor at which p99 TTFT
stays at or under the SLO, with the throughput achieved there (as DistServe and vLLM's
serving benchmark define goodput by an SLO on TTFT).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from kvtier.bench.records import ConfigRun
from kvtier.bench.report import summarize

Points = list[tuple[float, list[ConfigRun]]]
"""``[(load factor, runs at that load)]``, in the order swept."""


def parse_loads(text: str) -> tuple[float, ...]:
    """``"0.5,1,2"`` -> ``(0.5, 1.0, 2.0)``: sorted, distinct load factors.

    Raises:
        ValueError: an empty list, or a value that is not a finite number > 0 (naming it).
    """
    try:
        loads = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        loads = []
    if not loads or not all(0 < v < math.inf for v in loads):
        raise ValueError(f"--load-sweep must be comma-separated finite numbers > 0 (think-time divisors, "
                         f"e.g. 0.5,1,2), got {text!r}")
    return tuple(sorted(set(loads)))


def sweep_json(points: Points, ttft_slo_s: float | None = None) -> dict:
    """The ``load_sweep`` section of ``--json``.

    Returns:
        ``{"loads": [f, ...], "configs": {name: [{"load", "throughput_tok_s", "ttft_s":
        {"p50", "p90", "p99"}, "requests", "errors"}, ...]}, "ttft_slo_s", "goodput": {name:
        {"load", "throughput_tok_s"} or None}}``; times in seconds, throughput in tokens/s;
        ``goodput`` only with ``ttft_slo_s`` (None for a configuration that met it at no load).
    """
    configs: dict[str, list[dict]] = {}
    for load, runs in points:
        for run in runs:
            s = summarize(run)
            configs.setdefault(run.name, []).append(
                {"load": load, "throughput_tok_s": s["throughput_tok_s"], "ttft_s": s["ttft_s"],
                 "requests": s["requests"], "errors": s["errors"]})
    data = {"loads": [load for load, _ in points], "configs": configs, "ttft_slo_s": ttft_slo_s}
    if ttft_slo_s is not None:
        data["goodput"] = {name: goodput(rows, ttft_slo_s) for name, rows in configs.items()}
    return data


def goodput(rows: list[dict], ttft_slo_s: float) -> dict | None:
    """The row of highest load whose p99 TTFT is at or under ``ttft_slo_s`` seconds, as
    ``{"load", "throughput_tok_s"}``; None when no row meets it."""
    ok = [r for r in rows if r["ttft_s"]["p99"] is not None and r["ttft_s"]["p99"] <= ttft_slo_s]
    if not ok:
        return None
    best = max(ok, key=lambda r: r["load"])
    return {"load": best["load"], "throughput_tok_s": best["throughput_tok_s"]}


def sweep_lines(data: dict) -> list[str]:
    """Plain-text lines: per configuration, each load's p99 TTFT and throughput, and goodput."""
    lines = []
    for name, rows in data["configs"].items():
        cells = [f"x{r['load']:g}: p99 {_ms(r['ttft_s']['p99'])} ms at {_tok(r['throughput_tok_s'])} tok/s" for r in rows]
        lines.append(f"{name}: " + "; ".join(cells))
        if "goodput" in data:
            g = data["goodput"][name]
            lines.append(f"  goodput (p99 TTFT <= {data['ttft_slo_s']:g} s): "
                         + ("no load met it" if g is None else f"load x{g['load']:g}, "
                                                               f"{_tok(g['throughput_tok_s'])} tok/s"))
    return lines


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f}"


def _tok(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def plot_sweep(data: dict, path: str | os.PathLike) -> Path:
    """Plot p99 TTFT (s, log) against achieved throughput (tokens/s), a line per configuration
    with each point labelled by its load factor, and the SLO when given; write a PNG.

    Uses a standalone Agg ``Figure`` (pyplot's state is untouched).

    Raises:
        OSError: ``path`` cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, rows in data["configs"].items():
        pts = [(r["throughput_tok_s"], r["ttft_s"]["p99"], r["load"]) for r in rows
               if r["throughput_tok_s"] is not None and r["ttft_s"]["p99"] is not None]
        if not pts:
            ax.plot([], [], " ", label=f"{name}: no finished requests")
            continue
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for x, y, load in pts:
            ax.annotate(f"x{load:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8,
                        color=line.get_color())
    if data.get("ttft_slo_s") is not None:
        ax.axhline(data["ttft_slo_s"], color="grey", linestyle="--", linewidth=1,
                   label=f"TTFT SLO {data['ttft_slo_s']:g} s")
    ax.set_yscale("log")
    ax.set_title("p99 TTFT against achieved throughput (labels: offered-load factor)")
    ax.set_xlabel("achieved throughput (tokens/s)")
    ax.set_ylabel("p99 time to first token (s, log scale)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best")
    fig.savefig(path, format="png")
    return Path(path)
