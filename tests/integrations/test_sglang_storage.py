"""kvtier's HiCache storage backend driven by SGLang's own classes (tests/integrations/
sglang_conformance.py), run in SGLang's venv.

SGLang lives in an interpreter of its own (``scripts/setup_sglang.sh`` makes ``.sglang-venv``;
``scripts/test.sh`` installs it in the background; ``KVTIER_SGLANG_PYTHON`` names another). The
conformance file runs there under pytest with this checkout's ``python/`` on ``PYTHONPATH``; this
test is skipped with the reason when that interpreter cannot import SGLang's cache controller.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("KVTIER_SGLANG_PYTHON", str(ROOT / ".sglang-venv" / "bin" / "python"))
CONFORMANCE = ROOT / "tests" / "integrations" / "sglang_conformance.py"


def _sglang_missing() -> str | None:
    if not Path(PYTHON).exists():
        return f"no SGLang interpreter at {PYTHON} (run scripts/setup_sglang.sh, or set KVTIER_SGLANG_PYTHON)"
    probe = "import pytest; from sglang.srt.managers.cache_controller import HiCacheController"
    r = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, timeout=300)
    return None if r.returncode == 0 else f"{PYTHON} cannot import SGLang's cache controller: {r.stderr.strip()[-300:]}"


_MISSING = _sglang_missing()
pytestmark = [pytest.mark.skip(reason=_MISSING)] if _MISSING else []


def test_conformance_with_sglang_classes(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)]),
           "OMP_NUM_THREADS": "1"}
    env.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", None)
    r = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                        "--basetemp", str(tmp_path / "t"), "-o", "addopts=", str(CONFORMANCE)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, f"SGLang conformance failed (rc {r.returncode}):\n{tail}"
    summary = re.search(r"(\d+) passed", r.stdout)
    assert summary is not None and int(summary.group(1)) >= 30, tail
    assert " failed" not in r.stdout.splitlines()[-1], tail
