"""Shared helpers of the perf/ scripts: warm up once then take the median of repeated runs;
append result rows to a CSV file."""

from __future__ import annotations

import csv
import statistics
import time
from collections.abc import Callable


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time in seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def append_csv(path: str, rows: list[dict]) -> None:
    """Append ``rows`` to the CSV file at ``path``, writing the header when the file is new or empty."""
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if f.tell() == 0:
            w.writeheader()
        w.writerows(rows)
