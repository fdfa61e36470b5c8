"""``kvtier bench --model tiny-k3``: the hybrid preset runs every configuration, device-only
(MLA blocks in device pages, recurrent-state checkpoints in device slots) and tiered (+ host and
disk for both), and reports its checkpoint counters; its checkpoint options are refused cleanly
before any configuration runs."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from kvtier.bench import report
from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.repeat import repeat_lines, summarize_repeats
from kvtier.cache.checkpoints.index import StateStats
from kvtier.cli import main


def _bench(argv: list[str]) -> int:
    threads = torch.get_num_threads()  # the bench sets its own (--threads, default 1)
    try:
        return main(["bench", "--model", "tiny-k3", "--plot", "", *argv])
    finally:
        torch.set_num_threads(threads)


def test_bench_tiny_k3_runs_device_only_and_tiered_with_checkpoints(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = _bench(["--sessions", "2", "--concurrency", "2", "--max-turns", "2", "--configs", "device-only,tiered",
                 "--json", str(out), "--json-records"])
    assert rc == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert list(data["configs"]) == ["device-only", "tiered"]
    sizing = data["provenance"]["sizing"]
    assert sizing["checkpoint_bytes"] > 0 and sizing["checkpoint_tokens"] % sizing["page_size"] == 0
    for name, run in data["configs"].items():
        assert run["requests"] == 4 and run["errors"] == 0
        st = run["sections"]["state"]
        assert st["saved"]["turn"] >= 4  # every prompt end is saved as a turn-boundary checkpoint
        assert st["hits_total"] == sum(st["hits"].values())
        assert st["bytes_loaded_total"] == sum(st["bytes_loaded"].values())
        assert st["tokens_lost"] >= 0
        # exact hits only: a record's cached tokens are the prefix the pool placed, split by tier
        for r in run["records"]:
            assert r["cached_tokens"] == sum(r["cached_tokens_by_tier"].values()) <= r["input_tokens"]
        cached = sum(r["cached_tokens"] for r in run["records"])
        assert run["hit_rate"]["total"] == pytest.approx(cached / run["input_tokens"])
    device_only, tiered = (data["configs"][n]["sections"]["state"] for n in ("device-only", "tiered"))
    assert device_only["hits"]["host"] == device_only["hits"]["disk"] == 0  # no host or disk tier there
    assert device_only["fallbacks"] == 0  # nothing is loaded, so no load can fail
    assert device_only["bytes_written_total"] == 0 and device_only["bytes_written"]["device"] > 0
    assert tiered["bytes_written"]["host"] > 0  # device slots are few: checkpoints go down as they are evicted
    for label in ("state saved turn", "state bytes_written host", "state tokens_lost", "state fallbacks"):
        assert label in printed
    assert "hybrid model:" in printed and "checkpoints at prompt and turn ends" in printed


@pytest.mark.parametrize(("argv", "expected"), [
    (["--token-scale", "0.25", "--state-checkpoint-tokens", "24"],
     "--state-checkpoint-tokens must be a positive multiple of the page size (16 tokens here"),
    (["--state-checkpoint-tokens", "0"], "--state-checkpoint-tokens must be a positive multiple of the page size"),
    (["--state-host-bytes", "1000"], "--state-host-bytes=1000 is smaller than one state checkpoint of model 'tiny-k3'"),
    (["--state-device-bytes", "1000"], "--state-device-bytes=1000 is smaller than one state checkpoint"),
    (["--state-disk-bytes", "-1"], "--state-disk-bytes must be >= 0 bytes"),
])
def test_bench_refuses_bad_state_options_before_running(capsys, argv, expected):
    assert _bench(["--sessions", "1", "--max-turns", "1", *argv]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err and "Traceback" not in captured.err, captured.err
    assert "requests (" not in captured.out  # no configuration ran


def test_state_options_are_refused_for_a_model_without_recurrent_state(capsys):
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "--model", "tiny", "--sessions", "1", "--max-turns", "1", "--plot", "",
                   "--state-host-bytes", "1048576"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 2
    assert "--state-host-bytes apply to hybrid KDA + MLA models only" in capsys.readouterr().err


def _run(name: str, state: StateStats | None) -> ConfigRun:
    r = RequestRecord("s0", 0, input_tokens=100, output_tokens=2, arrival_s=0.0, first_token_s=0.1, finish_s=0.2,
                      cached_tokens=64, cached_tokens_by_tier={"device": 0, "host": 64, "disk": 0})
    return ConfigRun(name, [r], wall_s=1.0, sections={} if state is None else {"state": state})


def test_state_counters_in_the_json_table_and_repeat_lines():
    st = StateStats()
    st.hits["host"], st.bytes_loaded["host"], st.bytes_written["host"], st.tokens_lost = 2, 2048, 4096, 37
    runs = [_run("device-only", StateStats()), _run("tiered", st)]
    doc = report.bench_json(runs, {})
    got = doc["configs"]["tiered"]["sections"]["state"]
    assert got["hits"]["host"] == 2 and got["hits_total"] == 2 and got["tokens_lost"] == 37
    assert got["bytes_loaded_total"] == 2048 and got["bytes_written_total"] == 4096
    text = io.StringIO()
    report.render_table(runs, Console(file=text, width=200))
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in text.getvalue().splitlines() if line.count("│") == 4}
    assert rows["state hits host"] == ["0", "2"] and rows["state bytes_loaded host"] == ["0 B", "2.0 KiB"]
    assert rows["state tokens_lost"] == ["0", "37"] and "state hits disk" not in rows  # 0 in every run
    lines = "\n".join(repeat_lines(summarize_repeats([doc | {"seed": 0}])))
    assert "state hits_total" in lines and "state tokens_lost" in lines and "state bytes_loaded_total (MiB)" in lines
    # a model without recurrent state: no state in the JSON, no state rows or lines
    k2 = [_run("device-only", None), _run("tiered", None)]
    doc = report.bench_json(k2, {})
    assert doc["configs"]["tiered"]["sections"] == {}
    text = io.StringIO()
    report.render_table(k2, Console(file=text, width=200))
    assert "state " not in text.getvalue()
    assert "state " not in "\n".join(repeat_lines(summarize_repeats([doc | {"seed": 0}])))
