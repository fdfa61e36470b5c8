"""The kernel benchmarks (perf/bench_mla.py, perf/bench_moe.py, perf/bench_linear.py) run end to end in their dry mode
(tiny CPU shapes, the same code paths, the GPU shape list built too) and reject bad arguments;
perf/gpu_check.sh parses. Their GPU runs happen in perf/gpu_check.sh on a GPU machine."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_bench_mla_dry_run(tmp_path):
    proc = _run("perf/bench_mla.py", "--dry-run", "--csv", str(tmp_path / "mla.csv"), "--summary",
                str(tmp_path / "mla.md"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "mla.csv")))
    assert {r["op"] for r in rows} == {"mla_decode", "mla_extend"}
    assert all(float(r["median_us"]) > 0 and float(r["pct_copy_bw"]) > 0 for r in rows)
    assert "% copy BW" in (tmp_path / "mla.md").read_text()


def test_bench_moe_dry_run():
    proc = _run("perf/bench_moe.py", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ops = {r["op"] for r in csv.DictReader(io.StringIO(proc.stdout))}
    assert ops == {"moe_route", "moe_align_block_size", "fused_moe", "fused_moe_w4a16", "fused_moe_fp8_block", "sample",
                   "gather_pages"}


def test_bench_linear_dry_run():
    proc = _run("perf/bench_linear.py", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert {r["op"] for r in rows} == {"linear_fp8_block", "linear_w4a16", "linear_bf16"}
    assert all(float(r["median_us"]) > 0 and r["pct_hbm_peak"] == "" for r in rows)  # no peaks for a CPU


def test_peak_fractions_against_the_h200_datasheet():
    sys.path.insert(0, str(ROOT / "perf"))
    try:
        import timing
    finally:
        sys.path.remove(str(ROOT / "perf"))
    h200 = timing.device_peaks("NVIDIA H200")
    assert h200 is not None and h200.name == "H200" and timing.device_peaks("cpu") is None
    # 4.8 GB in 2 ms = 2.4 TB/s = 50% of 4.8 TB/s; 989 GFLOP in 2 ms = 494.5 TFLOP/s = 50% of bf16, 25% of fp8
    got = timing.peak_fractions(h200, 2000.0, 4.8e9, 989e9, "bf16")
    assert got == {"pct_hbm_peak": "50.0", "pct_matrix_peak": "50.0"}
    assert timing.peak_fractions(h200, 2000.0, 4.8e9, 989e9, "fp8")["pct_matrix_peak"] == "25.0"
    assert timing.peak_fractions(h200, 2000.0, 4.8e9, 0, "fp8")["pct_matrix_peak"] == ""


@pytest.mark.parametrize("script", ["perf/bench_mla.py", "perf/bench_moe.py", "perf/bench_linear.py"])
def test_bench_skips_an_unavailable_backend_with_the_reason(script):
    proc = _run(script, "--dry-run", "--backends", "aiter", "torch", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skip" in proc.stderr and "'aiter' is unavailable" in proc.stderr
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert rows and {r["backend"] for r in rows} == {"torch"}


def test_bench_mla_summary_compares_with_aiter():
    sys.path.insert(0, str(ROOT / "perf"))
    try:
        import bench_mla
    finally:
        sys.path.remove(str(ROOT / "perf"))
    row = {"op": "mla_decode", "shape": "b1-h64-ctx4096-p64", "dtype": "q:bfloat16;kv:bfloat16", "gb_s": 1.0,
           "pct_copy_bw": 1.0, "tflop_s": 1.0}
    rows = [dict(row, resolved_backend="triton", median_us=20.0), dict(row, resolved_backend="aiter", median_us=30.0),
            dict(row, shape="b8-h64-ctx4096-p64", resolved_backend="triton", median_us=50.0)]
    lines = bench_mla.summary_markdown(rows, 4000.0).splitlines()
    assert lines[2].endswith("| aiter µs / this |")
    assert lines[4].endswith("| 1.50 |") and lines[5].endswith("| 1.00 |") and lines[6].endswith("|  |")


@pytest.mark.parametrize("script", ["perf/bench_mla.py", "perf/bench_moe.py", "perf/bench_linear.py"])
@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--budget-s", "-1"], ["--backends", "cuda"]])
def test_bench_rejects_bad_arguments(script, bad):
    proc = _run(script, "--dry-run", *bad)
    assert proc.returncode == 2 and "error" in proc.stderr


def test_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "perf" / "gpu_check.sh")]).returncode == 0
