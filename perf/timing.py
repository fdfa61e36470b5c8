"""Shared helpers of the perf/ scripts: warm up once then take the median of repeated runs;
append result rows to a CSV file."""

from __future__ import annotations

import argparse
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


def add_kernel_bench_args(parser: argparse.ArgumentParser, default_backends: str) -> None:
    """The options the kernel benchmarks share: --repeats, --backends, --budget-s (seconds), --dry-run."""
    from kvtier.ops.dispatch import BACKENDS

    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--backends", nargs="+", choices=[b for b in BACKENDS if b != "auto"], default=None,
                        help=f"default: {default_backends} on a GPU, torch on CPU")
    parser.add_argument("--budget-s", type=float, default=None, help="skip the remaining cases after this")
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU shapes, torch backend, 2 repeats")


def parse_kernel_bench_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, then refuse --repeats < 1 and --budget-s <= 0 (argparse errors, exit 2)."""
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    return args
