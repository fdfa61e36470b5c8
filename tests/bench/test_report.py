"""Bench report: percentiles against numpy, None handling, the JSON shape, file checks, table, plot."""

import io
import json
import os
import stat

import numpy as np
import pytest
from rich.console import Console

from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.report import (bench_json, check_writable, plot_ttft, render_table, replay_progress,
                                 summarize, write_json)

SUMMARY_KEYS = {"ttft_s", "tpot_s", "e2e_s", "throughput_tok_s", "requests", "hit_tokens", "recomputed_tokens",
                "bytes_moved", "errors", "hit_rate", "input_tokens", "output_tokens", "wall_s", "preemptions",
                "evictions", "copy_errors", "stores_refused", "device_pages", "working_set_pages", "queue_wait_s",
                "load_wait_s", "prefill_s", "sections", "mean_running_batch"}


def rec(i, ttft, dur, out=5, inp=100, device=0, host=0, disk=0, arrival=None, error=None, finished=True):
    """A finished request with TTFT ``ttft`` s and ``dur`` s from first token to finish."""
    a = 0.25 * i if arrival is None else arrival
    first = None if ttft is None else a + ttft
    return RequestRecord(session_id=f"s{i}", turn=0, input_tokens=inp, output_tokens=out, arrival_s=a,
                         first_token_s=first, finish_s=(first + dur) if finished and first is not None else None,
                         cached_tokens=device + host + disk,
                         cached_tokens_by_tier={"device": device, "host": host, "disk": disk}, error=error)


# Odd spacing on purpose so that linear interpolation differs from nearest-rank.
TTFTS = [0.013, 0.4, 0.021, 1.7, 0.09, 0.0305, 0.25, 0.011, 3.1, 0.057, 0.66]
DURS = [0.5, 0.2, 0.9, 1.3, 0.05, 0.33, 0.71, 0.12, 2.2, 0.4, 0.6]
OUTS = [5, 17, 2, 54, 9, 3, 12, 97, 8, 6, 31]


def make_run(name="tiered", scale=1.0, wall_s=10.0):
    recs = [rec(i, t * scale, d, out=o, inp=100 + i, device=40, host=10 * (i % 3), disk=i % 2)
            for i, (t, d, o) in enumerate(zip(TTFTS, DURS, OUTS, strict=True))]
    return ConfigRun(name, recs, wall_s=wall_s, recomputed_tokens=321,
                     bytes_moved={"device->host": 3 * 2**20, "host->device": 1536, "host->disk": 0},
                     copy_errors=2, evictions={"device": 7, "host": 1}, preemptions=4, device_pages=48,
                     working_set_pages=96)


def test_percentiles_match_numpy_linear():
    run = make_run()
    s = summarize(run)
    e2e = [t + d for t, d in zip(TTFTS, DURS, strict=True)]
    tpot = [d / (o - 1) for d, o in zip(DURS, OUTS, strict=True)]
    for key, values, qs in (("ttft_s", TTFTS, (50, 90, 99)), ("tpot_s", tpot, (50, 99)), ("e2e_s", e2e, (50, 99))):
        for q in qs:
            want = np.percentile(values, q)  # numpy default: method="linear"
            assert s[key][f"p{q}"] == pytest.approx(want, rel=1e-12, abs=1e-12), (key, q)
    # Nearest-rank would give a sample; linear gives a point between two samples here.
    assert s["ttft_s"]["p90"] not in TTFTS


def test_token_counts_hit_rates_and_throughput():
    run = make_run(wall_s=8.0)
    s = summarize(run)
    inp = sum(100 + i for i in range(len(TTFTS)))
    host = sum(10 * (i % 3) for i in range(len(TTFTS)))
    disk = sum(i % 2 for i in range(len(TTFTS)))
    device = 40 * len(TTFTS)
    assert s["input_tokens"] == inp and s["output_tokens"] == sum(OUTS)
    assert s["hit_tokens"] == {"device": device, "host": host, "disk": disk}
    assert s["hit_rate"]["device"] == pytest.approx(device / inp)
    assert s["hit_rate"]["host"] == pytest.approx(host / inp)
    assert s["hit_rate"]["disk"] == pytest.approx(disk / inp)
    assert s["hit_rate"]["total"] == pytest.approx((device + host + disk) / inp)
    assert s["throughput_tok_s"] == pytest.approx((inp + sum(OUTS)) / 8.0)
    assert s["requests"] == len(TTFTS) and s["errors"] == 0
    assert (s["recomputed_tokens"], s["copy_errors"], s["preemptions"]) == (321, 2, 4)
    assert (s["device_pages"], s["working_set_pages"], s["wall_s"]) == (48, 96, 8.0)
    assert s["bytes_moved"] == run.bytes_moved and s["bytes_moved"] is not run.bytes_moved
    assert s["evictions"] == {"device": 7, "host": 1}


