"""Shared helpers of the perf/ scripts: warm up once then take the median of repeated runs;
append result rows to a CSV file; stop a server a script started."""

from __future__ import annotations

import argparse
import csv
import os
import signal
import statistics
import subprocess
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


def device_peaks(device_name: str):
    """The datasheet accelerator of :mod:`kvtier.sim.hardware` whose name (``"H200"``,
    ``"MI355X"``) appears in ``device_name`` (``torch.cuda.get_device_name``), or None."""
    from kvtier.sim.hardware import ACCELERATORS

    return next((a for a in ACCELERATORS.values() if a.name.lower() in device_name.lower()), None)


def peak_fractions(peaks, median_us: float, nbytes: float, flops: float, compute: str | None) -> dict:
    """``pct_hbm_peak`` (``nbytes`` per second over the HBM peak) and ``pct_matrix_peak``
    (``flops`` per second over the dense ``compute`` = "bf16"/"fp8" matrix peak), in %, as strings;
    blank where ``peaks`` is None (an unknown device) or there are no FLOPs."""
    if peaks is None:
        return {"pct_hbm_peak": "", "pct_matrix_peak": ""}
    seconds = median_us * 1e-6
    matrix = {"bf16": peaks.bf16_flops, "fp8": peaks.fp8_flops}.get(compute or "")
    return {"pct_hbm_peak": f"{100 * nbytes / seconds / peaks.hbm_Bps:.1f}",
            "pct_matrix_peak": f"{100 * flops / seconds / matrix:.1f}" if flops and matrix else ""}


def stop_process_group(proc: subprocess.Popen, wait_s: float = 60.0) -> None:
    """Stop a server started with ``start_new_session=True``: SIGTERM to its process group (by the
    PID it was started with), SIGKILL after ``wait_s`` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
