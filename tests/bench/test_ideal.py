"""The bound: the ``ideal`` configuration (device pages for the whole working set) never evicts
and never preempts for lack of pages, in the bench and in the simulator, and every report gives
each configuration's distance to it."""

import io

import pytest
from rich.console import Console

from kvtier.bench.closed_loop import whole_working_set_pages
from kvtier.bench.configs import CONFIGS, IDEAL
from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.repeat import repeat_lines, summarize_repeats
from kvtier.bench.report import bench_json, bound_distance, render_table
from kvtier.bench.run import BenchOptions, run_all
from kvtier.bench.workload import Session, Turn, Workload
from kvtier.serve.config import EngineConfig
from kvtier.cache.config import PoolConfig
from kvtier.sim.run import SimOptions, run_scenario


def _workload(turns: list[Turn], block_size: int = 4) -> Workload:
    return Workload("w", "test", "test", block_size, 1.0, 1.0, 1.0, (Session("s0", tuple(turns)),))


def test_whole_working_set_counts_each_shared_prompt_page_once():
    # turn 1 repeats turn 0's three blocks and adds two: 5 distinct prompt pages at page_size 4
    t0 = Turn(input_tokens=12, output_tokens=5, block_ids=(1, 2, 3), think_time_s=0.0, stop="")
    t1 = Turn(input_tokens=20, output_tokens=1, block_ids=(1, 2, 3, 7, 8), think_time_s=0.0, stop="")
    outputs = (2 + 1) + (1 + 1)  # ceil(output / page_size) + 1 per turn
    assert whole_working_set_pages(_workload([t0, t1]), 4, concurrency=1) == 5 + outputs + 1 + 16
    # two blocks per page: pages (1,2), (3,) then (1,2), (3,7), (8,): 4 distinct chains
    assert whole_working_set_pages(_workload([t0, t1]), 8, concurrency=1) == 4 + (1 + 1) + (1 + 1) + 1 + 16
    # the same block after another prefix is another page (the pool chains its hashes)
    t2 = Turn(input_tokens=8, output_tokens=1, block_ids=(9, 2), think_time_s=0.0, stop="")
    assert whole_working_set_pages(_workload([t0, t2]), 4, concurrency=1) == 5 + (2 + 1) + (1 + 1) + 1 + 16
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        whole_working_set_pages(_workload([t0]), 0, concurrency=1)


def test_ideal_engine_config_takes_the_whole_working_set():
    base = EngineConfig(pool=PoolConfig(page_size=4, num_device_pages=100, state_device_bytes=1 << 20))
    cfg = CONFIGS[IDEAL].engine_config(base, 1 << 20, None, 0, whole_working_set_pages=5000)
    assert cfg.pool.num_device_pages == 5000 and cfg.pool.host_cache_bytes == 0 and cfg.pool.disk_cache_dir is None
    assert cfg.pool.enable_prefix_caching and cfg.pool.state_device_bytes is None
    assert cfg.max_num_seqs == base.max_num_seqs and cfg.schedule_policy == base.schedule_policy
    # the other configurations keep the bench's device tier
    assert CONFIGS["device-only"].engine_config(base, 0, None, 0, whole_working_set_pages=5000).pool.num_device_pages == 100
    with pytest.raises(ValueError, match="'ideal' needs whole_working_set_pages"):
        CONFIGS[IDEAL].engine_config(base, 0, None, 0)


def test_ideal_never_evicts_or_preempts_where_the_bench_tier_does():
    # a device tier of a tenth of the working set: device-only evicts and preempts; the bound does neither
    opts = BenchOptions(sessions=4, concurrency=3, max_turns=3, ramp_s=0.5, device_fraction=0.1,
                        configs="device-only,ideal")
    _, sizing, runs, _ = run_all(opts)
    device_only, ideal = runs
    assert sum(device_only.evictions.values()) > 0
    assert ideal.preemptions == 0 and sum(ideal.evictions.values()) == 0
    assert ideal.device_pages == sizing.whole_working_set_pages > device_only.device_pages == sizing.device_pages
    assert all(r.error is None for r in ideal.records) and len(ideal.records) == len(device_only.records)
    assert ideal.mean_running_batch is not None and 1 <= ideal.mean_running_batch <= opts.concurrency


def test_simulated_ideal_never_evicts_or_preempts():
    scn, _, sizing, runs, _ = run_scenario(SimOptions("tiny", configs="device-only,ideal", sessions=6, concurrency=6))
    by = {sr.run.name: sr.run for sr in runs}
    assert by["device-only"].preemptions + sum(by["device-only"].evictions.values()) > 0
    assert by[IDEAL].preemptions == 0 and sum(by[IDEAL].evictions.values()) == 0
    assert by[IDEAL].device_pages == sizing.whole_working_set_pages


def _run(name: str, ttfts: list[float], tpot_s: float, wall_s: float) -> ConfigRun:
    recs = [RequestRecord(f"s{i}", 0, input_tokens=100, output_tokens=11, arrival_s=0.0, first_token_s=t,
                          finish_s=t + 10 * tpot_s, cached_tokens=0,
                          cached_tokens_by_tier={"device": 0, "host": 0, "disk": 0}) for i, t in enumerate(ttfts)]
    return ConfigRun(name, recs, wall_s=wall_s)


def test_reports_lead_with_the_distance_to_the_bound():
    runs = [_run("device-only", [1.0, 4.0], 0.3, 20.0), _run("tiered", [1.0, 2.2], 0.2, 12.5),
            _run(IDEAL, [1.0, 2.0], 0.1, 10.0)]
    doc = bench_json(runs, {})
    s = doc["configs"]
    p99 = {n: s[n]["ttft_s"]["p99"] for n in s}
    assert doc["bound"]["tiered"]["ttft_p99"] == pytest.approx(p99["tiered"] / p99[IDEAL])
    assert doc["bound"]["tiered"]["tpot_p99"] == pytest.approx(2.0)
    assert doc["bound"]["tiered"]["throughput"] == pytest.approx(0.8)  # same tokens in 12.5 s vs 10 s
    assert doc["bound"]["device-only"] == bound_distance(s[IDEAL], s["device-only"]) and IDEAL not in doc["bound"]
    assert "bound" not in bench_json(runs[:2], {})  # no ideal run: no bound
    out = io.StringIO()
    render_table(runs, Console(file=out, width=200))
    text = out.getvalue()
    assert "TTFT p99 / ideal (bound)" in text and "throughput / ideal (bound)" in text
    assert text.index("/ ideal (bound)") < text.index("speedup vs device-only")
    summary = summarize_repeats([doc | {"seed": 0}, doc | {"seed": 1}])
    assert summary["bound"]["tiered"]["throughput"]["median"] == pytest.approx(0.8)
    lines = repeat_lines(summary)
    bound_line = next(i for i, line in enumerate(lines) if line.startswith("tiered vs ideal (bound)"))
    assert "p99 TPOT 2.00x" in lines[bound_line]
    assert bound_line < next(i for i, line in enumerate(lines) if line.startswith("tiered vs device-only"))
