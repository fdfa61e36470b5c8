"""``kvtier simulate --sweep``: one scenario at several concurrencies, and how many sessions each
configuration holds under a p99 TTFT target.

A figure taken at one load says little when that load is far beyond what a node can serve: at
128 sessions of 400K tokens a K3 node's device-only p99 TTFT is hours, and a ratio against it
measures the overload, not the cache. The sweep runs every configuration of the scenario at each
concurrency (sessions active at once; the scenario's sessions scaled in proportion, at least the
concurrency) and reports, per configuration:

- ``held_sessions``: the highest concurrency whose p99 TTFT is at most ``target_s``, every lower
  concurrency of the sweep holding it too (None: not even the lowest);
- ``throughput_tok_s`` there.

The headline compares ``tiered`` (or the configuration named) with the baseline (device-only):
the ratio of sessions held, and the p99 TTFT ratio (baseline / tiered) at ``at_sessions``, the
highest concurrency the baseline holds. Both are None when the baseline holds no concurrency of
the sweep: no headline is taken from a load where the baseline misses its target (a load where
it misses by more than ten times is overload, whatever the cache).
"""

from __future__ import annotations

import dataclasses
import math

from kvtier.bench.configs import IDEAL
from kvtier.bench.report import bound_distance, summarize

DEFAULT_SWEEP = (8, 16, 32, 64, 128)
"""Concurrencies swept by default (sessions active at once)."""
DEFAULT_TTFT_TARGET_S = 30.0
"""Default p99 TTFT target, seconds."""


def parse_sweep(text: str) -> tuple[int, ...]:
    """``"8,16,32"`` -> ``(8, 16, 32)``: distinct concurrencies >= 1, sorted.

    Raises:
        ValueError: empty, not integers, below 1, or repeated (names ``--sweep``).
    """
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep must be comma-separated integers (sessions at once), got {text!r}") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise ValueError(f"--sweep needs distinct concurrencies >= 1, got {text!r}")
    return tuple(sorted(values))


def at_concurrency(opts, scenario, concurrency: int):
    """``opts`` (:class:`kvtier.sim.run.SimOptions`) with ``concurrency`` sessions at once and the
    scenario's sessions scaled in proportion (``ceil(sessions * concurrency / scenario
    concurrency)``, at least ``concurrency``)."""
    r = scenario.replay
    sessions = max(concurrency, math.ceil(r.sessions * concurrency / r.concurrency))
    return dataclasses.replace(opts, concurrency=concurrency, sessions=sessions)


def run_sweep(opts, concurrencies: tuple[int, ...], on_start=None, on_point=None) -> list[dict]:
    """Run ``opts``' scenario at each concurrency of ``concurrencies``.

    Args:
        opts: :class:`kvtier.sim.run.SimOptions` (its ``concurrency`` and ``sessions`` are
            replaced per point).
        concurrencies: sessions at once, ascending.
        on_start: ``on_start(text)`` before each configuration of each point.
        on_point: ``on_point(points)`` after each point, with the points so far (a long sweep
            saves what it has).

    Returns:
        One ``{"concurrency", "sessions", "configs": {name: summarize(run)}, "bound", "sizing"}``
        per point; ``bound`` as :func:`kvtier.bench.report.bench_json`'s (empty without an
        ``ideal`` configuration); ``sizing``: device pages per worker and the working set.
    """
    from kvtier.sim.run import run_scenario

    scn = opts.resolve()
    points = []
    for c in concurrencies:
        o = at_concurrency(opts, scn, c)
        _, workload, sizing, runs, _ = run_scenario(
            o, on_start=None if on_start is None else (lambda name, c=c: on_start(f"{name} @ {c} sessions")))
        configs = {sr.run.name: summarize(sr.run) for sr in runs}
        bound = {n: bound_distance(configs[IDEAL], s) for n, s in configs.items() if n != IDEAL} \
            if IDEAL in configs else {}
        points.append({"concurrency": c, "sessions": len(workload.sessions), "configs": configs, "bound": bound,
                       "sizing": {"device_pages": sizing.device_pages, "working_set_pages": sizing.working_set_pages,
                                  "whole_working_set_pages": sizing.whole_working_set_pages}})
        if on_point is not None:
            on_point(points)
    return points


def held(points: list[dict], name: str, target_s: float) -> tuple[int | None, float | None]:
    """``(held_sessions, throughput_tok_s there)`` of configuration ``name`` (module docstring);
    ``(None, None)`` when its p99 TTFT misses ``target_s`` at the lowest concurrency."""
    got = (None, None)
    for p in points:
        s = p["configs"][name]
        p99 = s["ttft_s"]["p99"]
        if p99 is None or p99 > target_s:
            break
        got = (p["concurrency"], s["throughput_tok_s"])
    return got


