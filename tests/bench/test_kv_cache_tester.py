"""kv-cache-tester's ``trace_replay_tester.py`` replays real sessions against ``kvtier serve``.

The client is fetched from GitHub at a pinned commit (``scripts/fetch_kv_cache_tester.sh DIR``)
and never kept in the repository; set ``KVTIER_KV_CACHE_TESTER=DIR`` to run this test. Without it
(CI reaches neither GitHub nor a package of it) the test skips, saying so.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces" / "kv-cache-tester"
TESTER = os.environ.get("KVTIER_KV_CACHE_TESTER")


@pytest.mark.slow
@pytest.mark.skipif(not TESTER, reason="set KVTIER_KV_CACHE_TESTER to a checkout made by "
                                       "scripts/fetch_kv_cache_tester.sh (it needs GitHub)")
def test_a_bounded_replay_has_no_errors_and_hits_the_host_tier(tmp_path):
    if not any(TRACES.glob("*.json")):
        pytest.skip(f"no kv-cache-tester traces at {TRACES}")
    out = tmp_path / "replay.json"
    cmd = [sys.executable, "perf/kv_cache_tester_replay.py", "--tester", TESTER, "--duration", "90",
           "--json", str(out)]
    if os.environ.get("KVTIER_KV_CACHE_TESTER_PYTHON"):
        cmd += ["--python", os.environ["KVTIER_KV_CACHE_TESTER_PYTHON"]]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    for name, r in results.items():
        assert r["requests"] > 0 and r["errors"] == 0 and r["http_errors"] == 0, (name, r)
    assert results["host"]["hit_tokens"]["host"] > 0  # turns came back from the host tier
    assert results["host"]["client_cache_hit_rate"] > 0  # as the client itself reports it
    assert results["device-only"]["hit_tokens"]["host"] == 0
