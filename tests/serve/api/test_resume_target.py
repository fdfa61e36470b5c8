"""The resume target end to end: the pool's keep/prefetch outcome classifies a resume's miss
(evicted / prefetch late / queued / own prefill), and ``kvtier bench --endpoint`` reads the server's counts."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.bench.endpoint import resume_counters, resume_slo_delta
from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import CostModel
from kvtier.cache.pool import KVPool
from kvtier.serve.api.resume import miss_reason
from tests.helpers.pools import PS, Clock, run
from tests.helpers.resume_pools import make_pool
from tests.serve.api.conftest import start_server, stop_server


def _resume_reason(policy: str, host: bool, blocks: int, early_s: float) -> str | None:
    """One waiting session of ``blocks`` blocks under pressure, back ``early_s`` before its
    expected return (20 s), over an unmeetable target: what the pool kept or prefetched decides
    the reason."""
    pool = make_pool(policy, pages=8, target=1.0)
    if not host:  # a device-only pool: what is evicted is gone
        pool = KVPool(PoolConfig(page_size=PS, num_device_pages=8, cache_policy=policy), [torch.randn(8, PS, 8)],
                      CostModel(prefill_tok_s=1.0))
        pool.tiers.clock = Clock()
        pool.set_resume_target(1.0)
    n = blocks * PS
    run(pool, range(n), 0)
    run(pool, range(200, 200 + (8 - blocks) * PS), 3)  # the agent's pages are now the least recently used
    pool.tool_wait("agent", list(range(n)), expected_wait_s=20.0)
    pool.tiers.clock.now += 11.0  # past the TTL
    run(pool, range(100, 112), 1)  # pressure: 3 pages
    pool.tiers.clock.now += 9.0 - early_s
    pool.poll(wait=True)
    pool.tool_return("agent")
    back = run(pool, list(range(n)) + [5, 6], 2)
    tiers = dict(back.prefix_tokens_by_tier)
    return miss_reason(9.0, 1.0, n, back.num_tokens, sum(tiers.values()), tiers, PS)


@pytest.mark.parametrize("policy, host, blocks, early_s, why", [
    ("tool-aware", True, 3, 0.0, "queued"),  # kept on the device: the time went elsewhere
    ("tool-aware", True, 5, 0.0, "queued"),  # not kept, demoted, prefetched back before the return
    ("tool-aware", True, 5, 8.0, "prefetch_late"),  # back before its prefetch was due: loaded from host
    ("lru", True, 3, 0.0, "prefetch_late"),  # demoted to host, loaded when the turn came
    ("lru", False, 3, 0.0, "evicted"),  # no tier below: recomputed
])
def test_the_pool_outcome_classifies_the_miss(policy, host, blocks, early_s, why):
    assert _resume_reason(policy, host, blocks, early_s) == why


def test_resume_slo_delta():
    before = {"resumes": 2, "misses": {"evicted": 1, "prefetch_late": 0, "queued": 0, "prefill": 1}, "target_s": 0.5}
    after = {"resumes": 6, "misses": {"evicted": 1, "prefetch_late": 2, "queued": 1, "prefill": 2}, "target_s": 0.5}
    assert resume_slo_delta(before, after) == {"resumes": 4, "misses": {"evicted": 0, "prefetch_late": 2,
                                                                        "queued": 1, "prefill": 1}, "missed": 4,
                                               "target_s": 0.5}
    no_target = {"resumes": 3, "misses": dict.fromkeys(before["misses"], 0), "target_s": None}
    assert resume_slo_delta(no_target, {**no_target, "resumes": 5})["missed"] is None  # not counted, not 0
    assert resume_slo_delta(None, after) is None
    assert resume_counters("http://127.0.0.1:9") is None  # nothing listens there


def test_bench_reads_the_servers_resume_counts(tmp_path):
    s = start_server(tmp_path, "--num-device-pages", "512", "--resume-ttft-s", "0.000001",
                     "--cache-policy", "tool-aware")
    try:
        before = resume_counters(s.url)
        assert before == {"resumes": 0, "misses": {"evicted": 0, "prefetch_late": 0, "queued": 0, "prefill": 0},
                          "target_s": 0.000001}
        client = s.client()
        tools = [{"type": "function", "function": {"name": "ls", "parameters": {
            "type": "object", "properties": {"path": {"type": "string", "maxLength": 8}}, "required": ["path"]}}}]
        msgs = [{"role": "user", "content": "list the repository"}]
        kw = dict(model="tiny", tools=tools, temperature=0,
                  extra_body={"session_id": "bench-resume", "expected_tool_wait_s": 0.5})
        m = client.chat.completions.create(messages=msgs, tool_choice="required", max_tokens=48, **kw).choices[0].message
        assert m.tool_calls
        msgs += [m.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": c.id, "content": "a.py"} for c in m.tool_calls]
        client.chat.completions.create(messages=msgs, tool_choice="none", max_tokens=4, **kw)
        for _ in range(100):  # /metrics is a snapshot the engine thread refreshes every 0.2 s
            delta = resume_slo_delta(before, resume_counters(s.url))
            if delta["resumes"]:
                break
            time.sleep(0.1)
        assert delta["resumes"] == 1 and delta["missed"] == 1  # 1 us: every resume misses
    finally:
        stop_server(s)


def test_the_tool_wait_header_reaches_the_pool_on_every_api(tok_dir, monkeypatch):
    """``X-Expected-Tool-Wait-S`` declares the wait a turn's tools will take on the Messages and
    Responses APIs, as on chat (where the body field wins); a bad value is a 400 in each API's own
    shape naming the header, and the server goes on serving."""
    from fastapi.testclient import TestClient

    from kvtier.serve.api.server import make_app

    app = make_app("tiny", tokenizer=str(tok_dir), num_device_pages=256)
    pool = app.state.kvtier.worker.engine.pool
    told: list[tuple[str, float]] = []
    real = pool.tool_wait_blocks
    monkeypatch.setattr(pool, "tool_wait_blocks", lambda sid, hashes, s: (told.append((sid, s)), real(sid, hashes, s)))
    ls = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 8}}, "required": ["path"]}
    ask = {"role": "user", "content": "list the repository"}
    calls = {
        "/v1/messages": {"model": "tiny", "max_tokens": 48, "messages": [ask], "temperature": 0,
                         "tools": [{"name": "ls", "input_schema": ls}], "tool_choice": {"type": "any"}},
        "/v1/responses": {"model": "tiny", "max_output_tokens": 48, "input": [{"type": "message", **ask}],
                          "temperature": 0, "tools": [{"type": "function", "name": "ls", "parameters": ls}],
                          "tool_choice": "required"},
        "/v1/chat/completions": {"model": "tiny", "max_tokens": 48, "messages": [ask], "temperature": 0,
                                 "tools": [{"type": "function", "function": {"name": "ls", "parameters": ls}}],
                                 "tool_choice": "required", "expected_tool_wait_s": 2.5},
    }
    with TestClient(app) as client:
        for i, (path, body) in enumerate(calls.items()):
            headers = {"X-Session-Id": f"hint-{i}", "X-Expected-Tool-Wait-S": "7.5"}
            r = client.post(path, json=body, headers=headers)
            assert r.status_code == 200, r.text
            bad = client.post(path, json=body, headers={**headers, "X-Expected-Tool-Wait-S": "soon"})
            assert bad.status_code == 400
            err = bad.json()["error"]
            assert "X-Expected-Tool-Wait-S" in err["message"]
            if path == "/v1/messages":
                assert bad.json()["type"] == "error" and err["type"] == "invalid_request_error"
            else:
                assert err["param"] == "expected_tool_wait_s"
        for _ in range(200):  # each wait is told to the pool on the engine thread once its turn ends
            if len(told) == len(calls):
                break
            time.sleep(0.02)
        assert client.get("/health").status_code == 200
    assert told == [("hint-0", 7.5), ("hint-1", 7.5), ("hint-2", 2.5)]


def test_a_server_without_a_target_exposes_none(tmp_path):
    """Without ``--resume-ttft-s`` resumes are counted but misses are not: /metrics has no target,
    and a replay's delta says so (``missed`` None) rather than 0 misses."""
    s = start_server(tmp_path, "--num-device-pages", "256")
    try:
        got = resume_counters(s.url)
        assert got is not None and got["target_s"] is None and got["resumes"] == 0
        assert resume_slo_delta(got, got)["missed"] is None
    finally:
        stop_server(s)
