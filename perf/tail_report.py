"""Explain the TTFT tail of a `kvtier bench --json PATH --json-records` file, from the file alone.

A `kvtier bench --repeat N --json PATH` file first gets its summary: each figure's median
[min-max] over the repeats and the p99 TTFT ratio's (``kvtier.bench.repeat``); then, with
``--each``, every repeat as below (its records are needed for the slowest requests).

For each configuration: TTFT p50/p90/p99, throughput, the ratios against device-only, the
slowest requests with their TTFT parts (queue wait, load wait, prefill) and tier mix, and the
check that no request with >= 90% of its prompt cached has a TTFT above the p90 of cold first
turns of similar length (``kvtier.bench.tail.cached_vs_cold``).

    python perf/tail_report.py bench.json [--slowest 5] [--each]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.repeat import repeat_lines, summarize_repeats
from kvtier.bench.tail import tail_json, tail_lines

_FIELDS = {f.name for f in dataclasses.fields(RequestRecord)}


def runs_from_json(doc: dict) -> list[ConfigRun]:
    """The runs of a ``--json-records`` document (records only; counters are not needed here).

    Raises:
        ValueError: a configuration without ``records`` (the file was written without
            ``--json-records``).
    """
    runs = []
    for name, cfg in doc["configs"].items():
        if "records" not in cfg:
            raise ValueError(f"configuration {name!r} has no records: write the file with --json-records")
        recs = [RequestRecord(**{k: v for k, v in r.items() if k in _FIELDS}) for r in cfg["records"]]
        runs.append(ConfigRun(name, recs, wall_s=cfg["wall_s"]))
    return runs


def report(doc: dict, slowest: int = 5) -> None:
    """Print the tail of a ``--json-records`` document (see the module docstring)."""
    for name, s in doc["configs"].items():
        t = s["ttft_s"]
        print(f"{name}: TTFT p50 {t['p50']:.2f} s, p90 {t['p90']:.2f} s, p99 {t['p99']:.2f} s; "
              f"{s['throughput_tok_s']:.0f} tok/s; {s['preemptions']} preemptions")
    for name, c in doc.get("comparison", {}).items():
        print(f"{name} vs device-only: p99 TTFT {c['ttft_p99_ratio']:.2f}x lower, throughput {c['throughput_ratio']:.2f}x")
    for line in tail_lines(tail_json(runs_from_json(doc), n=slowest)):
        print(line)


def report_repeats(doc: dict, slowest: int = 5, each: bool = False) -> None:
    """Print a ``--repeat`` document: the summary recomputed from its repeats (so a file whose
    summary was edited or cut is still read right), then with ``each`` every repeat's
    :func:`report` (needs ``--json-records``)."""
    for line in repeat_lines(summarize_repeats(doc["repeats"])):
        print(line)
    if each:
        for i, rep in enumerate(doc["repeats"]):
            print(f"--- repeat {i} (workload seed {rep.get('seed')})")
            report(rep, slowest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="a kvtier bench --json file written with --json-records, or with --repeat N")
    ap.add_argument("--slowest", type=int, default=5, help="slowest requests listed per configuration")
    ap.add_argument("--each", action="store_true", help="--repeat files: report every repeat too (needs records)")
    args = ap.parse_args()
    with open(args.json) as f:
        doc = json.load(f)
    if "repeats" in doc:
        report_repeats(doc, args.slowest, args.each)
    else:
        report(doc, args.slowest)


if __name__ == "__main__":
    main()
