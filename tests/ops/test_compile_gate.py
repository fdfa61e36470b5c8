"""The ahead-of-time compile gate builds kernels for gfx950, gfx942 and sm_90 without a GPU.

The gate runs in a subprocess: it needs compiled (not interpreted) ``@triton.jit`` functions, and
this test process runs with ``TRITON_INTERPRET=1`` on CPU-only machines (tests/conftest.py).
The default run builds the MLA decode split kernel (4 K2 cases) for every target; ``-m slow`` runs the whole
gate (every registered kernel; about 30 s on two cores).
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "perf" / "compile_gate.py"
TARGETS = {"gfx950", "gfx942", "sm_90"}


def _run_gate(tmp_path, *args):
    proc = subprocess.run([sys.executable, str(GATE), "--out-dir", str(tmp_path), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    rows = list(csv.DictReader(open(tmp_path / "kernel_resources.csv")))
    return proc, rows


def test_gate_builds_mla_decode_for_every_target(tmp_path):
    proc, rows = _run_gate(tmp_path, "--kernels", "mla_decode_partial")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {r["target"] for r in rows} == TARGETS
    for r in rows:
        assert not r["error"], r
        assert int(r["vgprs"]) > 0 and (r["spill_bytes"] in ("", "0")), r
        if r["target"].startswith("gfx"):
            assert int(r["vgpr_spills"]) == 0 and int(r["vgprs"]) <= 512, r
        else:
            assert int(r["vgprs"]) <= 255, r
    md = (tmp_path / "kernel_resources.md").read_text()
    assert "| mla_decode_partial | h64-kvbf16 | gfx942 |" in md


def test_gate_reports_unknown_kernel(tmp_path):
    proc = subprocess.run([sys.executable, str(GATE), "--kernels", "no_such_kernel", "--no-write"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "unknown kernel" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_full_gate(tmp_path):
    proc, rows = _run_gate(tmp_path)
    assert {r["target"] for r in rows} == TARGETS
    assert proc.returncode == 0, proc.stdout[-5000:]


def test_gate_builds_fused_moe_gemm_without_spills(tmp_path):
    """The grouped GEMM at every K2 tile config and K3's SiTU latent-MoE shapes: gfx950 accepts its
    dot precision ("tf32" did not compile there) and sm_90 builds it without a stack frame
    (spills), as launched (aligned pointers, K2/K3 strides)."""
    proc, rows = _run_gate(tmp_path, "--kernels", "fused_moe_gemm", "--targets", "gfx950", "sm_90")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {r["target"] for r in rows} == {"gfx950", "sm_90"} and len(rows) == 24
    assert sum(r["case"].startswith("k3-w13") and r["case"].endswith("-situ") for r in rows) == 6
    for r in rows:
        assert not r["error"] and r["spill_bytes"] == "0", r


@pytest.mark.slow
def test_gate_builds_the_quantized_gemms_without_spills(tmp_path):
    """W4A16 and W8A8-FP8 GEMMs (fused-MoE w13/w2 and linear cases at every tile bucket) for every
    target: fp8e4b8 (e4m3fnuz) dots on gfx942, fp8e4nv on gfx950 and sm_90, no spills."""
    proc, rows = _run_gate(tmp_path, "--kernels", "w4a16_gemm", "fp8_block_gemm")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {r["target"] for r in rows} == TARGETS and {r["kernel"] for r in rows} == {"w4a16_gemm", "fp8_block_gemm"}
    for r in rows:
        assert not r["error"] and r["spill_bytes"] in ("0", ""), r


@pytest.mark.slow
def test_gate_builds_the_mxfp4_gemm_without_spills(tmp_path):
    """The MXFP4 GEMM at K3 shapes (latent-MoE w13 with SiTU, w2, a dense linear; every tile bucket):
    the tl.dot_scaled variant on gfx950, the register-decode variant on gfx942 and sm_90, no spills."""
    proc, rows = _run_gate(tmp_path, "--kernels", "mxfp4_gemm")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {r["target"] for r in rows} == TARGETS and len(rows) == 27
    for r in rows:
        assert not r["error"] and r["spill_bytes"] in ("0", ""), r
