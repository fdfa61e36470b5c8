"""perf/sim_tail.py re-enacts a bench run in the simulator with the CPU costs saved by
perf/sim_agreement.py, and perf/tail_report.py explains the file it writes, as it does a real
``kvtier bench --json-records`` file."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_sim_tail_writes_records_that_tail_report_explains(tmp_path):
    out = tmp_path / "sim.json"
    proc = _run("perf/sim_tail.py", "--sessions", "3", "--concurrency", "2", "--slowest", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert set(doc["configs"]) == {"device-only", "tiered"} and doc["provenance"]["simulated"] is True
    records = doc["configs"]["tiered"]["records"]
    assert len(records) == doc["configs"]["tiered"]["requests"] > 0
    assert all(r["first_token_s"] >= r["arrival_s"] and r["preemptions"] >= 0 for r in records)
    report = _run("perf/tail_report.py", str(out), "--slowest", "2")
    assert report.returncode == 0, report.stderr
    assert report.stdout == proc.stdout  # the same explanation, printed from the file alone
    assert "tiered: slowest requests" in report.stdout and "tiered vs device-only: p99 TTFT" in report.stdout


def test_sim_tail_names_a_costs_file_without_costs(tmp_path):
    bad = tmp_path / "costs.json"
    bad.write_text("{}")
    proc = _run("perf/sim_tail.py", "--costs", str(bad))
    assert proc.returncode != 0 and "no 'costs' table" in proc.stderr and "Traceback" not in proc.stderr


def test_resume_slo_counts_the_same_resumes_under_both_policies_per_draw(tmp_path):
    out = tmp_path / "resume.json"
    proc = _run("perf/resume_slo.py", "--sessions", "3", "--concurrency", "2", "--max-turns", "4", "--repeat", "2",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert [r["seed"] for r in doc["repeats"]] == [0, 1]
    for rep in doc["repeats"]:
        lru, ta = rep["runs"]
        assert (lru["policy"], ta["policy"]) == ("lru", "tool-aware")
        assert lru["resumes"] == ta["resumes"] > 0  # one workload draw, replayed by each policy
        for r in (lru, ta):
            assert 0 <= sum(r["misses"].values()) <= r["resumes"] and r["requests"] > r["resumes"]
    assert "over all draws" in proc.stdout