def sweep_json(points: list[dict], target_s: float, baseline: str, compared: str = "tiered") -> dict:
    """The sweep's document: ``{"target_s", "baseline", "compared", "points", "held": {name:
    {"sessions", "throughput_tok_s"}}, "headline": {"sessions_held_ratio", "at_sessions",
    "ttft_p99_ratio", "baseline_ttft_p99_s", "compared_ttft_p99_s"}}``.

    ``sessions_held_ratio``: ``compared``'s held sessions / the baseline's; ``ttft_p99_ratio``:
    the baseline's p99 TTFT / ``compared``'s at ``at_sessions`` (the highest concurrency the
    baseline holds); all None when the baseline holds none (module docstring).

    Raises:
        ValueError: ``target_s`` not a finite number > 0, or ``baseline`` / ``compared`` not run.
    """
    if not 0 < target_s < math.inf:
        raise ValueError(f"--ttft-target-s must be a finite number of seconds > 0, got {target_s!r}")
    names = list(points[0]["configs"]) if points else []
    for n in (baseline, compared):
        if n not in names:
            raise ValueError(f"the sweep has no configuration {n!r} to compare; it ran {names}")
    hold = {n: dict(zip(("sessions", "throughput_tok_s"), held(points, n, target_s))) for n in names}
    headline = dict.fromkeys(("sessions_held_ratio", "at_sessions", "ttft_p99_ratio", "baseline_ttft_p99_s",
                              "compared_ttft_p99_s"))
    base_held, cmp_held = hold[baseline]["sessions"], hold[compared]["sessions"]
    if base_held is not None:
        at = next(p for p in points if p["concurrency"] == base_held)
        b, c = at["configs"][baseline]["ttft_s"]["p99"], at["configs"][compared]["ttft_s"]["p99"]
        headline.update(sessions_held_ratio=(cmp_held or 0) / base_held, at_sessions=base_held,
                        ttft_p99_ratio=None if not c else b / c, baseline_ttft_p99_s=b, compared_ttft_p99_s=c)
    return {"target_s": target_s, "baseline": baseline, "compared": compared, "points": points, "held": hold,
            "headline": headline}


def _seconds(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.1f}" if v >= 10 else f"{v:.3f}"


def sweep_lines(doc: dict) -> list[str]:
    """Plain-text lines: per concurrency and configuration p99 TTFT (s) and throughput (tok/s),
    the sessions each configuration holds under the target, and the headline."""
    points, target = doc["points"], doc["target_s"]
    names = list(points[0]["configs"]) if points else []
    lines = [f"p99 TTFT (s) / throughput (tok/s) per sessions at once; target p99 TTFT <= {target:g} s",
             f"{'sessions':>8}  " + "  ".join(f"{n:>24}" for n in names)]
    for p in points:
        cells = []
        for n in names:
            s = p["configs"][n]
            p99, tput = s["ttft_s"]["p99"], s["throughput_tok_s"]
            cells.append(f"{_seconds(p99)} / {'n/a' if tput is None else f'{tput:,.0f}'}")
        lines.append(f"{p['concurrency']:>8}  " + "  ".join(f"{c:>24}" for c in cells))
    for n, h in doc["held"].items():
        lines.append(f"{n}: holds " + ("none of the loads swept" if h["sessions"] is None else
                                       f"{h['sessions']} sessions at {h['throughput_tok_s']:,.0f} tok/s"))
    hl, base, cmp_ = doc["headline"], doc["baseline"], doc["compared"]
    if hl["at_sessions"] is None:
        lines.append(f"headline: none ({base} holds no load of the sweep under {target:g} s)")
    else:
        lines.append(f"headline: sessions held {cmp_} / {base} {hl['sessions_held_ratio']:.2f}x; at {hl['at_sessions']} "
                     f"sessions ({base}'s highest held) p99 TTFT {base} / {cmp_} "
                     + ("n/a" if hl["ttft_p99_ratio"] is None else f"{hl['ttft_p99_ratio']:.2f}x")
                     + f" ({_seconds(hl['baseline_ttft_p99_s'])} s vs {_seconds(hl['compared_ttft_p99_s'])} s)")
    return lines


__all__ = ["DEFAULT_SWEEP", "DEFAULT_TTFT_TARGET_S", "at_concurrency", "held", "parse_sweep", "run_sweep",
           "sweep_json", "sweep_lines"]