def test_unfinished_and_errored_requests_are_counted_but_not_measured():
    good = rec(0, 0.2, 0.3, out=4, inp=50, device=10)
    unfinished = rec(1, 0.1, 0.0, out=3, inp=70, device=70, finished=False)  # first token, no finish
    never_started = rec(2, None, 0.0, inp=80, finished=False)
    errored = rec(3, 0.01, 0.02, out=2, inp=90, host=90, error="copy failed")  # has a finish_s, but an error
    single = rec(4, 0.6, 0.0, out=1, inp=60, disk=30)  # one output token: no TPOT
    s = summarize(ConfigRun("x", [good, unfinished, never_started, errored, single], wall_s=2.0))
    assert s["requests"] == 5 and s["errors"] == 1
    assert s["ttft_s"]["p50"] == pytest.approx(np.percentile([0.2, 0.6], 50))
    assert s["tpot_s"] == {"p50": pytest.approx(0.1), "p99": pytest.approx(0.1)}  # only `good`
    assert s["e2e_s"]["p99"] == pytest.approx(np.percentile([0.5, 0.6], 99))
    assert s["input_tokens"] == 110 and s["output_tokens"] == 5
    assert s["hit_tokens"] == {"device": 10, "host": 0, "disk": 30}
    assert s["throughput_tok_s"] == pytest.approx(115 / 2.0)


def test_no_data_gives_none():
    s = summarize(ConfigRun("empty", [rec(0, None, 0.0, finished=False), rec(1, 0.1, 0.1, out=1, error="oom")],
                            wall_s=0.0))
    assert s["ttft_s"] == {"p50": None, "p90": None, "p99": None}
    assert s["tpot_s"] == {"p50": None, "p99": None} and s["e2e_s"] == {"p50": None, "p99": None}
    assert s["hit_rate"] == {"device": None, "host": None, "disk": None, "total": None}
    assert s["throughput_tok_s"] is None and s["input_tokens"] == 0 and s["errors"] == 1
    s = summarize(ConfigRun("nothing", [], wall_s=1.5))
    assert s["requests"] == 0 and s["throughput_tok_s"] == 0.0 and s["ttft_s"]["p99"] is None


def test_single_request_percentiles_equal_the_value():
    s = summarize(ConfigRun("one", [rec(0, 0.125, 0.5, out=3)], wall_s=1.0))
    assert s["ttft_s"] == {"p50": 0.125, "p90": 0.125, "p99": 0.125}
    assert s["tpot_s"]["p99"] == pytest.approx(0.25) and s["e2e_s"]["p50"] == pytest.approx(0.625)


@pytest.mark.parametrize("wall_s", [-1.0, float("nan"), float("inf")])
def test_bad_wall_time_is_rejected(wall_s):
    with pytest.raises(ValueError, match=r"'bad'.*wall_s"):
        summarize(ConfigRun("bad", [], wall_s=wall_s))


def test_bench_json_shape_and_comparison():
    base = make_run("device-only", scale=4.0, wall_s=20.0)
    tiered = make_run("tiered", scale=1.0, wall_s=10.0)
    prov = {"commit": "abc123", "machine": {"cpu_count": 3}, "timestamp": "2030-01-01T00:00:00Z", "model": "tiny"}
    data = bench_json([base, tiered], prov)
    assert set(data) == {"provenance", "configs", "comparison"}
    assert data["provenance"] == prov
    assert list(data["configs"]) == ["device-only", "tiered"]
    for s in data["configs"].values():
        assert set(s) == SUMMARY_KEYS
        assert s["sections"] == {}  # no counters beyond the blocks' (a hybrid model's: tests/bench/test_hybrid_bench.py)
        assert set(s["ttft_s"]) == {"p50", "p90", "p99"}
        assert set(s["tpot_s"]) == set(s["e2e_s"]) == {"p50", "p99"}
        assert set(s["hit_tokens"]) == {"device", "host", "disk"}
        assert set(s["hit_rate"]) == {"device", "host", "disk", "total"}
        assert set(s["bytes_moved"]) == {"device->host", "host->device", "host->disk"}
    assert data["configs"]["tiered"] == summarize(tiered)
    cmp = data["comparison"]
    assert set(cmp) == {"tiered"}
    assert cmp["tiered"]["ttft_p99_ratio"] == pytest.approx(4.0)
    assert cmp["tiered"]["throughput_ratio"] == pytest.approx(2.0)
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def test_bench_json_uses_the_provenance_helper_output():
    prov_mod = pytest.importorskip("kvtier.provenance")
    prov = prov_mod.provenance(model="tiny", trace="agent.jsonl")
    data = bench_json([make_run("tiered")], prov)
    assert {"commit", "machine", "timestamp", "model", "trace"} <= set(data["provenance"])
    assert "comparison" not in data  # no device-only run


