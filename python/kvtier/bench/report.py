"""Turn replay runs into numbers: a JSON summary, a terminal table, a TTFT plot, a progress line.

Method (applies to every function here):

- A request is *finished* when it has a ``finish_s`` and no ``error``. Latency percentiles and
  token counts (input, output, cache hits) are taken over finished requests only; unfinished and
  errored requests are counted (``requests``, ``errors``) but contribute no latency or tokens.
- Percentiles use numpy's ``"linear"`` method (the default of ``numpy.percentile``:
  interpolate linearly between the two closest order statistics). One value gives that value
  for every percentile; no value gives None.
- All times are seconds (floats) in the JSON; the table shows milliseconds.
- ``throughput_tok_s`` is total token throughput: (input + output tokens of finished requests)
  / ``wall_s``, counting cached prompt tokens too, as the AMD/Moonshot serving figures count it.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtier.bench.configs import IDEAL
from kvtier.bench.pool_sections import section_rows, sections_json
from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.result_file import check_writable, write_json  # noqa: F401 (callers write report.write_json)

BASELINE = "device-only"
"""Name of the run the others are compared against (ratios appear when it is present)."""
BOUND_FIGURES = {"ttft_p99": ("ttft_s", "p99"), "ttft_p90": ("ttft_s", "p90"), "tpot_p99": ("tpot_s", "p99"),
                 "throughput": ("throughput_tok_s", None)}
"""The distance to the bound (:data:`~kvtier.bench.configs.IDEAL`'s run): each figure of a
configuration divided by the ideal's (key -> path into :func:`summarize`'s dict)."""

TIERS = ("device", "host", "disk")
PHASES = ("queue_wait_s", "load_wait_s", "prefill_s")
"""The parts of TTFT each record splits it into (see ``kvtier.bench.records.RequestRecord``)."""
DIRECTIONS = ("device->host", "host->device", "host->disk", "disk->device")
"""Canonical order of ``bytes_moved`` keys in the table; other keys follow, sorted."""


# --------------------------------------------------------------------------- summary


def _finished(run: ConfigRun) -> list[RequestRecord]:
    return [r for r in run.records if r.finish_s is not None and r.error is None]


def _percentiles(values: list[float], qs: dict[str, float]) -> dict[str, float | None]:
    if not values:
        return {k: None for k in qs}
    got = np.percentile(np.asarray(values, dtype=np.float64), list(qs.values()), method="linear")
    return {k: float(v) for k, v in zip(qs, got, strict=True)}


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def summarize(run: ConfigRun) -> dict:
    """Summarize one configuration's replay as a JSON-ready dict.

    Args:
        run: the configuration's records and counters (see ``kvtier.bench.records``).

    Returns:
        ``{"ttft_s": {"p50", "p90", "p99"}, "tpot_s": {"p50", "p99"}, "e2e_s": {"p50", "p99"},
        "queue_wait_s", "load_wait_s", "prefill_s": {"p50", "p99"}, "throughput_tok_s", "requests", "hit_tokens": {"device", "host", "disk"},
        "recomputed_tokens", "bytes_moved": {direction: bytes}, "errors",
        "hit_rate": {"device", "host", "disk", "total"}, "input_tokens", "output_tokens",
        "wall_s", "preemptions", "evictions": {tier: blocks}, "copy_errors",
        "stores_refused": {tier: blocks}, "device_pages", "working_set_pages", "mean_running_batch",
        "sections"}``.

        - ``*_s`` percentiles: seconds, numpy ``"linear"`` percentiles over finished requests
          (TPOT only over those with >= 2 output tokens; the TTFT parts over those that
          recorded them); None when there is no such request.
        - ``throughput_tok_s``: tokens/s, (input + output tokens of finished requests) /
          ``wall_s``; None when ``wall_s`` is 0.
        - ``requests``: records submitted (finished or not); ``errors``: records with an error.
        - ``input_tokens``, ``output_tokens``, ``hit_tokens``: tokens, finished requests only.
        - ``hit_rate[tier]``: ``hit_tokens[tier] / input_tokens``; ``hit_rate["total"]``:
          ``cached_tokens`` (any tier) / ``input_tokens``; None when ``input_tokens`` is 0.
        - ``bytes_moved`` (bytes), ``evictions`` (blocks) and the counters are copied from ``run``;
          ``preemptions``, ``evictions``, ``copy_errors``, ``stores_refused`` and ``device_pages``
          are None when ``run.server_counters`` is False (a run over HTTP cannot see them).
        - ``sections``: the pools' counters beyond their blocks', by section name
          (:func:`kvtier.bench.pool_sections.sections_json`); empty for a run over HTTP. The hit rates
          above count exact hits only: a cached token is one the pool placed (for a hybrid model, up
          to a boundary where both the MLA blocks and the recurrent state were restored).

    Raises:
        ValueError: ``run.wall_s`` is negative or not finite (names the run).

    Example:
        >>> from kvtier.bench.records import ConfigRun, RequestRecord
        >>> r = RequestRecord("s0", 0, input_tokens=100, output_tokens=3, arrival_s=0.0,
        ...                   first_token_s=0.5, finish_s=1.5, cached_tokens=64,
        ...                   cached_tokens_by_tier={"device": 64, "host": 0, "disk": 0})
        >>> s = summarize(ConfigRun("tiered", [r], wall_s=2.0))
        >>> s["ttft_s"]["p99"], s["tpot_s"]["p50"], s["hit_rate"]["device"], s["throughput_tok_s"]
        (0.5, 0.5, 0.64, 51.5)
    """
    if not (math.isfinite(run.wall_s) and run.wall_s >= 0):
        raise ValueError(f"run {run.name!r}: wall_s must be finite and >= 0 seconds, got {run.wall_s!r}")
    done = _finished(run)
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    phases = {name: _percentiles([v for r in done if (v := getattr(r, name)) is not None], {"p50": 50, "p99": 99})
              for name in PHASES}
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    e2e = [r.e2e_s for r in done]
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    hit_tokens = {t: sum(r.cached_tokens_by_tier.get(t, 0) for r in done) for t in TIERS}
    cached = sum(r.cached_tokens for r in done)
    hit_rate = {t: _ratio(hit_tokens[t], input_tokens) for t in TIERS}
    hit_rate["total"] = _ratio(cached, input_tokens)
    return {
        "ttft_s": _percentiles(ttft, {"p50": 50, "p90": 90, "p99": 99}),
        "tpot_s": _percentiles(tpot, {"p50": 50, "p99": 99}),
        "e2e_s": _percentiles(e2e, {"p50": 50, "p99": 99}),
        **phases,
        "throughput_tok_s": _ratio(float(input_tokens + output_tokens), float(run.wall_s)),
        "requests": len(run.records),
        "hit_tokens": hit_tokens,
        "recomputed_tokens": run.recomputed_tokens,
        "bytes_moved": dict(run.bytes_moved),
        "errors": sum(r.error is not None for r in run.records),
        "hit_rate": hit_rate,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "wall_s": float(run.wall_s),
        "working_set_pages": run.working_set_pages,
        "mean_running_batch": run.mean_running_batch,
        **_server_counters(run),
        "sections": sections_json(run),
    }


def _server_counters(run: ConfigRun) -> dict:
    """The engine's counters of ``run``; None each when they were not observed (over HTTP)."""
    seen = run.server_counters
    return {"preemptions": run.preemptions if seen else None, "evictions": dict(run.evictions) if seen else None,
            "copy_errors": run.copy_errors if seen else None,
            "stores_refused": dict(run.stores_refused) if seen else None,
            "device_pages": run.device_pages if seen else None}


