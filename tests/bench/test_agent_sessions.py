"""``kvtier bench --workload sdk-agents``: agent sessions through the official SDKs against
``kvtier serve tiny`` (one session of 3 turns per API), and the reuse arithmetic of its report
(reachable tokens, ratios, the summary) checked row by row."""

from __future__ import annotations

import json

import pytest

from kvtier.bench.agent_reuse import annotate, reachable_tokens, shared_prefix_tokens, summarize
from kvtier.bench.agent_sessions import APIS, AgentWorkload
from tests.conftest import TOKENIZER_DIR

PAGE = 16


def test_reachable_tokens_are_the_computed_tokens_in_whole_pages():
    assert reachable_tokens(100, 20, PAGE) == 112  # 119 computed tokens: 7 pages
    assert reachable_tokens(32, 1, PAGE) == 32  # the one sampled token was never computed
    assert reachable_tokens(31, 2, PAGE) == 32
    assert reachable_tokens(15, 1, PAGE) == 0
    with pytest.raises(ValueError, match="page_size"):
        reachable_tokens(10, 1, 0)


def test_workload_checks_name_their_options_and_spread_forced_turns():
    for bad, option in [(dict(sessions=0), "--agent-sessions"), (dict(turns=0), "--agent-turns"),
                        (dict(apis=("chat", "completions")), "--agent-apis"), (dict(apis=()), "--agent-apis"),
                        (dict(tool_share=1.5), "--agent-tool-share"), (dict(max_tokens=0), "--max-output-tokens"),
                        (dict(concurrency=0), "--concurrency")]:
        with pytest.raises(ValueError, match=option):
            AgentWorkload(**bad)
    half = AgentWorkload(tool_share=0.5)
    assert [half.forced(0, k) for k in range(6)] == [False, True] * 3
    assert [half.forced(1, k) for k in range(6)] == [True, False] * 3  # shifted per session
    assert not any(AgentWorkload(tool_share=0).forced(s, k) for s in range(3) for k in range(6))
    assert all(AgentWorkload(tool_share=1).forced(s, k) for s in range(3) for k in range(6))
    assert sum(AgentWorkload(tool_share=0.25).forced(0, k) for k in range(8)) == 2


def test_annotate_and_summarize_on_given_rows():
    def row(api, session, turn, prompt, output, cached, calls):
        return {"api": api, "session": session, "turn": turn, "forced": bool(calls), "prompt_tokens": prompt,
                "output_tokens": output, "cached_tokens": cached, "tool_calls": calls, "finish": "stop"}

    rows = annotate([row("chat", 0, 0, 230, 40, 0, 1), row("chat", 0, 1, 300, 10, 256, 0),
                     row("chat", 0, 2, 330, 5, 304, 0), row("chat", 1, 0, 231, 7, 208, 0)], PAGE, 208)
    assert [r["kind"] for r in rows] == ["first", "tool", "text", "new-session"]
    assert [r["reachable_tokens"] for r in rows] == [None, 256, 304, 208]
    assert [r["ratio"] for r in rows] == [None, 1.0, 1.0, 1.0]
    assert [r["lost"] for r in rows] == [None, False, False, None]
    rows[2]["cached_tokens"] = 288  # turn 1's prompt (300 tokens: 288 in whole pages), none of its output
    assert annotate(rows, PAGE, 208)[2]["lost"]
    [text] = [s for s in summarize(annotate(rows, PAGE, 208)) if s["api"] == "chat" and s["kind"] == "text"]
    assert text == {"api": "chat", "kind": "text", "turns": 1, "cached_tokens": 288, "reachable_tokens": 304,
                    "ratio": 288 / 304, "min_ratio": 288 / 304, "full_turns": 0, "lost_turns": 1}
    assert annotate(rows[:1] + rows[3:], PAGE, None)[1]["ratio"] is None  # no bound: not counted


def test_the_command_refuses_what_it_does_not_take(capsys):
    from kvtier.cli import main

    assert main(["bench", "--workload", "sdk-agents", "--trace", "x.json"]) == 2
    assert "--workload sdk-agents makes its own sessions" in capsys.readouterr().err
    assert main(["bench", "--workload", "sdk-agents", "--agent-apis", "chat,completions"]) == 2
    assert "--agent-apis" in capsys.readouterr().err


def test_sessions_through_the_sdks_report_cached_over_reachable(tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("anthropic")
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    from kvtier.bench.agent_sessions import bench_agents, local_server
    from kvtier.tokenize import load_tokenizer

    workload = AgentWorkload(sessions=1, turns=3, max_tokens=32)
    out = tmp_path / "agents.json"
    with local_server("tiny", str(TOKENIZER_DIR), ["--page-size", str(PAGE)]) as server:
        result = bench_agents(workload, model="tiny", tokenizer=str(TOKENIZER_DIR), page_size=PAGE,
                              endpoint=f"{server.url}/v1", json_path=str(out))
    assert server.proc.poll() is not None  # stopped by its PID
    assert json.loads(out.read_text()) == result
    assert result["provenance"]["commit"] and result["provenance"]["page_size"] == PAGE
    evicted = result["provenance"]["evicted_during_run"]  # kvtier serve counts them
    assert evicted is not None and all(n >= 0 for tiers in evicted.values() for n in tiers.values())

    rows = result["turns"]
    assert [(r["api"], r["turn"]) for r in rows] == [(api, k) for api in APIS for k in range(3)]
    shared = shared_prefix_tokens(load_tokenizer(TOKENIZER_DIR), PAGE)
    assert shared > 0 and shared % PAGE == 0 and result["provenance"]["shared_prefix_tokens"] == shared
    for i, r in enumerate(rows):
        assert 0 <= r["cached_tokens"] < r["prompt_tokens"] and r["output_tokens"] >= 1
        if r["forced"]:
            assert r["tool_calls"] >= 1, r
        if r["turn"] == 0:
            assert (r["kind"], r["reachable_tokens"]) == (("first", None) if i == 0 else ("new-session", shared))
            continue
        prev = rows[i - 1]
        assert r["prompt_tokens"] > prev["prompt_tokens"]  # the history came back, and more
        assert r["kind"] == ("tool" if prev["tool_calls"] else "text")
        reach = (prev["prompt_tokens"] + prev["output_tokens"] - 1) // PAGE * PAGE
        assert r["reachable_tokens"] == reach and r["ratio"] == r["cached_tokens"] / reach
        assert r["lost"] == (r["cached_tokens"] <= prev["prompt_tokens"] // PAGE * PAGE)
    assert any(r["forced"] for r in rows) and not all(r["forced"] for r in rows)

    counted = [r for r in rows if r["ratio"] is not None]
    for s in result["summary"]:
        group = [r for r in counted if r["kind"] == s["kind"] and s["api"] in ("all", r["api"])]
        assert s["turns"] == len(group) and s["cached_tokens"] == sum(r["cached_tokens"] for r in group)
        assert s["reachable_tokens"] == sum(r["reachable_tokens"] for r in group)
        assert s["ratio"] == s["cached_tokens"] / s["reachable_tokens"]
        assert s["min_ratio"] == min(r["ratio"] for r in group)
        assert s["lost_turns"] == sum(bool(r["lost"]) for r in group)
    assert {(s["api"], s["kind"]) for s in result["summary"]} >= {("all", "new-session"), ("chat", "tool")}
