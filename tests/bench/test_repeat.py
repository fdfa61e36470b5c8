"""``kvtier bench --repeat N``: each repeat draws its own workload (seed + i), the summary's
median and range are those of the per-repeat figures, and perf/tail_report.py reads the file."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.repeat import repeat_json, repeat_lines, repeat_seeds, spread, summarize_repeats
from kvtier.bench.report import bench_json
from kvtier.bench.run import BenchOptions
from kvtier.bench.workload import load_trace
from kvtier.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _run(name: str, ttfts: list[float], wall_s: float) -> ConfigRun:
    recs = [RequestRecord(f"s{i}", 0, input_tokens=100, output_tokens=3, arrival_s=0.0, first_token_s=t,
                          finish_s=t + 1.0, cached_tokens=0, cached_tokens_by_tier={"device": 0, "host": 0, "disk": 0})
            for i, t in enumerate(ttfts)]
    return ConfigRun(name, recs, wall_s=wall_s)


def _doc(seed: int, base: list[float], tiered: list[float], wall_s: float) -> dict:
    runs = [_run("device-only", base, wall_s), _run("tiered", tiered, wall_s / 2)]
    return bench_json(runs, {"workload": {"name": f"w{seed}", "sessions": len(base), "requests": len(base)}}) | {
        "seed": seed}


def test_summary_is_the_median_and_range_of_the_per_repeat_figures():
    rng = np.random.default_rng(3)
    draws = [{"device-only": list(rng.uniform(0.1, 5.0, 40)), "tiered": list(rng.uniform(0.05, 2.0, 40))}
             for _ in range(5)]
    docs = [_doc(s, d["device-only"], d["tiered"], 10.0 + s) for s, d in enumerate(draws)]
    summary = summarize_repeats(docs)
    assert summary["repeats"] == 5 and summary["seeds"] == [0, 1, 2, 3, 4]
    for name in ("device-only", "tiered"):
        p99 = [float(np.percentile(d[name], 99)) for d in draws]  # each repeat's own p99
        assert p99 == pytest.approx([d["configs"][name]["ttft_s"]["p99"] for d in docs])
        p99 = [d["configs"][name]["ttft_s"]["p99"] for d in docs]
        got = summary["configs"][name]["ttft_s.p99"]
        assert got == {"median": statistics.median(p99), "min": min(p99), "max": max(p99), "n": 5}
        tput = [d["configs"][name]["throughput_tok_s"] for d in docs]
        assert summary["configs"][name]["throughput_tok_s"]["median"] == pytest.approx(statistics.median(tput))
    ratios = [np.percentile(d["device-only"], 99) / np.percentile(d["tiered"], 99) for d in draws]
    r = summary["comparison"]["tiered"]["ttft_p99_ratio"]
    assert r["median"] == pytest.approx(statistics.median(ratios))
    assert (r["min"], r["max"]) == pytest.approx((min(ratios), max(ratios)))
    assert r["min"] < r["median"] < r["max"]  # the draws really differ
    # the ratio's median is the median of the ratios, not the ratio of the medians
    medians = summary["configs"]
    assert r["median"] != pytest.approx(medians["device-only"]["ttft_s.p99"]["median"]
                                        / medians["tiered"]["ttft_s.p99"]["median"])
    text = "\n".join(repeat_lines(summary))
    assert f"p99 TTFT ratio {r['median']:.2f}x [{r['min']:.2f}x-{r['max']:.2f}x]" in text
    assert "over 5 repeats" in text


def test_spread_of_an_even_count_missing_values_and_nothing():
    assert spread([4.0, None, 1.0, 3.0, 10.0]) == {"median": 3.5, "min": 1.0, "max": 10.0, "n": 4}
    assert spread([None, None]) is None
    with pytest.raises(ValueError, match="no repeats"):
        summarize_repeats([])


def test_repeat_seeds_and_bad_repeat():
    assert repeat_seeds(BenchOptions(seed=7), 3) == [7, 8, 9]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="--repeat must be an int >= 1"):
            repeat_seeds(BenchOptions(), bad)
    with pytest.raises(ValueError, match="workload_seed"):
        BenchOptions(workload_seed=-1)


def _trace_folder(tmp_path: Path, n: int) -> Path:
    for i in range(n):
        reqs = [{"t": 0, "type": "n", "in": 130 + i, "out": 5, "hash_ids": [1, 2], "stop": "tool_use", "api_time": 1.0},
                {"t": 9, "type": "n", "in": 200 + i, "out": 5, "hash_ids": [1, 2, 3], "stop": "end_turn"}]
        (tmp_path / f"trace_{i:02d}.json").write_text(json.dumps({"id": f"t{i:02d}", "block_size": 64,
                                                                  "requests": reqs}))
    return tmp_path


def test_trace_sessions_are_sampled_per_seed_in_source_order(tmp_path):
    folder = _trace_folder(tmp_path, 12)
    ids = {seed: [s.session_id for s in load_trace(folder, max_sessions=4, sample_seed=seed).sessions]
           for seed in range(6)}
    assert all(len(v) == 4 and len(set(v)) == 4 and v == sorted(v) for v in ids.values())
    assert len({tuple(v) for v in ids.values()}) > 1  # seeds draw different sessions
    assert ids[2] == [s.session_id for s in load_trace(folder, max_sessions=4, sample_seed=2).sessions]
    assert [s.session_id for s in load_trace(folder, max_sessions=4).sessions] == ["t00", "t01", "t02", "t03"]
    assert len(load_trace(folder, max_sessions=20, sample_seed=1).sessions) == 12  # fewer than asked: all


def test_cli_repeat_writes_every_repeat_and_the_summary_and_tail_report_reads_it(tmp_path, capsys):
    out = tmp_path / "repeat.json"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "--repeat", "2", "--sessions", "2", "--concurrency", "2", "--max-turns", "1",
                   "--time-scale", "0", "--ramp-s", "0", "--json", str(out), "--json-records"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    reps = doc["repeats"]
    assert [r["seed"] for r in reps] == [0, 1] and doc["summary"]["seeds"] == [0, 1]
    assert [r["provenance"]["workload"]["name"] for r in reps] == ["builtin-seed0", "builtin-seed1"]
    sessions = [{rec["session_id"] for rec in r["configs"]["tiered"]["records"]} for r in reps]
    assert sessions[0].isdisjoint(sessions[1])  # each repeat replayed its own draw
    assert doc["summary"] == summarize_repeats(reps) == repeat_json(reps)["summary"]
    for name in ("device-only", "tiered"):
        p50 = [r["configs"][name]["ttft_s"]["p50"] for r in reps]
        assert doc["summary"]["configs"][name]["ttft_s.p50"]["median"] == pytest.approx(statistics.median(p50))
    assert "median [min-max] over 2 repeats" in printed and "tiered vs device-only: p99 TTFT ratio" in printed
    proc = subprocess.run([sys.executable, "perf/tail_report.py", str(out), "--each", "--slowest", "1"], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "\n".join(repeat_lines(doc["summary"])) in proc.stdout
    assert proc.stdout.count("tiered: slowest requests") == 2 and "--- repeat 1 (workload seed 1)" in proc.stdout


def test_cli_repeat_refuses_a_sweep_an_endpoint_or_a_plot(capsys):
    for extra in (["--load-sweep", "1,2"], ["--endpoint", "http://127.0.0.1:9"], ["--plot", "x.png"]):
        assert main(["bench", "--repeat", "2", *extra]) == 2
        assert "--repeat" in capsys.readouterr().err
