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
from tests.cache.test_resume_target import PS, make_pool
from tests.cache.test_tool_aware import Clock, run
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
    before = {"resumes": 2, "misses": {"evicted": 1, "prefetch_late": 0, "queued": 0, "prefill": 1}}
    after = {"resumes": 6, "misses": {"evicted": 1, "prefetch_late": 2, "queued": 1, "prefill": 2}}
    assert resume_slo_delta(before, after) == {"resumes": 4, "misses": {"evicted": 0, "prefetch_late": 2,
                                                                        "queued": 1, "prefill": 1}, "missed": 4}
    assert resume_slo_delta(None, after) is None
    assert resume_counters("http://127.0.0.1:9") is None  # nothing listens there


def test_bench_reads_the_servers_resume_counts(tmp_path):
    s = start_server(tmp_path, "--num-device-pages", "512", "--resume-ttft-s", "0.000001",
                     "--cache-policy", "tool-aware")
    try:
        before = resume_counters(s.url)
        assert before == {"resumes": 0, "misses": {"evicted": 0, "prefetch_late": 0, "queued": 0, "prefill": 0}}
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