def test_comparison_ratio_is_none_without_data_and_names_are_unique():
    empty = ConfigRun("tiered", [rec(0, None, 0.0, finished=False)], wall_s=0.0)
    data = bench_json([make_run("device-only"), empty], {})
    assert data["comparison"]["tiered"] == {"ttft_p99_ratio": None, "throughput_ratio": None}
    assert "comparison" not in bench_json([make_run("device-only")], {})
    with pytest.raises(ValueError, match=r"'tiered'.*more than once"):
        bench_json([make_run("tiered"), make_run("tiered")], {})


def test_write_json_is_atomic_and_round_trips(tmp_path):
    path = tmp_path / "bench.json"
    data = bench_json([make_run("device-only"), make_run("tiered", scale=0.5)], {"commit": None})
    check_writable(path)
    assert not path.exists()  # the check leaves nothing behind
    write_json(path, data)
    text = path.read_text()
    assert json.loads(text) == data and text.startswith('{\n  "provenance"')
    os.chmod(path, 0o640)
    write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and stat.S_IMODE(path.stat().st_mode) == 0o640
    with pytest.raises(ValueError):
        write_json(path, {"x": float("nan")})
    assert json.loads(path.read_text()) == {"a": 1}  # old content kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # no temp files left


def test_check_writable_keeps_an_existing_file(tmp_path):
    path = tmp_path / "old.json"
    path.write_text("keep")
    check_writable(path)
    assert path.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]


def test_check_writable_rejects_missing_parent_and_directory(tmp_path):
    missing = tmp_path / "no" / "such" / "out.json"
    with pytest.raises(ValueError, match="does not exist") as e:
        check_writable(missing)
    assert str(missing) in str(e.value) and not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match="not a regular file") as e:
        check_writable(tmp_path)
    assert str(tmp_path) in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses directory permissions, so the check cannot fail")
def test_check_writable_rejects_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable") as e:
            check_writable(ro / "out.json")
        assert str(ro / "out.json") in str(e.value)
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def render(runs, width=160):
    buf = io.StringIO()
    render_table(runs, Console(file=buf, width=width))
    return buf.getvalue()


def row(text, label):
    lines = [ln for ln in text.splitlines() if label in ln]
    assert len(lines) == 1, (label, lines)
    return lines[0]


def cells(text, label):
    return [c.strip() for c in row(text, label).split("\u2502")[1:-1]]


def test_table_has_configs_numbers_and_ratios():
    base, tiered = make_run("device-only", scale=4.0, wall_s=20.0), make_run("tiered", wall_s=10.0)
    text = render([base, tiered])
    assert "\x1b[" not in text  # plain text for CI logs
    assert "device-only" in text and "tiered" in text
    s = summarize(tiered)
    assert f"{s['ttft_s']['p99'] * 1e3:.1f}" in row(text, "TTFT p99 (ms)")
    assert f"{summarize(base)['ttft_s']['p99'] * 1e3:.1f}" in row(text, "TTFT p99 (ms)")
    assert f"{s['throughput_tok_s']:.1f}" in row(text, "throughput (tok/s)")
    assert f"{s['hit_rate']['total']:.1%}" in row(text, "hit rate total")
    assert "3.0 MiB" in row(text, "bytes moved device->host")
    assert "1.5 KiB" in row(text, "bytes moved host->device") and "0 B" in row(text, "bytes moved host->disk")
    assert "4.00x" in row(text, "TTFT p99 speedup vs device-only")
    assert "2.00x" in row(text, "throughput vs device-only")
    assert "11 (11)" in row(text, "requests (finished)")
    assert cells(text, "copy errors") == ["copy errors", "2", "2"]
    assert cells(text, "preemptions") == ["preemptions", "4", "4"]


def test_table_without_baseline_and_with_empty_run():
    empty = ConfigRun("[odd]-name", [rec(0, None, 0.0, finished=False)], wall_s=0.0)
    text = render([make_run("tiered"), empty])
    assert "[odd]-name" in text and "speedup" not in text
    assert "n/a" in row(text, "TTFT p50 (ms)") and "1 (0)" in row(text, "requests (finished)")


