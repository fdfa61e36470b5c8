"""Explain a run's TTFT tail from its records: the slowest requests with their TTFT parts, and
the check that cached prompts are not slower than cold ones of their size.

``cached_vs_cold`` states what a cache-aware scheduler must deliver: a request whose prompt is
at least ``cached_fraction`` cached has a TTFT no higher than the p90 TTFT of the cold first
turns (less than ``cold_fraction`` cached: a first turn may share a system prompt with other
sessions, so half) whose prompts are of similar length (within a
factor ``similar`` either way). A cached request with fewer than ``min_cold`` such cold turns
to compare with is counted as ``no_reference``, not judged.
"""

from __future__ import annotations

import numpy as np

from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.report import PHASES, _finished


def _brief(r: RequestRecord) -> dict:
    """One request: who, when, its TTFT and TTFT parts (s), its tier mix (tokens) and how often
    it was preempted before its first token."""
    return {"session_id": r.session_id, "turn": r.turn, "arrival_s": r.arrival_s, "input_tokens": r.input_tokens,
            "ttft_s": r.ttft_s, **{name: getattr(r, name) for name in PHASES}, "tier_mix": r.tier_mix,
            "preemptions": r.preemptions}


def slowest(run: ConfigRun, n: int = 5) -> list[dict]:
    """The ``n`` finished requests with the highest TTFT, slowest first, as :func:`_brief` dicts."""
    done = [r for r in _finished(run) if r.ttft_s is not None]
    return [_brief(r) for r in sorted(done, key=lambda r: r.ttft_s, reverse=True)[:n]]


def cached_vs_cold(run: ConfigRun, cached_fraction: float = 0.9, cold_fraction: float = 0.5,
                   similar: float = 2.0, min_cold: int = 3) -> dict:
    """Check that well-cached requests are not slower than cold first turns of similar length.

    Returns:
        ``{"checked", "no_reference", "violations": [brief + {"cold_p90_s", "cold_n"}],
        "cold_first_turns", "min_cold"}``: counts of requests checked and left unjudged, and each request
        whose TTFT (s) exceeded the p90 of its comparison set.
    """
    done = [r for r in _finished(run) if r.ttft_s is not None and r.input_tokens > 0]
    cold = [(r.input_tokens, r.ttft_s) for r in done if r.turn == 0 and r.cached_tokens < cold_fraction * r.input_tokens]
    checked, no_reference, violations = 0, 0, []
    for r in done:
        if r.cached_tokens < cached_fraction * r.input_tokens:
            continue
        ref = [t for n, t in cold if r.input_tokens / similar <= n <= r.input_tokens * similar]
        if len(ref) < min_cold:
            no_reference += 1
            continue
        checked += 1
        p90 = float(np.percentile(ref, 90))
        if r.ttft_s > p90:
            violations.append({**_brief(r), "cold_p90_s": p90, "cold_n": len(ref)})
    return {"checked": checked, "no_reference": no_reference, "violations": violations, "cold_first_turns": len(cold),
            "min_cold": min_cold}


def tail_json(runs: list[ConfigRun], n: int = 5) -> dict[str, dict]:
    """``{name: {"slowest": slowest(run, n), "cached_vs_cold": cached_vs_cold(run)}}``."""
    return {run.name: {"slowest": slowest(run, n), "cached_vs_cold": cached_vs_cold(run)} for run in runs}


def tail_lines(tail: dict[str, dict]) -> list[str]:
    """Plain-text lines for the terminal: each configuration's slowest requests and its check."""
    ms = lambda v: "n/a" if v is None else f"{v * 1e3:.0f}"  # noqa: E731
    lines = []
    for name, t in tail.items():
        lines.append(f"{name}: slowest requests (ms: TTFT = queue + load + prefill; prompt tokens by source)")
        for b in t["slowest"]:
            mix = " ".join(f"{k} {v}" for k, v in b["tier_mix"].items() if v)
            lines.append(f"  {b['session_id']} turn {b['turn']} at {b['arrival_s']:.1f} s: {ms(b['ttft_s'])} = "
                         f"{ms(b['queue_wait_s'])} + {ms(b['load_wait_s'])} + {ms(b['prefill_s'])}; "
                         f"{b['input_tokens']} tokens ({mix})"
                         + (f"; preempted {b['preemptions']}x" if b.get("preemptions") else ""))
        c = t["cached_vs_cold"]
        lines.append(f"  >=90%-cached requests above the p90 TTFT of cold first turns of similar length: "
                     f"{len(c['violations'])} of {c['checked']} checked ({c['no_reference']} without "
                     f"{c['min_cold']}+ cold first turns to compare with)")
    return lines