def _compare(baseline: dict, summary: dict) -> dict:
    return {"ttft_p99_ratio": _ratio(baseline["ttft_s"]["p99"], summary["ttft_s"]["p99"]),
            "throughput_ratio": _ratio(summary["throughput_tok_s"], baseline["throughput_tok_s"])}


def _figure(summary: dict, key: str, q: str | None) -> float | None:
    return summary[key] if q is None else summary[key][q]


def bound_distance(ideal: dict, summary: dict) -> dict[str, float | None]:
    """A configuration's distance to the bound: ``{name: summary's figure / ideal's}`` over
    :data:`BOUND_FIGURES` (``ttft_p99``, ``ttft_p90``, ``tpot_p99``: >= 1 when slower than the
    bound; ``throughput``: <= 1 when fewer tokens/s); None when either is None or the ideal's is 0.

    Args:
        ideal, summary: :func:`summarize` dicts of the ``ideal`` run and of the configuration.

    Example:
        >>> bound_distance({"ttft_s": {"p99": 2.0, "p90": 1.0}, "tpot_s": {"p99": 0.1}, "throughput_tok_s": 100.0},
        ...                {"ttft_s": {"p99": 2.2, "p90": 1.0}, "tpot_s": {"p99": 0.2}, "throughput_tok_s": 90.0})
        {'ttft_p99': 1.1, 'ttft_p90': 1.0, 'tpot_p99': 2.0, 'throughput': 0.9}
    """
    return {name: _ratio(_figure(summary, *path), _figure(ideal, *path)) for name, path in BOUND_FIGURES.items()}


