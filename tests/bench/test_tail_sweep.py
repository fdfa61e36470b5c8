"""Per-request TTFT parts, the tail report, and the latency-load sweep's numbers and plot."""

import json

import numpy as np
import pytest

from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.report import bench_json, summarize
from kvtier.bench.run import BenchOptions, at_load
from kvtier.bench.sweep import goodput, parse_loads, plot_sweep, sweep_json, sweep_lines
from kvtier.bench.tail import cached_vs_cold, slowest, tail_lines
from kvtier.cli import main


def rec(i, ttft, inp=100, cached=0, turn=0, queue=0.0, load=0.0, tier="host"):
    """Request ``i`` arriving at ``i`` s: ``queue`` s to admission, ``load`` s of loads, the rest prefill."""
    return RequestRecord(session_id=f"s{i}", turn=turn, input_tokens=inp, output_tokens=2, arrival_s=float(i),
                         first_token_s=i + ttft, finish_s=i + ttft + 0.1, cached_tokens=cached,
                         cached_tokens_by_tier={"device": 0, "host": 0, "disk": 0} | {tier: cached},
                         admitted_s=i + queue, loaded_s=i + queue + load)


def test_ttft_parts_add_up_and_tier_mix_counts_every_prompt_token():
    r = rec(3, 0.9, inp=120, cached=100, queue=0.5, load=0.1)
    assert r.queue_wait_s + r.load_wait_s + r.prefill_s == pytest.approx(r.ttft_s)
    assert (r.queue_wait_s, r.load_wait_s, r.prefill_s) == pytest.approx((0.5, 0.1, 0.3))
    assert r.tier_mix == {"device": 0, "host": 100, "disk": 0, "computed": 20}
    unknown = RequestRecord("s", 0, 10, 1, 0.0, 1.0, 1.0, 0)
    assert unknown.queue_wait_s is None and unknown.load_wait_s is None and unknown.prefill_s is None


def test_summary_has_percentiles_of_each_part_and_json_can_carry_the_records():
    recs = [rec(i, 1.0 + i, queue=0.1 * i, load=0.01 * i) for i in range(10)]
    run = ConfigRun("tiered", recs, wall_s=20.0)
    s = summarize(run)
    assert s["queue_wait_s"]["p99"] == pytest.approx(np.percentile([0.1 * i for i in range(10)], 99))
    assert s["load_wait_s"]["p50"] == pytest.approx(0.045)
    assert "records" not in bench_json([run], {})["configs"]["tiered"]
    rows = json.loads(json.dumps(bench_json([run], {}, records=True)))["configs"]["tiered"]["records"]
    assert len(rows) == 10 and rows[3]["queue_wait_s"] == pytest.approx(0.3)
    assert rows[3]["ttft_s"] == pytest.approx(4.0) and rows[3]["tier_mix"]["computed"] == 100


def test_slowest_lists_the_highest_ttfts_with_their_parts():
    recs = [rec(i, t, queue=t / 2) for i, t in enumerate([0.2, 3.0, 0.1, 5.0, 1.0])]
    recs[3].preemptions, recs[1].preemptions = 2, 0
    run = ConfigRun("x", recs, wall_s=9.0)
    top = slowest(run, n=2)
    assert [b["session_id"] for b in top] == ["s3", "s1"]
    assert top[0]["queue_wait_s"] == pytest.approx(2.5) and top[0]["ttft_s"] == pytest.approx(5.0)
    assert [b["preemptions"] for b in top] == [2, 0]
    lines = tail_lines({"x": {"slowest": top, "cached_vs_cold": cached_vs_cold(run)}})
    assert "s3 turn 0 at 3.0 s: 5000 = 2500 + 0 + 2500" in lines[1] and lines[1].endswith("; preempted 2x")
    assert "preempted" not in lines[2]


def test_cached_vs_cold_flags_a_cached_request_slower_than_cold_first_turns_of_its_size():
    cold = [rec(i, t, inp=1000) for i, t in enumerate([1.0, 2.0, 3.0, 4.0])]  # p90 = 3.7
    fast = rec(10, 0.5, inp=1200, cached=1150, turn=3)
    slow = rec(11, 3.8, inp=900, cached=890, turn=2)
    half = rec(12, 9.0, inp=1000, cached=500, turn=1)  # < 90% cached: not judged
    far = rec(13, 9.0, inp=5000, cached=4900, turn=1)  # no cold turn within 2x of its length
    c = cached_vs_cold(ConfigRun("x", [*cold, fast, slow, half, far], wall_s=20.0))
    assert c["checked"] == 2 and c["no_reference"] == 1 and c["cold_first_turns"] == 4
    assert [v["session_id"] for v in c["violations"]] == ["s11"]
    assert c["violations"][0]["cold_p90_s"] == pytest.approx(np.percentile([1.0, 2.0, 3.0, 4.0], 90))


def _points():
    def run(name, ttfts, wall):
        return ConfigRun(name, [rec(i, t) for i, t in enumerate(ttfts)], wall_s=wall)
    return [(0.5, [run("device-only", [1.0, 1.2], 10.0), run("tiered", [0.2, 0.3], 10.0)]),
            (2.0, [run("device-only", [4.0, 6.0], 5.0), run("tiered", [0.5, 0.9], 4.0)])]


def test_sweep_reports_each_load_and_goodput_under_the_slo(tmp_path):
    data = json.loads(json.dumps(sweep_json(_points(), ttft_slo_s=2.0)))
    assert data["loads"] == [0.5, 2.0]
    assert [r["load"] for r in data["configs"]["tiered"]] == [0.5, 2.0]
    assert data["configs"]["tiered"][1]["throughput_tok_s"] == pytest.approx(2 * 102 / 4.0)
    assert data["goodput"]["device-only"] == {"load": 0.5, "throughput_tok_s": pytest.approx(2 * 102 / 10.0)}
    assert data["goodput"]["tiered"]["load"] == 2.0
    assert goodput(data["configs"]["device-only"], 0.1) is None
    assert any("goodput" in line and "load x0.5" in line for line in sweep_lines(data))
    png = plot_sweep(data, tmp_path / "load.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_factors_divide_think_times_and_their_cap():
    o = at_load(BenchOptions(time_scale=0.01, max_think_s=1.0), 4.0)
    assert (o.time_scale, o.max_think_s) == (0.0025, 0.25)
    assert parse_loads("2, 0.5,2") == (0.5, 2.0)
    for bad in ("", "0", "-1,2", "a", "inf"):
        with pytest.raises(ValueError, match="--load-sweep must be"):
            parse_loads(bad)


@pytest.mark.parametrize(("argv", "message"), [
    (["--ttft-slo", "1"], "--ttft-slo needs --load-sweep"),
    (["--load-sweep", "1,2", "--ttft-slo", "-1"], "--ttft-slo needs --load-sweep and a finite number"),
    (["--json-records"], "--json-records adds the per-request records to --json PATH"),
])
def test_bench_flags_are_checked_before_anything_runs(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_schedule_policy_option_is_validated():
    with pytest.raises(ValueError, match="--schedule-policy must be one of cache-aware, fcfs, got 'sjf'"):
        BenchOptions(schedule_policy="sjf")