def test_plot_ttft_writes_png(tmp_path):
    runs = [make_run("device-only", scale=4.0), make_run("tiered"),
            ConfigRun("broken", [rec(0, None, 0.0, finished=False)], wall_s=1.0),
            ConfigRun("single", [rec(0, 0.05, 0.1)], wall_s=1.0)]
    out = plot_ttft(runs, tmp_path / "ttft.png")
    assert out == tmp_path / "ttft.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_ttft_with_no_data_still_writes_png(tmp_path):
    out = plot_ttft([ConfigRun("broken", [], wall_s=0.0)], tmp_path / "empty.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_leaves_pyplot_alone(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    before = plt.get_fignums()
    plot_ttft([make_run()], tmp_path / "p.png")
    assert plt.get_fignums() == before


def test_progress_prints_few_plain_lines_without_a_terminal():
    buf = io.StringIO()
    with replay_progress(250, "tiered", Console(file=buf, width=120)) as p:
        for i in range(250):
            p.advance()
            if i == 200:
                p.update_status("draining")
    lines = buf.getvalue().splitlines()
    assert 3 <= len(lines) <= 12 and "\x1b[" not in buf.getvalue()
    assert lines[0].startswith("tiered: 0/250 requests") and lines[-1].startswith("tiered: 250/250 requests (100%)")
    assert lines[-1].endswith("draining")


def test_progress_on_a_terminal_and_bad_total():
    buf = io.StringIO()
    with replay_progress(3, "device-only", Console(file=buf, force_terminal=True, width=100)) as p:
        p.advance(2)
        p.update_status("step 7")
        p.advance()
    assert "device-only" in buf.getvalue() and "3/3" in buf.getvalue()
    with pytest.raises(ValueError, match="total_requests"), replay_progress(-1, "x", Console(file=io.StringIO())):
        pass


def test_counters_a_client_cannot_see_are_not_reported_as_zero():
    # kvtier bench --endpoint sees only the responses: the server's copy errors, preemptions,
    # evictions, refused stores and device pages are unknown, not 0
    import dataclasses

    remote = dataclasses.replace(make_run("endpoint tiny"), server_counters=False)
    s = summarize(remote)
    assert s["copy_errors"] is None and s["preemptions"] is None and s["device_pages"] is None
    assert s["evictions"] is None and s["stores_refused"] is None
    assert s["working_set_pages"] == 96 and s["recomputed_tokens"] == 321  # known from the workload and usage
    text = render([make_run("tiered"), remote])
    assert cells(text, "copy errors") == ["copy errors", "2", "n/a"]
    assert cells(text, "preemptions") == ["preemptions", "4", "n/a"]
    assert cells(text, "stores refused host / disk")[-1] == "n/a"
    assert cells(text, "device pages / working set")[-1] == "n/a / 96"
    json.dumps(bench_json([remote], {}))  # null in the JSON


def test_a_new_section_of_the_pool_shows_up_in_the_json_table_and_repeat_lines():
    # a kind of cached object the bench has never heard of: its counters declare their series,
    # and the report walks them (what a third kind, e.g. sparse-attention indexer keys, would add)
    import dataclasses

    from kvtier.bench.repeat import repeat_lines, summarize_repeats
    from kvtier.cache.pool_stats import series

    @dataclasses.dataclass
    class IndexerStats:
        hits: dict = series("kvtier_indexer_hits", "indexer keys restored, by tier", "tier",
                            default_factory=lambda: {"device": 0, "host": 0})
        bytes_written: dict = series("kvtier_indexer_bytes_written", "indexer bytes written, by tier", "tier",
                                     default_factory=lambda: {"device": 0, "host": 0})
        dropped: int = series("kvtier_indexer_dropped", "indexer keys dropped", default=0)

    new = IndexerStats(hits={"device": 0, "host": 3}, bytes_written={"device": 4096, "host": 2048}, dropped=5)
    runs = [make_run("device-only"), dataclasses.replace(make_run("tiered"), sections={"indexer": new})]
    doc = bench_json(runs, {})
    got = doc["configs"]["tiered"]["sections"]["indexer"]
    assert got == {"hits": {"device": 0, "host": 3}, "bytes_written": {"device": 4096, "host": 2048}, "dropped": 5,
                   "hits_total": 3, "bytes_written_total": 2048}  # bytes below the device only
    assert doc["configs"]["device-only"]["sections"] == {}
    text = render(runs)
    assert cells(text, "indexer hits host") == ["indexer hits host", "n/a", "3"]
    assert cells(text, "indexer bytes_written device") == ["indexer bytes_written device", "n/a", "4.0 KiB"]
    assert cells(text, "indexer dropped") == ["indexer dropped", "n/a", "5"]
    assert "indexer hits device" not in text  # 0 in every run
    lines = repeat_lines(summarize_repeats([doc | {"seed": 0}]))
    assert any(line.startswith("indexer hits_total") and "3 [3-3]" in line and "n/a" in line for line in lines)
    assert any(line.startswith("indexer bytes_written_total (MiB)") for line in lines)
