"""Replay through the real engine: closed-loop timing, cache-independent results, CLI errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvtier.bench.configs import CONFIGS, parse_configs
from kvtier.bench.replay import replay, working_set_pages
from kvtier.bench.workload import Session, Turn, Workload
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.prefix_index import Tier
from kvtier.cli import main
from kvtier.llm import load_for_serving
from kvtier.serve import Engine, EngineConfig

PAGE = 4


@pytest.fixture(scope="module")
def model():
    return load_for_serving("tiny", seed=0)


def _session(name: str, first_id: int, lengths: list[int], think_s: float = 0.0, out: int = 3) -> Session:
    """Turns whose prompts extend each other block by block (ids first_id, first_id+1, ...)."""
    turns = []
    for k, n in enumerate(lengths):
        blocks = -(-n // PAGE)
        turns.append(Turn(n, out, tuple(range(first_id, first_id + blocks)), think_s if k else 0.0,
                          "tool_use" if k % 2 == 0 else "end_turn"))
    return Session(name, tuple(turns))


def _workload(sessions) -> Workload:
    return Workload("test", "test", "builtin", PAGE, 1.0, 1.0, float("inf"), tuple(sessions))


def _engine(model, *, device_pages: int, host_bytes: int = 0, disk_dir=None, caching=True, policy="lru",
            schedule_policy: str = "cache-aware") -> Engine:
    net, model_id = model
    cfg = EngineConfig.of(page_size=PAGE, num_device_pages=device_pages, max_num_batched_tokens=64,
                       enable_prefix_caching=caching, host_cache_bytes=host_bytes,
                       disk_cache_dir=None if disk_dir is None else str(disk_dir),
                       disk_cache_bytes=64 << 20 if disk_dir is not None else 0, cache_policy=policy,
                       write_policy="write-back", schedule_policy=schedule_policy)
    return Engine(net, cfg, model_id)


def test_closed_loop_think_times_and_order(model):
    wl = _workload([_session("a", 0, [9, 15, 22], think_s=0.05), _session("b", 1000, [7, 13], think_s=0.02)])
    run = replay(_engine(model, device_pages=64), wl, "device-only", concurrency=2)
    assert len(run.records) == 5 and not any(r.error for r in run.records)
    for sid, think in (("a", 0.05), ("b", 0.02)):
        recs = sorted((r for r in run.records if r.session_id == sid), key=lambda r: r.turn)
        assert [r.turn for r in recs] == list(range(len(recs)))
        for prev, cur in zip(recs, recs[1:]):
            assert cur.arrival_s >= prev.finish_s + think - 1e-3  # submitted think_time after the previous finish
        assert [r.output_tokens for r in recs] == [3] * len(recs)
    # the second turn of a session re-uses its first turn's full blocks from the device
    a1 = next(r for r in run.records if r.session_id == "a" and r.turn == 1)
    assert a1.cached_tokens == 8 and a1.cached_tokens_by_tier["device"] == 8
    for r in run.records:  # TTFT = queue wait + load wait + prefill, each part >= 0
        parts = (r.queue_wait_s, r.load_wait_s, r.prefill_s)
        assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(r.ttft_s, abs=1e-9)


def test_concurrency_bounds_active_sessions(model):
    wl = _workload([_session(f"s{i}", 100 * i, [6, 10]) for i in range(4)])
    run = replay(_engine(model, device_pages=64), wl, "device-only", concurrency=1)
    spans = sorted((min(r.arrival_s for r in run.records if r.session_id == s),
                    max(r.finish_s for r in run.records if r.session_id == s)) for s in ("s0", "s1", "s2", "s3"))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end  # one session at a time
    with pytest.raises(ValueError, match="concurrency"):
        replay(_engine(model, device_pages=64), wl, "x", concurrency=0)


def test_oversized_turn_is_an_error_record_and_the_session_goes_on(model):
    wl = _workload([_session("a", 0, [9, 400, 13])])
    run = replay(_engine(model, device_pages=16), wl, "device-only", concurrency=1)
    by_turn = {r.turn: r for r in run.records}
    assert "num_device_pages" in by_turn[1].error and by_turn[1].first_token_s is None
    assert by_turn[0].error is None and by_turn[2].error is None and by_turn[2].output_tokens == 3





def _all_tier_workloads() -> list[Workload]:
    # Phase 1: six sessions with long, shared-nothing contexts, interleaved: device pages hold
    # about one session and the host tier a couple, so returning turns find their blocks on host
    # and disk. Phase 2: one session alone, whose turns extend each other at once: its prefix is
    # still in device pages when the next turn comes, whatever the timing.
    return [_workload([_session(f"s{i}", 1000 * i, [41, 49, 57, 65], out=4) for i in range(6)]),
            _workload([_session("alone", 9000, [33, 37, 41], out=4)])]


# Tier sizes that give hits from every tier under each admission order: cache-aware admission
# serves the sessions whose prefixes are in device pages first, so it needs a smaller device tier.
@pytest.mark.parametrize(("schedule_policy", "device_pages", "host_blocks"), [("cache-aware", 28, 8), ("fcfs", 40, 24)])
def test_cache_never_changes_results(model, tmp_path, schedule_policy, device_pages, host_blocks):
    """Greedy fp32 outputs with hits from device, host and disk equal those of no caching,
    whatever the order requests are admitted in."""
    block_bytes = 3 * PAGE * model[0].config.kv_cache_dim * 4
    engine = _engine(model, device_pages=device_pages, host_bytes=host_blocks * block_bytes,
                     disk_dir=tmp_path / "disk", schedule_policy=schedule_policy)
    # A fixed cost model (alpha=0: observations change nothing) that always prefers loading, so
    # which tier serves a hit does not depend on how busy the machine is while the test runs.
    engine.pool.tiers.cost_model = CostModel(tiers={Tier.HOST: TierCost(1e-6, 1e10), Tier.DISK: TierCost(1e-5, 1e9)},
                                       prefill_tok_s=100.0, alpha=0.0)
    plain_engine = _engine(model, device_pages=40, caching=False)
    tiered, plain = [], []
    for wl, concurrency in zip(_all_tier_workloads(), (6, 1)):
        tiered.append(replay(engine, wl, "tiered", concurrency=concurrency, keep_outputs=True))
        plain.append(replay(plain_engine, wl, "no-cache", concurrency=concurrency, keep_outputs=True))
    records = [r for run in tiered for r in run.records]
    plain_records = [r for run in plain for r in run.records]
    hits = {t: sum(r.cached_tokens_by_tier[t] for r in records) for t in ("device", "host", "disk")}
    assert all(v > 0 for v in hits.values()), hits
    # a block credited to host or disk was really loaded from there (at least once)
    moved = tiered[-1].bytes_moved  # pool counters are cumulative over both phases
    assert hits["host"] // PAGE * block_bytes <= moved["host->device"]
    assert hits["disk"] // PAGE * block_bytes <= moved["disk->device"]
    assert tiered[-1].copy_errors == 0 and sum(r.cached_tokens for r in plain_records) == 0
    key = lambda r: (r.session_id, r.turn)  # noqa: E731
    for a, b in zip(sorted(records, key=key), sorted(plain_records, key=key), strict=True):
        assert key(a) == key(b) and a.error is None and b.error is None
        assert a.output_token_ids == b.output_token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert tiered[-1].recomputed_tokens < plain[-1].recomputed_tokens


def test_tool_aware_replay_tells_the_pool(model):
    wl = _workload([_session("a", 0, [9, 15, 22], think_s=0.02)])
    engine = _engine(model, device_pages=64, policy="tool-aware", host_bytes=1 << 20)
    calls = []
    orig_wait, orig_return = engine.pool.tool_wait, engine.pool.tool_return
    engine.pool.tool_wait = lambda sid, toks, w: (calls.append(("wait", sid, len(toks), w)), orig_wait(sid, toks, w))
    engine.pool.tool_return = lambda sid: (calls.append(("return", sid)), orig_return(sid))
    replay(engine, wl, "tiered-tool-aware", concurrency=1, tool_aware=True)
    waits = [c for c in calls if c[0] == "wait"]
    # turn 0 stopped on tool_use: one tool wait, with the first turn's prompt, then a return
    assert len(waits) == 1 and waits[0][1] == "a" and waits[0][2] == 9 and waits[0][3] > 0
    assert ("return", "a") in calls[calls.index(waits[0]):]


def test_working_set_pages():
    wl = _workload([_session("a", 0, [9, 30], out=2), _session("b", 100, [5], out=3), _session("c", 200, [17], out=3)])
    # peaks in pages of 4: a 8, b 2, c 5; two largest: 13
    assert working_set_pages(wl, PAGE, 2) == 13
    assert working_set_pages(wl, PAGE, 5) == 15


def test_parse_configs():
    assert [c.name for c in parse_configs("device-only, tiered")] == ["device-only", "tiered"]
    assert CONFIGS["tiered"].host and CONFIGS["tiered"].disk and not CONFIGS["device-only"].host
    for bad in ("", "tiered,bogus", "tiered,tiered"):
        with pytest.raises(ValueError, match="--configs"):
            parse_configs(bad)


def test_cli_unwritable_json_fails_before_the_run(tmp_path, capsys):
    rc = main(["bench", "--json", str(tmp_path / "missing" / "out.json"), "--plot", ""])
    assert rc == 2
    err = capsys.readouterr().err
    assert "out.json" in err and "device-only" not in err


def test_cli_bad_trace_names_the_file(tmp_path, capsys):
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n{"timestamp": 1,\n')
    rc = main(["bench", "--trace", str(bad), "--plot", ""])
    assert rc == 2
    err = capsys.readouterr().err
    assert "broken.jsonl" in err and "2" in err


def test_cli_end_to_end_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "ttft.png"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "--sessions", "2", "--concurrency", "2", "--max-turns", "2", "--token-scale", "0.015625",
                   "--json", str(out), "--plot", str(png)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    data = json.loads(out.read_text())
    for key in ("commit", "machine", "model", "backend", "workload", "token_scale", "time_scale"):
        assert key in data["provenance"]
    assert set(data["configs"]) == {"device-only", "tiered", "ideal"}  # the bound runs by default
    assert set(data["bound"]) == {"device-only", "tiered"}  # each read against it
    for cfg in data["configs"].values():
        assert cfg["requests"] == 4 and cfg["errors"] == 0
        assert set(cfg["ttft_s"]) == {"p50", "p90", "p99"} and cfg["ttft_s"]["p99"] > 0
        assert set(cfg["hit_tokens"]) == {"device", "host", "disk"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_disk_cache_dir_fails_before_the_run(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for bad in (tmp_path / "missing", not_a_dir):
        assert main(["bench", "--disk-cache-dir", str(bad), "--plot", ""]) == 2
        err = capsys.readouterr().err
        assert "--disk-cache-dir" in err and str(bad) in err


@pytest.mark.parametrize("text, words", [
    ("", ["empty.jsonl", "no requests"]),
    ("\n\n", ["empty.jsonl", "no requests"]),
])
def test_cli_empty_trace_names_the_file(tmp_path, capsys, text, words):
    (tmp_path / "empty.jsonl").write_text(text)
    assert main(["bench", "--trace", str(tmp_path / "empty.jsonl"), "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_null_api_time_is_a_trace_error(tmp_path):
    from kvtier.bench.workload import TraceError, load_trace
    reqs = [{"t": 0, "type": "n", "in": 130, "out": 5, "hash_ids": [1, 2], "stop": "tool_use", "api_time": None},
            {"t": 9, "type": "n", "in": 200, "out": 5, "hash_ids": [1, 2, 3], "stop": "end_turn"}]
    path = tmp_path / "trace_x.json"
    path.write_text(json.dumps({"id": "x", "block_size": 64, "requests": reqs}))
    with pytest.raises(TraceError, match="trace_x.json.*api_time"):
        load_trace(path)


def test_host_tier_budget_includes_padding():
    from kvtier.cache.host_tier import HostTier
    small = HostTier(96_000, 960, pin=False)  # small blocks are packed
    assert small.num_slots == 100
    big = HostTier(10 * 8192, 5000, pin=False)  # 5000 B blocks take 8192 B rows
    assert big.num_slots == 10 and big.slot(9).numel() == 5000
    assert big.slot(1).data_ptr() % 4096 == 0
    with pytest.raises(ValueError, match="host slot"):
        big.release(3)  # never allocated
