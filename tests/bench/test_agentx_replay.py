"""The AgentX harness (PyPI ``agentx-harness``, AIPerf's ``weka_trace`` loader for kv-cache-tester
traces) replays real sessions against ``kvtier serve``: a bounded run with no errors whose own
reported cache hit rate is non-zero with a host tier. ``scripts/setup_agentx.sh`` makes
``.agentx-venv`` (``scripts/test.sh`` does); without it the replay test skips, saying so.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces" / "kv-cache-tester"
AIPERF = ROOT / ".agentx-venv" / "bin" / "aiperf"


def _replay_module():
    spec = importlib.util.spec_from_file_location("kv_cache_tester_replay", ROOT / "perf" / "kv_cache_tester_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(block_size=64, requests=None):
    return {"id": "t", "models": ["m"], "block_size": block_size, "hash_id_scope": "local", "tool_tokens": 640,
            "system_tokens": 128, "requests": requests, "totals": {"in": 1}}


def _request(t, n_in, n_out, hash_ids, think=1.0):
    return {"t": t, "type": "n", "model": "m", "in": n_in, "out": n_out, "hash_ids": hash_ids,
            "input_types": ["text"], "output_types": ["text"], "stop": "tool_use", "api_time": 2.0, "think_time": think}


def test_bounded_traces_scale_tokens_keep_hash_ids_and_cut_at_max_context(tmp_path):
    mod = _replay_module()
    src = tmp_path / "src"
    src.mkdir()
    reqs = [_request(0.0, 1000, 80, [1, 2]), _request(10.0, 2000, 9, [1, 2, 3], think=4.0),
            {"t": 12.0, "type": "subagent", "agent_id": "a", "requests": []},
            _request(20.0, 40000, 50, [1, 2, 3, 4]), _request(30.0, 1500, 5, [1])]
    (src / "trace_0001.json").write_text(json.dumps(_trace(requests=reqs)))
    (src / "trace_0002.json").write_text(json.dumps(_trace(requests=[_request(0.0, 90000, 1, [7])])))  # too long
    out = mod.bounded_traces(src, tmp_path / "dst", token_scale=1 / 8, max_context=4096, num_traces=1, time_scale=0.5)
    assert [p.name for p in out] == ["trace_0001.json"]
    trace = json.loads(out[0].read_text())
    assert trace["block_size"] == 8 and trace["tool_tokens"] == 80 and trace["system_tokens"] == 16
    assert "totals" not in trace
    got = [(r["in"], r["out"], r["hash_ids"], r["t"], r["think_time"]) for r in trace["requests"]]
    # the sub-agent entry is left out; the trace stops before its first request over 4096 tokens
    assert got == [(125, 10, [1, 2], 0.0, 0.5), (250, 2, [1, 2, 3], 5.0, 2.0)]
    with pytest.raises(ValueError, match="num_traces: only 1 traces"):
        mod.bounded_traces(src, tmp_path / "dst2", token_scale=1 / 8, max_context=4096, num_traces=2)
    with pytest.raises(ValueError, match="token_scale"):
        mod.bounded_traces(src, tmp_path / "dst3", token_scale=1 / 3, max_context=4096, num_traces=1)
    with pytest.raises(ValueError, match="time_scale"):
        mod.bounded_traces(src, tmp_path / "dst4", token_scale=1 / 8, max_context=4096, num_traces=1, time_scale=0)


@pytest.mark.skipif(not AIPERF.is_file(), reason="no AgentX harness: run scripts/setup_agentx.sh")
def test_agentx_bounded_replay_has_no_errors_and_hits_the_host_tier(tmp_path):
    if not any(TRACES.glob("*.json*")):
        pytest.skip(f"no kv-cache-tester traces at {TRACES}")
    out = tmp_path / "replay.json"
    cmd = [sys.executable, "perf/kv_cache_tester_replay.py", "--client", "agentx", "--aiperf", str(AIPERF),
           "--configs", "host", "--duration", "40", "--json", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())["results"]["host"]
    assert r["requests"] > 0 and r["errors"] == 0 and r["http_errors"] == 0, r
    assert r["hit_tokens"]["host"] > 0  # turns came back from the host tier
    assert r["client_cache_hit_rate"] > 0  # as the client itself reports it
