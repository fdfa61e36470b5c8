"""perf/preemption_anatomy.py counts, from the scheduler's and pool's own calls, where a
preemption's cost goes; in the simulator (``--sim``) on a small built-in workload its counts
agree with each other and with the run's own counter."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_counts_agree_with_each_other(tmp_path):
    out = tmp_path / "anatomy.json"
    proc = subprocess.run([sys.executable, "perf/preemption_anatomy.py", "--sim", "--sessions", "4", "--concurrency", "4",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["steps"] > 0 and doc["requests_with_tpot"] > 0
    assert doc["preemptions"] == sum(int(k) * v for k, v in doc["preemptions_per_step"].items())
    assert sum(doc["preemptions_per_step"].values()) >= doc["steps"]
    assert doc["thrash"] <= doc["preemptions"] and doc["preempted_decodes"] <= doc["preemptions"]
    assert doc["resumes"] <= doc["preemptions"]
    for share in ("schedule_share", "evict_share", "inline_share"):
        assert 0.0 <= doc[share] <= 1.0
    slowest = [r["tpot_s"] for r in doc["slowest_tpot"]]
    assert slowest == sorted(slowest, reverse=True) and doc["p99_set"] == doc["slowest_tpot"][:len(doc["p99_set"])]
    assert doc["tpot_p99_s"] <= slowest[0] + 1e-4
    for r in doc["slowest_tpot"]:
        assert 0.0 <= r["waited_share"] <= 1.0 and (r["preempted_after_first"] or r["waited_preempted_s"] == 0.0)
