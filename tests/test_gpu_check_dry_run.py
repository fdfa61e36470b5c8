"""``bash perf/gpu_check.sh --dry-run`` runs every step of the GPU check at CPU sizes (no build;
the serving step on the tiny preset with CPU streams) and writes its summary."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_dry_run_passes_and_summarises_serving(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "perf" / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = (tmp_path / "gpu_check_summary.md").read_text()
    assert "status ok" in summary
    assert "Copy path vs pinned host<->device bandwidth" in summary
    for config in ("| device-only |", "| tiered |"):
        assert config in summary
    assert (tmp_path / "bench_serving.json").is_file() and (tmp_path / "bench_copy_path.csv").is_file()