def _summaries(runs: list[ConfigRun]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for run in runs:
        if run.name in out:
            raise ValueError(f"runs: configuration name {run.name!r} appears more than once")
        out[run.name] = summarize(run)
    return out


def record_json(r: RequestRecord) -> dict:
    """One request as JSON: its fields, ``ttft_s``, the TTFT parts and ``tier_mix``."""
    return {**asdict(r), "ttft_s": r.ttft_s, **{name: getattr(r, name) for name in PHASES}, "tier_mix": r.tier_mix}


def bench_json(runs: list[ConfigRun], provenance: dict, baseline: str = BASELINE, records: bool = False) -> dict:
    """The ``kvtier bench --json`` document (``kvtier simulate --json`` writes the same shape).

    Args:
        runs: one per configuration; names must be unique.
        provenance: where the result came from, passed through unchanged; build it with
            ``kvtier.provenance.provenance(**extra)``.
        baseline: name of the run the others are compared with.

    Returns:
        ``{"provenance": provenance, "configs": {name: summarize(run)}}``, plus, when a run named
        ``baseline`` (default ``"device-only"``) and at least one other run exist,
        ``"comparison": {name: {"ttft_p99_ratio", "throughput_ratio"}}`` for every other run,
        where ``ttft_p99_ratio`` = the baseline's p99 TTFT / this run's (> 1: this run is
        faster) and ``throughput_ratio`` = this run's throughput / the baseline's (> 1: more
        tokens/s); a ratio is None when either side is None or the denominator is 0.
        When a run named ``ideal`` (:data:`~kvtier.bench.configs.IDEAL`, the bound) and at least
        one other exist, ``"bound": {name: bound_distance(ideal, summary)}`` for every other run.
        With ``records``, each configuration also holds ``"records"``: every request as
        :func:`record_json` writes it, in finishing order.

    Raises:
        ValueError: two runs share a name, or a run's ``wall_s`` is invalid (see ``summarize``).
    """
    configs = _summaries(runs)
    if records:
        for run in runs:
            configs[run.name]["records"] = [record_json(r) for r in run.records]
    data = {"provenance": provenance, "configs": configs}
    if IDEAL in configs and len(configs) > 1:
        data["bound"] = {name: bound_distance(configs[IDEAL], s) for name, s in configs.items() if name != IDEAL}
    if baseline in configs and len(configs) > 1:
        data["comparison"] = {name: _compare(configs[baseline], s)
                              for name, s in configs.items() if name != baseline}
    return data


# --------------------------------------------------------------------------- table


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.1f}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def _times(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _count(n: int | None) -> str:
    return "n/a" if n is None else str(n)


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table_rows(runs: list[ConfigRun], s: dict[str, dict], baseline: str) -> list[tuple[str, list[str]]]:
    names = [r.name for r in runs]

    def col(cell) -> list[str]:
        return [cell(s[n]) for n in names]

    finished = {r.name: len(_finished(r)) for r in runs}
    rows = [("requests (finished)", [f"{s[n]['requests']} ({finished[n]})" for n in names])]
    rows += [(f"TTFT {q} (ms)", col(lambda x, q=q: _ms(x["ttft_s"][q]))) for q in ("p50", "p90", "p99")]
    rows += [(f"TPOT {q} (ms)", col(lambda x, q=q: _ms(x["tpot_s"][q]))) for q in ("p50", "p99")]
    rows += [(f"e2e {q} (ms)", col(lambda x, q=q: _ms(x["e2e_s"][q]))) for q in ("p50", "p99")]
    for name in PHASES:
        label = name.removesuffix("_s").replace("_", " ")
        rows += [(f"  {label} {q} (ms)", col(lambda x, q=q, name=name: _ms(x[name][q]))) for q in ("p50", "p99")]
    rows.append(("throughput (tok/s)", col(lambda x: "n/a" if x["throughput_tok_s"] is None
                                          else f"{x['throughput_tok_s']:.1f}")))
    rows += [(f"hit rate {t}", col(lambda x, t=t: _pct(x["hit_rate"][t]))) for t in (*TIERS, "total")]
    rows.append(("recomputed tokens", col(lambda x: str(x["recomputed_tokens"]))))
    seen = {d for x in s.values() for d in x["bytes_moved"]}
    dirs = [d for d in DIRECTIONS if d in seen] + sorted(seen - set(DIRECTIONS))
    rows += [(f"bytes moved {d}", col(lambda x, d=d: _bytes(x["bytes_moved"].get(d, 0)))) for d in dirs]
    rows.append(("mean running batch / step", col(lambda x: "n/a" if x.get("mean_running_batch") is None
                                                  else f"{x['mean_running_batch']:.2f}")))
    rows.append(("device pages / working set",
                 col(lambda x: f"{_count(x['device_pages'])} / {x['working_set_pages']}")))
    for label, key in (("copy errors", "copy_errors"), ("request errors", "errors"), ("preemptions", "preemptions")):
        rows.append((label, col(lambda x, key=key: _count(x[key]))))
    rows.append(("stores refused host / disk", col(lambda x: "n/a" if x["stores_refused"] is None else " / ".join(
        str(x["stores_refused"].get(t, 0)) for t in ("host", "disk")))))
    rows += section_rows(runs, s, _bytes)
    if IDEAL in s and len(s) > 1:  # the distance to the bound leads, then the baseline's ratios
        bound = {n: bound_distance(s[IDEAL], s[n]) for n in names}
        for key, label in (("ttft_p99", "TTFT p99"), ("ttft_p90", "TTFT p90"), ("tpot_p99", "TPOT p99"),
                           ("throughput", "throughput")):
            rows.append((f"{label} / {IDEAL} (bound)", [_times(bound[n][key]) for n in names]))
    if baseline in s and len(s) > 1:
        cmp = {n: _compare(s[baseline], s[n]) for n in names}
        rows.append((f"TTFT p99 speedup vs {baseline}", [_times(cmp[n]["ttft_p99_ratio"]) for n in names]))
        rows.append((f"throughput vs {baseline}", [_times(cmp[n]["throughput_ratio"]) for n in names]))
    return rows


def render_table(runs: list[ConfigRun], console: Console | None = None, *, baseline: str = BASELINE,
                 title: str = "kvtier bench: per-configuration results") -> Table:
    """Print one column per configuration and one row per metric; return the ``rich`` table.

    Times are shown in milliseconds, hit rates in percent, bytes in binary units (B, KiB, MiB,
    GiB); "n/a" marks a value with no data. When an ``ideal`` run (the bound) and others exist,
    the distance to the bound follows (p99 and p90 TTFT, p99 TPOT and throughput, each config /
    ideal); when a ``baseline`` run (default ``device-only``) and others exist, two ratio rows
    follow: p99 TTFT speedup (baseline / config) and throughput (config / baseline). Without a terminal (CI logs, files) the output is plain
    text, no colour codes.

    Args:
        runs: configurations in column order; names must be unique.
        console: where to print; a new ``rich.console.Console()`` (stdout) when None.
        baseline: name of the run the ratio rows compare with.
        title: the table's title.

    Raises:
        ValueError: as ``bench_json``.
    """
    s = _summaries(runs)
    table = Table(title=title)
    table.add_column("metric")
    for run in runs:
        table.add_column(escape(run.name), justify="right")
    for label, cells in _table_rows(runs, s, baseline):
        table.add_row(escape(label), *(escape(c) for c in cells))
    (console or Console()).print(table)
    return table


# --------------------------------------------------------------------------- plot


def plot_ttft(runs: list[ConfigRun], path: str | os.PathLike) -> Path:
    """Plot each configuration's TTFT empirical CDF (log x, seconds) with its p99 marked; write PNG.

    Uses a standalone ``matplotlib.figure.Figure`` on the Agg canvas: pyplot's global state
    and the caller's backend and figures are untouched. A configuration with no finished
    request is not drawn and is listed in the legend as such. TTFT values <= 0 s cannot be
    shown on the log axis and are masked by matplotlib.

    Args:
        runs: configurations to draw (finished requests only; p99 as in ``summarize``).
        path: the PNG to write; its directory must exist.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        OSError: ``path`` cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    drawn = False
    for run in runs:
        ttft = np.sort([r.ttft_s for r in _finished(run) if r.ttft_s is not None])
        if ttft.size == 0:
            ax.plot([], [], " ", label=f"{run.name}: no finished requests")
            continue
        p99 = _percentiles(ttft.tolist(), {"p99": 99})["p99"]
        frac = np.arange(1, ttft.size + 1) / ttft.size
        (line,) = ax.step(np.r_[ttft[0], ttft], np.r_[0.0, frac], where="post",
                          label=f"{run.name} (n={ttft.size}, p99 {p99:.3g} s)")
        ax.axvline(p99, color=line.get_color(), linestyle="--", linewidth=1)
        drawn = True
    if drawn:
        ax.set_xscale("log")
    else:
        ax.text(0.5, 0.5, "no finished requests", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0, 1.02)
    ax.set_title("Time to first token per configuration (empirical CDF; dashed: p99)")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of finished requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best")
    fig.savefig(path, format="png")
    return Path(path)


# --------------------------------------------------------------------------- progress


class ReplayProgress:
    """Progress of one configuration's replay; made by ``replay_progress``.

    On a terminal it drives a ``rich.progress`` bar. Otherwise it prints a plain line at the
    start, at each further 10% of ``total`` and at the end, carrying the latest status text.
    """

    def __init__(self, total: int, name: str, console: Console, bar=None):  # bar: rich.progress.Progress
        self.total, self.name, self.console, self._bar = total, name, console, bar
        self.done, self.status, self._next_line = 0, "", 0.0
        self._t0 = time.perf_counter()
        self._task = bar.add_task(name, total=total, status="") if bar is not None else None

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more requests as completed (finished or failed)."""
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, advance=n)
        elif self.done >= self._next_line and self.done < self.total:
            self._line()

    def update_status(self, text: str) -> None:
        """Show ``text`` (e.g. "waiting for stragglers") beside the count."""
        self.status = text
        if self._bar is not None:
            self._bar.update(self._task, status=text)

    def _line(self) -> None:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        msg = f"{self.name}: {self.done}/{self.total} requests ({pct:.0f}%), {time.perf_counter() - self._t0:.1f} s"
        self.console.print(msg + (f", {self.status}" if self.status else ""), markup=False, highlight=False)
        self._next_line = (math.floor(10 * self.done / self.total) + 1) * self.total / 10 if self.total else math.inf


@contextlib.contextmanager
def replay_progress(total_requests: int, config_name: str, console: Console | None = None) -> Iterator[ReplayProgress]:
    """Show replay progress for one configuration while the ``with`` block runs.

    Args:
        total_requests: requests the replay will submit (>= 0).
        config_name: shown as the bar's description / line prefix.
        console: where to draw; a new ``rich.console.Console()`` when None.

    Yields:
        a ``ReplayProgress`` with ``advance(n=1)`` and ``update_status(text)``.

    Raises:
        ValueError: ``total_requests`` < 0.

    Example:
        >>> import io
        >>> with replay_progress(2, "tiered", Console(file=io.StringIO())) as p:
        ...     p.advance(); p.advance()
    """
    if total_requests < 0:
        raise ValueError(f"total_requests must be >= 0, got {total_requests}")
    console = console or Console()
    if not console.is_terminal:
        p = ReplayProgress(total_requests, config_name, console)
        p._line()
        try:
            yield p
        finally:
            p._line()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=console, transient=False) as bar:
        yield ReplayProgress(total_requests, config_name, console, bar)
